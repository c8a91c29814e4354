"""kvtriton's scheduler side against vLLM's own ``SimpleCPUOffloadScheduler``, step for step.

One real vLLM ``Scheduler`` runs a random schedule (shared prefixes, repeated prompts, chunked
prefill, decode, preemption, aborts, the finish flush, transfer reports 0-2 steps late; then the
GPU prefix cache is dropped and earlier prompts come back, so most schedules load from the CPU
tier). Its connector is ``TeeConnector`` (``bench.conformance.differential_tee``): every call goes
to vLLM's manager, whose answers drive the scheduler, and to kvtriton's ``SchedulerSide`` with the
same setup (re-store off, head-first freeing, LRU).

While the two are *in step* (every seed starts so) each answer is compared: lookup hits, stored
GPU blocks, loaded blocks and the hashes their CPU blocks hold, every request's store cursor,
each finish flush, and the CPU tier's contents after every call that changes them. Known
differences (``KVTritonConnector``'s docstring) are accepted only with their evidence:

- ``per_request_allocation``: vLLM allocates CPU blocks per request inside its scan, evicting as
  it goes; kvtriton classifies the whole step against the tier as it stood before allocating.
  vLLM may store a block kvtriton passed as cached only if the block was cached before the step,
  this step's allocations evicted it, and kvtriton's cursor is past it. A cursor gap (kvtriton
  ahead) opens only where vLLM spent its whole budget and stopped at a hash the step evicted, and
  every position kvtriton passed must have been cached, in flight or stored by it when it passed
  it. vLLM storing, later, a block inside a gap, and a finish flush that starts at vLLM's lagging
  cursor (its extra blocks all inside the gap), are the same difference.
- ``budget``: a block only kvtriton stored, where vLLM spent its whole budget on stores kvtriton
  did not make and its cursor has not passed that block (vLLM defers it).
- ``in_flight_duplicate``: vLLM copies a GPU block whose hash kvtriton has in flight, or stores
  this step, from *another* GPU block (vLLM dedups by GPU block id, kvtriton by hash too).
- ``key_collision``: vLLM stores (or flushes) a block at a position kvtriton cannot bind
  (``kvtriton.vllm.keys``: that position is never stored for this request). The evidence is
  taken from vLLM's requests, never from kvtriton's own list of unbound ids (a position it
  failed to bind would excuse itself): the request hashed that position while admitted, after
  another request had made the same hash (``HashOrigins``).
- ``failed_store``: the driver reports some of kvtriton's stores failed (in a share of the
  seeds; vLLM's worker has no failure report, so its stores complete): kvtriton's tier lacks
  those blocks.

Anything else is *unrecognised*, and fails the test. After a recognised difference the tiers
hold different blocks: the pair is *apart*. Every step, in step or apart, kvtriton is held to
models kept from what crosses the connector's boundary alone
(``bench.conformance.differential_models``): its CPU tier's contents, pins and free queue against
``TierModel`` (the tier's LRU rules: stores take the head, completions free head first, failures
free unhashed); a lookup hit is the longest run the model holds, capped to recompute the last token;
a step's load is exactly the hits accepted since the last step, CPU blocks of the hit into the GPU
blocks past the local hit; a store copies hashed blocks neither cached nor in flight onto the head
of the free queue, within the free blocks, and a scan that spent its budget moves no later cursor; a
finish flush is every confirmed block past the cursor that the model does not hold
(``expected_flush``); and the planner's and the pool's stated invariants hold. kvtriton is fed
answers it can serve (an accepted hit no longer than its own). The pair is *in step* again, and
compared again, as soon as both hold the same CPU contents in the same eviction order, the same
stores in flight, the same loads in flight and the same cursors.

``run_seed`` runs one seed, ``main`` many (the bench study: outcome counts per seed in JSON);
``MUTATIONS`` (``bench.conformance.differential_mutations``) are known bug classes, each of which
the comparison must catch wherever it changes an answer, planted from the start or at the first
recognised difference (``mutation_table``).

Run: ``python -m bench.conformance.differential [--seeds N] [--first S] [--mutations]
[--json out.json]`` (3,000 seeds by default, about 15 minutes on one core; ``--mutations`` plants
every bug class two ways in every seed).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.conformance.differential_checks import BS, Record
from bench.conformance.differential_mutations import MUTATIONS, fired, reset_fired

#: The share of seeds whose kvtriton store reports may fail, and the share of those seeds' store
#: events that do.
FAILED_STORE_SEEDS = 0.3
FAILED_STORE_SHARE = 0.1


def _prompts(rng: np.random.Generator, n: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens): three prefix families, some prompts repeated exactly."""
    families = [rng.integers(1, 30000, int(rng.integers(2, 9)) * BS).tolist() for _ in range(3)]
    out: list[tuple[list[int], int]] = []
    for _ in range(n):
        if out and rng.random() < 0.15:
            p, _ = out[int(rng.integers(len(out)))]
        else:
            head = families[int(rng.integers(3))] if rng.random() < 0.8 else []
            p = head + rng.integers(1, 30000, int(rng.integers(1, 80))).tolist()
        out.append((list(p), int(rng.integers(1, 40))))
    return out


