"""Planner cost beside vLLM's own, in one process, interleaved step by step.

The setting of ``bench_planner`` (``bench.planner.scenarios``): one
full-attention group of 16-token blocks, R running requests of 2,048 or 8,192 stored blocks each,
one new block per request per step, and 20 of the CPU tier's cached blocks per running request
evicted before each step in LRU order (the tier's next victims, as a real tier's pressure evicts
them; 20 is 1% of 2,048, the issue's setting), CPU blocks freed head first (vLLM's order) in
every variant. The evictions per step are the same at both block counts: what changes in a step
follows the stores that push blocks out, not the context length, so the block-count target
compares steps that change as many blocks (``--evict FRACTION`` evicts a share of the cached
blocks instead, which grows with the blocks held). Variants, each with its own pools and requests:

- ``vllm_control``: vLLM's ``SimpleCPUOffloadScheduler.build_connector_meta``, its cursor scan;
- ``vllm_rescan_restore``: the re-store design this project started from, written as a subclass:
  after a CPU eviction, every step re-scans each request from block 0 (Phase 1a: stored blocks
  whose hash the CPU no longer holds, re-stored) before the new blocks past the cursor (1b);
- ``kvt_loop_control``, ``kvt_fused_control``, ``kvt_fused_restore``: kvtriton's
  ``OffloadPlanner.build_meta`` on kvtriton's pools (the loop reference or the fused scan);
- ``kvt_connector_fused_control``, ``kvt_connector_fused_restore``: the same planner inside
  ``KVTritonConnector``'s scheduler side on vLLM's pools, fed vLLM's scheduler-output shape: the
  adapter's cost included.

Per step, the variants run one after another (interleaved), so machine noise falls on all; only
the build call is timed, not the evictions, new blocks or completions between steps. Reported:
per-step median and quartiles, blocks stored per step, each variant's ratio to ``vllm_control``
and to ``vllm_rescan_restore``, and for re-store rows the cost per stored block.

Where the time goes, per variant (medians over the same steps, in ms; ``PARTS``): ``lookup``
(none here: no request waits), ``tables`` (the step's new blocks joining the request tables),
``selection`` (deciding what to store), ``cpu_alloc`` (CPU blocks allocated, evictions
included, listeners not), ``listeners`` (the planner's presence arrays told of CPU and GPU hash
changes), ``pin`` (GPU sources pinned, in-flight marks), ``adapter`` (the connector's
translation of vLLM's scheduler output and its bookkeeping around the planner) and ``meta``
(the rest: the batch, its event, the metadata object). kvtriton's parts come from the
planner's own counters (``PlannerStats``) of the timed steps. vLLM's manager keeps none, so its
parts are measured on as many extra steps after the timed ones, with its selection, CPU
allocation and GPU pin methods wrapped by timers (the wrappers' cost lands in those parts);
what vLLM does between them (its table extends, the batch) is ``meta``.

The targets at R = 128 and 256 for each block count (``targets``) are judged in the same run and
written with the figures and their verdicts to ``bench/results/vs_vllm.json``; the paper's
planner section is generated from that file.

Run: ``python -m bench.vllm.vs_vllm [--quick]`` (needs vLLM). The full run is R = 16 ... 1024
at 2,048 and 8,192 blocks per request (128K-token contexts), each size's peak memory recorded;
a size whose variants' pools together pass ``--max-blocks-held`` blocks runs them in groups
(``groups``; each row names the variants it was interleaved with); ``--sizes`` and ``--blocks``
pick some. It writes ``vs_vllm.json``; ``--quick`` (R = 128 at 2,048 blocks, the ``make bench``
size) writes ``vs_vllm_quick.json``, so a quick run leaves a full one in place; ``--name`` names
another file (the study ``vs_vllm_evict_share``: evictions as a share of the cached blocks).

The variants and their scenarios are in ``bench.vllm.vs_vllm_variants``, the targets and their
verdict in ``bench.vllm.vs_vllm_targets``.
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import tempfile
import time

from bench.common import OneLineParser, write_result
from bench.planner.scenarios import BLOCK
from bench.vllm.vs_vllm_findings import findings
from bench.vllm.vs_vllm_targets import targets
from bench.vllm.vs_vllm_variants import (
    KVT_CONFIGS,
    PARTS,
    VARIANTS,
    KvtScenario,
    VllmScenario,
)

SIZES = (16, 64, 128, 256, 512, 1024)
BLOCKS = (2048, 8192)
EVICT_PER_REQUEST = 20
# The most blocks the variants stepped together may hold, summed over them (R x blocks per
# request each): a variant takes 0.7-1.2 KB per block held (bench/results/vs_vllm.json records
# each run's peak), so seven variants at 256 x 8,192 blocks need about 13 GB. Past it, a size
# runs its variants in groups, packed in ``PACKING`` order under the bound, each group
# interleaved step by step, one group after the other.
MAX_BLOCKS_HELD = 7 * 256 * 8192
# The targets' trio first, so that it stays in one group as long as three variants fit.
PACKING = ("vllm_control", "kvt_fused_control", "kvt_fused_restore",
           "kvt_connector_fused_control", "kvt_connector_fused_restore", "kvt_loop_control",
           "vllm_rescan_restore")
QUICK_SIZES = (128,)  # the size of the targets; the full run has 16 ... 1024


def _scenario(variant: str, r: int, blocks: int, steps: int, evict: float, model_dir: str,
              max_model_len: int, per_request: int | None):
    if variant in KVT_CONFIGS:
        return KvtScenario(variant, r, blocks, steps, evict, per_request)
    return VllmScenario(variant, r, blocks, steps, evict, model_dir, max_model_len, per_request)


def max_model_len(blocks: int, steps: int, warmup: int) -> int:
    """A model length past every request's last token: the connector keys a request only up to
    it (vLLM's own manager does not look)."""
    return max(65536, (blocks + 2 * steps + warmup + 2) * BLOCK)


def groups(variants: list[str], r: int, blocks: int, max_blocks_held: int) -> list[list[str]]:
    """``variants`` in groups stepped together: all of them when their pools fit under
    ``max_blocks_held`` blocks in all, else packed in ``PACKING`` order (each group as many
    as fit, one at least)."""
    if len(variants) * r * blocks <= max_blocks_held:
        return [list(variants)]
    out: list[list[str]] = []
    for v in sorted(variants, key=PACKING.index):
        if out and (len(out[-1]) + 1) * r * blocks <= max_blocks_held:
            out[-1].append(v)
        else:
            out.append([v])
    return out


def run_size(r: int, blocks: int, steps: int, warmup: int, evict: float, variants: list[str],
             model_dir: str, model_len: int = 65536,
             evict_per_request: int | None = None,
             max_blocks_held: int = MAX_BLOCKS_HELD) -> list[dict]:
    """Every variant at R = ``r``, stepped interleaved with those of its group (``groups``:
    all of them unless their pools outgrow ``max_blocks_held``); one row per variant, with
    its ratios to the vLLM variants. Evictions per step: ``evict_per_request`` blocks per
    request, or ``evict`` of the cached blocks when None."""
    rows = []
    parts = groups(variants, r, blocks, max_blocks_held)
    for group in parts:
        if len(parts) > 1:
            print(f"  group: {', '.join(group)}", flush=True)
        rows += _run_interleaved(r, blocks, steps, warmup, evict, group, model_dir, model_len,
                                 evict_per_request)
    base = {row["variant"]: row for row in rows}
    for row in rows:
        row["interleaved_with"] = row.pop("_group")
        for ref in ("vllm_control", "vllm_rescan_restore"):
            if ref in base:
                row[f"x_vs_{ref}"] = base[ref]["median_ms"] / row["median_ms"]
    return rows


def _run_interleaved(r: int, blocks: int, steps: int, warmup: int, evict: float,
                     variants: list[str], model_dir: str, model_len: int,
                     evict_per_request: int | None) -> list[dict]:
    """``variants`` at R = ``r``, stepped interleaved; one row per variant. vLLM's parts come
    from ``steps`` more steps with timers on (``VllmScenario.time_parts``)."""
    scen, setup = {}, {}
    for v in variants:
        gc.collect()
        t0 = time.perf_counter()
        scen[v] = _scenario(v, r, blocks, 2 * steps + warmup, evict, model_dir, model_len,
                            evict_per_request)
        setup[v] = time.perf_counter() - t0
    rss_gib = _max_rss_gib()
    times: dict[str, list[float]] = {v: [] for v in variants}
    stored: dict[str, list[int]] = {v: [] for v in variants}
    parts: dict[str, dict[str, list[float]]] = {v: {k: [] for k in PARTS} for v in variants}
    gc.disable()  # a collection inside one variant's timed call would charge it alone
    try:
        for i in range(2 * steps + warmup):
            if i == steps + warmup:
                for v in variants:
                    if v.startswith("vllm"):
                        scen[v].time_parts()
            for v in variants:
                if i >= steps + warmup and not v.startswith("vllm"):
                    continue
                dt, n, p = scen[v].step()
                if warmup <= i < steps + warmup:
                    times[v].append(dt * 1e3)
                    stored[v].append(n)
                if (i >= warmup) and (i >= steps + warmup) == v.startswith("vllm"):
                    for k, x in p.items():
                        parts[v][k].append(x * 1e3)
            gc.collect()
    finally:
        gc.enable()
    rows = []
    for v in variants:
        q = statistics.quantiles(times[v], n=4)
        med = statistics.median(times[v])
        per_step = statistics.mean(stored[v])
        rows.append({"variant": v, "requests": r, "blocks_per_request": blocks,
                     "evict_fraction": None if evict_per_request is not None else evict,
                     "evict_per_request": evict_per_request,
                     "median_ms": med, "p25_ms": q[0], "p75_ms": q[2],
                     "min_ms": min(times[v]), "stored_per_step": per_step,
                     "us_per_stored_block": 1e3 * med / per_step if per_step else None,
                     "parts_ms": {k: statistics.median(x) if x else 0.0
                                  for k, x in parts[v].items()},
                     "parts_from": ("extra steps, timers on" if v.startswith("vllm")
                                    else "the timed steps (planner counters)"),
                     "setup_s": setup[v], "max_rss_gib": rss_gib, "_group": list(variants)})
    del scen
    gc.collect()
    return rows


def _max_rss_gib() -> float:
    """The process's peak resident memory so far, in GiB (the variants' pools held)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _print(rows: list[dict]) -> None:
    print(f"{'variant':28s} {'R':>4s} {'blocks':>6s} {'median ms':>9s} {'min ms':>7s} "
          f"{'p25-p75 ms':>15s} "
          f"{'stored':>7s} {'us/blk':>6s} {'x ctl':>5s} {'x rescan':>8s}  "
          + " ".join(f"{p[:8]:>8s}" for p in PARTS))
    for row in rows:
        per = row["us_per_stored_block"]
        print(f"{row['variant']:28s} {row['requests']:4d} {row['blocks_per_request']:6d} "
              f"{row['median_ms']:9.3f} {row['min_ms']:7.3f} "
              f"{row['p25_ms']:7.3f}-{row['p75_ms']:<7.3f} "
              f"{row['stored_per_step']:7.0f} {per if per is not None else float('nan'):6.3f} "
              f"{row.get('x_vs_vllm_control', float('nan')):5.2f} "
              f"{row.get('x_vs_vllm_rescan_restore', float('nan')):8.1f}  "
              + " ".join(f"{row['parts_ms'][p]:8.3f}" for p in PARTS), flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.vllm.vs_vllm",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"R = {', '.join(map(str, QUICK_SIZES))} at 2,048 blocks; 5 steps")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--blocks", type=int, nargs="+", default=None,
                    help="blocks per request (default: 2,048 and 8,192)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--evict-per-request", type=int, default=None,
                    help=f"CPU blocks evicted per running request before each step (default "
                         f"{EVICT_PER_REQUEST})")
    ap.add_argument("--evict", type=float, default=None,
                    help="evict this share of the cached CPU blocks instead (grows with the "
                         "blocks held)")
    ap.add_argument("--max-blocks-held", type=int, default=MAX_BLOCKS_HELD,
                    help="the most blocks the variants stepped together may hold in all "
                         "(R x blocks per request x variants); past it they run in groups, each "
                         "interleaved (memory)")
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--name", default=None, metavar="STEM",
                    help="the results file's name without .json (default vs_vllm, "
                         "vs_vllm_quick with --quick): another setting beside the default one")
    args = ap.parse_args(argv)
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9_]+", args.name):
        ap.error(f"--name: letters, digits and _ only (a file in bench/results/), "
                 f"got {args.name!r}")
    sizes = args.sizes or list(QUICK_SIZES if args.quick else SIZES)
    block_counts = args.blocks or ([2048] if args.quick else list(BLOCKS))
    steps = args.steps or (5 if args.quick else 20)
    if args.evict is not None and args.evict_per_request is not None:
        ap.error("--evict and --evict-per-request: give one")
    if args.evict is not None and not 0 <= args.evict <= 1:
        ap.error(f"--evict: a share in [0, 1], got {args.evict}")
    if args.evict_per_request is not None and args.evict_per_request < 0:
        ap.error(f"--evict-per-request: >= 0, got {args.evict_per_request}")
    per_request = None if args.evict is not None else \
        (EVICT_PER_REQUEST if args.evict_per_request is None else args.evict_per_request)
    fraction = args.evict if args.evict is not None else 0.0
    if args.max_blocks_held < 1:
        ap.error(f"--max-blocks-held: >= 1, got {args.max_blocks_held}")
    grouped = [(r, b) for b in block_counts for r in sizes
               if len(groups(args.variants, r, b, args.max_blocks_held)) > 1]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        model_len = max_model_len(max(block_counts), steps, args.warmup)
        model_dir = str(tiny_model_dir(tmp, model_len))
        for blocks in block_counts:
            for r in sizes:
                big = (r, blocks) in grouped
                print(f"\nR = {r}: {blocks} blocks per request, {steps} timed steps"
                      + (f" (past {args.max_blocks_held:,} blocks held in all: the variants in "
                         "groups)" if big else ""), flush=True)
                size_rows = run_size(r, blocks, steps, args.warmup, fraction, args.variants,
                                     model_dir, model_len, per_request, args.max_blocks_held)
                _print(size_rows)
                rows += size_rows
    met = targets(rows)
    print()
    for t in met:
        low = "" if t["value_min"] is None else f"; fastest steps {t['value_min']:.3f}"
        print(f"target {t['name']} at R = {t['requests']}, {t['blocks_per_request']} blocks: "
              f"{t['value']:.3f} (target {t['target']}): {'met' if t['met'] else 'MISSED'}{low}")
    payload = {"settings": {"sizes": sizes, "blocks_per_request": block_counts, "steps": steps,
                            "warmup": args.warmup, "evict_fraction": args.evict,
                            "evict_per_request": per_request,
                            "max_blocks_held": args.max_blocks_held,
                            "grouped": [{"requests": r, "blocks_per_request": b}
                                        for r, b in grouped],
                            "packing": list(PACKING),
                            "eviction_order": "lru", "cpu_free_order": "head_first",
                            "block_tokens": BLOCK, "parts": list(PARTS),
                            "vllm": vllm.__version__},
               "rows": rows, "targets": met}
    # The quick run has a file of its own: make bench keeps the full run's.
    path = write_result(args.name or ("vs_vllm_quick" if args.quick else "vs_vllm"), payload,
                        findings=findings)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
