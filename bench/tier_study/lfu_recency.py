"""Where frequency-first eviction loses: the sequential-chat shape (``SEQUENTIAL_CHAT``).

A finding in the real engine: on a long chat-like run with a 150-block CPU tier, ``eager+lfu:64``
and ``eager+lfu:64+waiting`` kept 17-29% of the CPU-hit tokens of ``eager``. This study replays
the same shape in the simulator and measures why. The sketch counts every admitted request's
keys. A conversation's early blocks are in every one of its later prompts, so they reach high
counts; when that conversation ends, they stay ranked above the next conversation's fresh blocks,
which have been counted once or twice. The tier then evicts the live conversation's blocks
(``running_evictions``: CPU copies of running requests' blocks evicted) and keeps the dead one.

Each setup runs on the shape's own seed (the one its sizes were chosen on) and on held-out seeds.
Two changes to the sketch are measured beside it, each on this shape and on the tier study's
workloads, split into train and test parts as ``bench_setups`` does:

- ``lfu:4``: a shorter aging window (4 tier sizes of sightings instead of 64), so that counts
  of a finished conversation are halved sooner;
- ``lfu:64`` counting only the keys past the request's GPU prefix hit (``MISS_ONLY``), so that a
  prefix the GPU keeps serving gains no rank in the CPU tier. It is a setting of the study
  (``miss_only``), not a setup name: it is reported, not offered.

Run: ``python -m bench.tier_study.lfu_recency [--seeds N] [--json out.json]`` (about 3 minutes on 2
cores with ``--no-study-workloads``; the tier study's workloads add about 10).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from bench.tier_study.study import run_all

#: The setups on the chat shape: the control, the study's frequency setups, the shorter window,
#: and the references (next use: an oracle; a tier that holds everything).
CHAT_SETUPS = ("eager", "eager+lfu:64", "eager+lfu:64+waiting", "eager+lfu:4")
REFERENCES = ("eager+nextuse", "eager+inf")
#: The setups re-run with the sketch counting only GPU misses.
MISS_ONLY_SETUPS = ("eager+lfu:64", "eager+lfu:4")
#: The tier study's workloads (``bench.tier_study.study.workloads``) the changes are checked on, at
#: CPU = GPU, the capacity where ``lfu:64`` was chosen.
STUDY_WORKLOADS = ("cc_agentic", "mooncake", "agent")
STUDY_SETUPS = ("eager", "eager+lfu:64", "eager+lfu:4")
HELD_OUT_SEEDS = 5
#: A change recovers the chat shape's hits when, on the held-out seeds together, it keeps at
#: least this share of the control's CPU-hit tokens.
RECOVERS_SHARE = 0.9
#: A change keeps ``lfu:64``'s gain when on no study workload's part it is more than this many
#: points of token hit rate below ``lfu:64``. Judged on the train parts; the test parts report.
KEEPS_GAIN_POINTS = 1.0
#: The changes: (name in the results, setup, miss only).
CHANGES = (("eager+lfu:4", "eager+lfu:4", False),
           ("eager+lfu:64 (miss only)", "eager+lfu:64", True),
           ("eager+lfu:4 (miss only)", "eager+lfu:4", True))


@contextlib.contextmanager
def miss_only() -> Iterator[None]:
    """While open, a demand-learning CPU eviction counts only the keys of an admitted request
    past its GPU prefix hit (the ``num_computed_tokens`` of its last lookup)."""
    from kvtriton.planner.planner import OffloadPlanner
    from kvtriton.planner.stores import Stores

    lookup, admit = OffloadPlanner.get_num_new_matched_tokens, Stores.admit
    gpu_hit: dict[str, int] = {}

    def recording_lookup(self, req, num_computed_tokens):
        gpu_hit[req.request_id] = int(num_computed_tokens)
        return lookup(self, req, num_computed_tokens)

    def admit_counting_misses(self, req):
        demand = self._demand
        if demand is None or req.request_id in self._states:
            return admit(self, req)
        skip = gpu_hit.pop(req.request_id, 0) // self._align

        def missed(_keys):
            demand(np.unique(np.concatenate([k[skip:] for k in self._primary_keys(req)])))

        self._demand = missed
        try:
            return admit(self, req)
        finally:
            self._demand = demand

    OffloadPlanner.get_num_new_matched_tokens = recording_lookup
    Stores.admit = admit_counting_misses
    try:
        yield
    finally:
        OffloadPlanner.get_num_new_matched_tokens = lookup
        Stores.admit = admit


_FIELDS = ("token_hit_rate", "cpu_hit_tokens", "gpu_hit_tokens", "recomputed_tokens",
           "stored_blocks", "running_evictions", "ttft_p50_s", "ttft_p90_s")


def _row(row: dict) -> dict:
    out = {k: row[k] for k in _FIELDS}
    if "parts" in row:
        out["parts"] = {p: {k: v[k] for k in ("token_hit_rate", "cpu_hit_tokens")}
                        for p, v in row["parts"].items()}
    return out


def _task(task: tuple) -> tuple:
    """One simulation in a worker process: ``(key, workload, simulate kwargs, miss_only)``."""
    key, wl, kw, miss = task
    from kvtriton.sim import simulate

    with miss_only() if miss else contextlib.nullcontext():
        res = simulate(wl, bound=False, references=(), **kw)
    return key, {r["setup"]: _row(r) for r in res.rows}


def chat_tasks(seeds: list[int]) -> list[tuple]:
    from kvtriton.sim.workload import agent_workload
    from kvtriton.sim.workloads import WORKLOADS

    caps = WORKLOADS["chat"].capacities()
    tasks = []
    for s in seeds:
        wl = agent_workload(replace(chat_shape(), seed=s))
        tasks.append(((f"chat/{s}", "all"), wl,
                      {**caps, "setups": [*CHAT_SETUPS, *REFERENCES]}, False))
        tasks.append(((f"chat/{s}", "miss_only"), wl,
                      {**caps, "setups": list(MISS_ONLY_SETUPS)}, True))
    return tasks


def chat_shape():
    """The shape's generator setting (a function: tests run the study on a smaller one)."""
    from kvtriton.sim.workloads import SEQUENTIAL_CHAT

    return SEQUENTIAL_CHAT