def _returning(rng: np.random.Generator, earlier: list[tuple[list[int], int]]
               ) -> list[tuple[list[int], int]]:
    """Earlier prompts coming back (some with a new tail): CPU hits once the GPU cache is gone."""
    out = []
    for _ in range(int(rng.integers(3, 9))):
        p, mx = earlier[int(rng.integers(len(earlier)))]
        if rng.random() < 0.5:
            p = p[:len(p) // BS * BS] + rng.integers(1, 30000, int(rng.integers(1, 40))).tolist()
        out.append((list(p), mx))
    return out


def run_seed(model_dir, seed: int, max_steps: int = 1200, plant_apart: str | None = None
             ) -> Record:
    """One random schedule through vLLM's scheduler with ``TeeConnector``; its record.

    ``plant_apart`` names a bug class (``MUTATIONS``) planted at the pair's first recognised
    difference and kept to the end: a bug that acts only while the two sides are apart, where
    kvtriton is held to the models of ``bench.conformance.differential_models`` alone."""
    with contextlib.ExitStack() as stack:
        plant = None if plant_apart is None else \
            (lambda: stack.enter_context(MUTATIONS[plant_apart]()))
        return _run_seed(model_dir, seed, max_steps, plant)


def _run_seed(model_dir, seed: int, max_steps: int, plant: Callable[[], None] | None
              ) -> Record:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from bench.conformance.differential_tee import TeeWorkerMetadata
    from kvtriton.sim.vllm_scheduler import default_token, make_scheduler, vllm_request
    from kvtriton.specs import FullAttentionSpec
    from kvtriton.vllm.metadata import KVTritonWorkerMetadata

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rng = np.random.default_rng(seed)
    s = make_scheduler(model_dir, [FullAttentionSpec(BS, 1, 8, 1)],
                       num_gpu_blocks=int(rng.integers(20, 65)),
                       cpu_blocks=int(rng.choice([6, 12, 24, 48, 160])),
                       max_num_batched_tokens=int(rng.choice([64, 128, 256])), max_num_seqs=8,
                       kv_connector="TeeConnector",
                       kv_connector_module_path="bench.conformance.differential_tee")
    tee = s.connector
    tee.rec.seed = seed
    tee.on_apart = plant
    first = _prompts(rng, int(rng.integers(10, 26)))
    pending = list(first)
    prefix = "r"
    # The second phase draws from its own stream: the first phase is the same schedule as
    # before it existed, whatever the second does.
    rng2 = np.random.default_rng([seed, 2])
    second = _returning(rng2, first)
    # Failed stores, in a share of the seeds, from a stream of their own (the schedule stays
    # what it was): kvtriton's worker reports the store failed, vLLM's (which has no failure
    # report) completed.
    rng3 = np.random.default_rng([seed, 3])
    fail_share = FAILED_STORE_SHARE if rng3.random() < FAILED_STORE_SEEDS else 0.0
    stores: list[tuple[int, int, int]] = []  # (due step, vLLM event, kvtriton event)
    loads: list[tuple[int, list[str], list[str]]] = []  # (due, vLLM's requests, kvtriton's)
    phase = 1
    for step in range(max_steps):
        r = rng if phase == 1 else rng2
        while pending and r.random() < 0.15:
            p, mx = pending.pop()
            s.add_request(vllm_request(f"s{seed}{prefix}{len(pending)}", p, mx, BS))
        if r.random() < 0.03 and s.requests:
            victim = sorted(s.requests)[int(r.integers(len(s.requests)))]
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        meta = so.kv_connector_metadata
        delay = int(r.integers(0, 3))
        if meta.ref.store_event >= 0 or (meta.kvt is not None and meta.kvt.store.event >= 0):
            kvt_ev = meta.kvt.store.event if meta.kvt is not None else -1
            stores.append((step + delay, meta.ref.store_event, kvt_ev))
        kvt_load = [] if meta.kvt is None or meta.kvt.load.event < 0 else \
            meta.kvt.load_event_to_reqs[meta.kvt.load.event]
        ref_load = [] if meta.ref.load_event < 0 else \
            meta.ref.load_event_to_reqs[meta.ref.load_event]
        if ref_load or kvt_load:
            loads.append((step + delay, list(ref_load), list(kvt_load)))
        done_stores = [(r_, k) for d, r_, k in stores if d <= step]
        stores = [x for x in stores if x[0] > step]
        done_loads = {r_ for d, rs, _ in loads if d <= step for r_ in rs}
        tee.kvt_finished_loads = {r_ for d, _, ks in loads if d <= step for r_ in ks}
        loads = [x for x in loads if x[0] > step]
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            sampled.append([] if req.num_computed_tokens < req.num_tokens
                           else [default_token(rid, req.num_tokens)])
        failed = {k for _, k in done_stores if k >= 0 and fail_share and rng3.random() < fail_share}
        wm = TeeWorkerMetadata(
            SimpleCPUOffloadWorkerMetadata({r_: 1 for r_, _ in done_stores if r_ >= 0}),
            KVTritonWorkerMetadata({k: 1 for _, k in done_stores if k >= 0 and k not in failed},
                                   {k: 1 for k in sorted(failed)}),
        ) if done_stores else None
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r_: i for i, r_ in enumerate(ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(
                                    finished_recving=done_loads or None,
                                    kv_connector_worker_meta=wm))
        s.update_from_output(so, out)
        if tee.kvt_finished_loads:  # vLLM had no output to hand on: kvtriton's loads alone
            tee.update_connector_output(KVConnectorOutput())
        tee.kvt_finished_loads = None
        if not pending and not s.has_requests() and not stores and not loads:
            if phase == 2 or not tee.live:  # a failed seed: kvtriton holds pins unreported
                break
            # Drop the GPU prefix cache (the CPU tiers keep theirs): returning prompts load.
            if not s.reset_prefix_cache():
                raise AssertionError(
                    f"seed {seed}: the GPU cache did not reset when idle: {tee.rec}, kvtriton "
                    f"stores {tee.kvt.planner.store_events_in_flight()}, loads "
                    f"{tee.kvt.planner.loads_in_flight()}, hits {tee.kvt.planner.pending_hits()}"
                    f", vLLM loads {list(tee.ref._reqs_to_load)}")
            pending, phase, prefix = list(second), 2, "q"
    else:
        raise AssertionError(f"seed {seed}: the schedule did not drain")
    tee.rec.steps = tee.step
    tee.rec.answers = tee.answers()
    tee.rec.apart_at_end = not tee.in_step
    if tee.live:
        tee._guard(lambda: tee.kvt.planner.check_invariants(idle=True))
    return tee.rec


# ---- known bug classes, each of which the comparison must catch ---------------------------------

def _planted_row(model_dir, name: str, seeds: list[int], baseline: dict[int, Record],
                 apart: bool) -> dict[str, list[int]]:
    """One way of planting ``name`` over ``seeds`` (from the start, or at the pair's first
    recognised difference when ``apart``): the seeds where it fired, changed an answer, was
    caught (while apart), fired only while apart, passed, or had no effect."""
    row: dict[str, list[int]] = {k: [] for k in (
        "fired", "changed", "caught", "caught_apart", "fired_only_apart", "passed",
        "no_effect")}
    for seed in seeds:
        reset_fired()
        if apart:
            rec = run_seed(model_dir, seed, plant_apart=name)
        else:
            with MUTATIONS[name]():
                rec = run_seed(model_dir, seed)
        changed = rec.answers != baseline[seed].answers
        if not fired():
            if rec.unknown:  # a bug that never acted cannot be what was caught
                raise AssertionError(f"{name} did not fire in seed {seed}, which failed: "
                                     f"{rec.unknown[0]}")
            continue
        row["fired"].append(seed)
        if changed:
            row["changed"].append(seed)
        if rec.unknown:
            row["caught"].append(seed)
            if rec.unknown_apart:
                row["caught_apart"].append(seed)
        elif changed:
            row["passed"].append(seed)
        else:
            row["no_effect"].append(seed)
        if rec.fired_apart and not rec.fired_in_step:
            row["fired_only_apart"].append(seed)
    return row


def mutation_table(model_dir, seeds: Sequence[int], mutations: list[str] | None = None,
                   baseline: dict[int, Record] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Per bug class (``MUTATIONS``), planted two ways over ``seeds``: from the start
    (``planted``), and at the pair's first recognised difference in the seeds that have one
    (``planted_apart``: a bug that acts only while kvtriton is held to the models alone).

    Each way lists, by seed: ``fired`` (the bug changed what kvtriton did), ``changed`` (an
    answer kvtriton gave differs from the unmutated run's, ``baseline``: seed -> its record,
    run here where missing), ``caught`` and ``caught_apart``, ``fired_only_apart``, and the two
    outcomes that are not a catch: ``passed`` (an answer changed and nothing was caught: the
    differential missed the bug) and ``no_effect`` (fired, every answer as without it: nothing
    any comparison could see)."""
    baseline = dict(baseline or {})
    for seed in seeds:
        if seed not in baseline:
            baseline[seed] = run_seed(model_dir, seed)
    went_apart = [s for s in seeds if baseline[s].first_difference_at is not None]
    out = {}
    for name in mutations or sorted(MUTATIONS):
        out[name] = {"planted": _planted_row(model_dir, name, list(seeds), baseline, False),
                     "planted_apart": _planted_row(model_dir, name, went_apart, baseline, True)}
        if progress is not None:
            progress(f"  {name}: " + "; ".join(
                f"{way}: fired in {len(r['fired'])}, changed {len(r['changed'])}, caught "
                f"{len(r['caught'])} ({len(r['caught_apart'])} apart), passed "
                f"{len(r['passed'])}, no effect {len(r['no_effect'])}"
                for way, r in out[name].items()))
    return out


def summarise(records: list[Record]) -> dict:
    outcomes = Counter(r.outcome for r in records)
    by_class = Counter()
    for r in records:
        by_class.update(r.differences)
    total = {name: sum(getattr(r, name) for r in records)
             for name in ("steps", "steps_compared", "steps_apart", "resyncs", "gaps_opened",
                          "lagging_steps", "exhausted_steps", "lookups", "stores", "loads")}
    first = sorted(r.first_difference_at for r in records if r.first_difference_at is not None)
    return {
        "seeds": len(records),
        "outcomes": {k: outcomes.get(k, 0) for k in ("identical", "recognised", "unrecognised")},
        "differences_by_class": dict(by_class),
        "seeds_with_loads": sum(r.loads > 0 for r in records),
        "seeds_apart_at_end": sum(r.apart_at_end for r in records),
        "seeds_resynced": sum(r.resyncs > 0 for r in records),
        "median_first_difference_step": first[len(first) // 2] if first else None,
        "totals": total,
        "unrecognised": [f"seed {r.seed}: {u}" for r in records for u in r.unknown],
    }


def main(argv: list[str] | None = None) -> int:
    from bench.common import OneLineParser, write_result

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3000)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--json", default=None,
                    help="where the outcome counts go (default bench/results/differential.json, "
                         "with --mutations differential_mutations.json)")
    ap.add_argument("--mutations", action="store_true",
                    help="also plant every known bug class over the seeds, from the start and at "
                         "the first recognised difference: per bug the seeds where it fired, "
                         "changed an answer, was caught or passed")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.first < 0:
        ap.error(f"--seeds must be >= 1 and --first >= 0, got {args.seeds} and {args.first}")
    import tempfile

    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    t0 = time.perf_counter()
    seeds = range(args.first, args.first + args.seeds)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(tmp, 8192)
        records = []
        for seed in seeds:
            records.append(run_seed(model_dir, seed))
            if (seed + 1 - args.first) % 250 == 0:
                print(f"  {seed + 1 - args.first} seeds, "
                      f"{sum(r.outcome == 'unrecognised' for r in records)} unrecognised",
                      flush=True)
        out = summarise(records)
        out["first_seed"] = args.first
        out["seeds_with_failed_stores"] = sum(r.failed_stores > 0 for r in records)
        print(f"{out['seeds']} seeds: {out['outcomes']}, differences "
              f"{out['differences_by_class']}, loads in {out['seeds_with_loads']} seeds, failed "
              f"stores in {out['seeds_with_failed_stores']}")
        for line in out["unrecognised"][:10]:
            print("  " + line)
        if args.mutations:
            out["mutations"] = mutation_table(
                model_dir, seeds, baseline=dict(zip(seeds, records, strict=True)),
                progress=lambda line: print(line, flush=True))
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"{out['elapsed_s']} s")
    name = "differential_mutations.json" if args.mutations else "differential.json"
    path = Path(args.json or f"bench/results/{name}")
    write_result(path.stem, out, path.parent)
    missed = [m for m, ways in out.get("mutations", {}).items()
              if not ways["planted"]["caught"] or any(r["passed"] for r in ways.values())]
    return 1 if out["outcomes"]["unrecognised"] or missed else 0


if __name__ == "__main__":
    sys.exit(main())