def study_workloads() -> dict:
    """The tier study's full-size workloads (``bench.tier_study.study.workloads``)."""
    from bench.tier_study.study import workloads

    return workloads(quick=False)


def study_tasks(tags: tuple[str, ...]) -> list[tuple]:
    from bench.tier_study.study import SPLITS
    from kvtriton.sim.splits import split_named

    wls = study_workloads() if tags else {}
    tasks = []
    for tag in tags:
        wl, gpu, _ = wls[tag]
        caps = {"gpu_tokens": gpu, "cpu_tokens": gpu, "parts": split_named(SPLITS[tag], wl)}
        for p in STUDY_SETUPS:
            tasks.append(((tag, "all", p), wl, {**caps, "setups": [p]}, False))
            if "lfu" in p:
                tasks.append(((tag, "miss_only", p), wl, {**caps, "setups": [p]}, True))
    return tasks


def summarise(results: dict, seeds: list[int], chosen_seed: int) -> dict:
    """Per seed: each setup's CPU-hit tokens over the control's; over the held-out seeds: the
    setups' totals and the verdict (frequency loses where its total is below the control's)."""
    held = [s for s in seeds if s != chosen_seed]

    def total(seeds_, setup, variant):
        return sum(results[(f"chat/{s}", variant)][setup]["cpu_hit_tokens"] for s in seeds_)

    control = total(held, "eager", "all")
    share = {}
    for setup in CHAT_SETUPS[1:] + REFERENCES:
        share[setup] = total(held, setup, "all") / control if control else None
    for setup in MISS_ONLY_SETUPS:
        share[f"{setup} (miss only)"] = (total(held, setup, "miss_only") / control
                                         if control else None)
    return {"held_out_seeds": held, "control_cpu_hit_tokens": control,
            "cpu_hit_share_of_control": share,
            "running_evictions": {setup: sum(results[(f"chat/{s}", "all")][setup]
                                             ["running_evictions"] for s in held)
                                  for setup in (*CHAT_SETUPS, *REFERENCES)},
            "lfu_loses": bool(share["eager+lfu:64"] is not None and share["eager+lfu:64"] < 1)}


def verdicts(summary: dict, study: dict) -> list[dict]:
    """Per change: whether it recovers the chat shape's hits (held-out seeds) and, per part,
    its points against ``lfu:64`` on every study workload, worst first; chosen (``adopt``) only
    if it recovers and keeps the gain on the train parts."""
    out = []
    for name, _, _ in CHANGES:
        share = summary["cpu_hit_share_of_control"].get(name)
        worst = {}
        for part in ("train", "test"):
            pts = {tag: round(100 * (rows[name]["parts"][part]["token_hit_rate"]
                                     - rows["eager+lfu:64"]["parts"][part]["token_hit_rate"]), 2)
                   for tag, rows in study.items() if name in rows}
            worst[part] = dict(sorted(pts.items(), key=lambda kv: kv[1]))
        recovers = share is not None and share >= RECOVERS_SHARE
        keeps = {part: bool(worst[part]) and min(worst[part].values()) >= -KEEPS_GAIN_POINTS
                 for part in worst}
        out.append({"change": name, "chat_cpu_hit_share_of_control": share,
                    "recovers_chat": recovers, "points_vs_lfu64": worst,
                    "keeps_gain": keeps, "adopt": recovers and keeps["train"]})
    return out


def findings(name: str, doc: dict) -> dict:
    """The study's workloads in the paper's words and, per change, its worst points against
    ``lfu:64`` on each part, ``[workload, points]``."""
    from bench.tier_study.setup_findings import WORKLOAD_NAMES

    worst = []
    for c in doc["verdicts"]:
        pts = c["points_vs_lfu64"]
        worst.append({part: list(min(pts[part].items(), key=lambda kv: kv[1]))
                      for part in pts if pts[part]})
    return {"labels": {tag: WORKLOAD_NAMES.get(tag, tag) for tag in doc["study_workloads"]},
            "worst_vs_lfu64": worst}


def main(argv: list[str] | None = None) -> int:
    from bench.common import OneLineParser, write_result
    from kvtriton.sim.workloads import WORKLOADS

    ap = OneLineParser(prog="python -m bench.tier_study.lfu_recency",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=HELD_OUT_SEEDS,
                    help=f"held-out seeds of the chat shape (default {HELD_OUT_SEEDS})")
    ap.add_argument("--no-study-workloads", action="store_true",
                    help="skip the tier study's workloads (the chat shape only)")
    ap.add_argument("--json", default="bench/results/lfu_recency.json")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error(f"--seeds {args.seeds}: give at least one held-out seed")
    t0 = time.perf_counter()
    shape = chat_shape()
    chosen = shape.seed
    seeds = [chosen, *range(chosen + 1, chosen + 1 + args.seeds)]
    tags = () if args.no_study_workloads else STUDY_WORKLOADS
    # The longest simulations first: the study workloads', then the chat seeds.
    tasks = study_tasks(tags) + chat_tasks(seeds)
    results = run_all(tasks, not args.quiet, "lfu recency", _task)
    summary = summarise(results, seeds, chosen)
    chat = {str(s): {**results[(f"chat/{s}", "all")],
                     **{f"{p} (miss only)": r
                        for p, r in results[(f"chat/{s}", "miss_only")].items()}}
            for s in seeds}
    study = {tag: {(p if v == "all" else f"{p} (miss only)"): rows[p]
                   for (t, v, *p_), rows in results.items() if t == tag for p in p_}
             for tag in tags}
    payload = {"shape": {"config": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
                         "capacities": WORKLOADS["chat"].capacities(),
                         "chosen_seed": chosen},
               "chat": chat, "summary": summary, "study_workloads": study,
               "rule": {"recovers_share": RECOVERS_SHARE,
                        "keeps_gain_points": KEEPS_GAIN_POINTS, "judged_on": "train"},
               "verdicts": verdicts(summary, study) if study else [],
               "study_split": {tag: "train/test as bench.tier_study.setups" for tag in tags},
               "elapsed_s": round(time.perf_counter() - t0, 1)}
    path = Path(args.json)
    write_result(path.stem, payload, path.parent, findings)
    sh = summary["cpu_hit_share_of_control"]
    print(f"chat shape, held-out seeds {summary['held_out_seeds']}: CPU-hit tokens over eager's "
          + ", ".join(f"{k} {v:.2f}" for k, v in sh.items() if v is not None))
    for tag, rows in study.items():
        hit = {p: [r["parts"][part]["token_hit_rate"] for part in ("train", "test")]
               for p, r in rows.items()}
        print(f"{tag}: " + ", ".join(f"{p} {a:.4f}/{b:.4f}" for p, (a, b) in hit.items())
              + " (train/test hit rate)")
    for v in payload["verdicts"]:
        print(f"{v['change']}: recovers chat {v['recovers_chat']}, keeps lfu:64's gain "
              f"train {v['keeps_gain']['train']} / test {v['keeps_gain']['test']}, adopt "
              f"{v['adopt']}")
    print(f"wrote {path} ({payload['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
