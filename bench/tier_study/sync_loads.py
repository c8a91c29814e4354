"""Same-step loads: a per-step byte budget for CPU hits loaded and computed in one step, chosen on
a train part and judged on a test part.

With ``sync_load_budget_bytes`` (``kvtriton.sync_loads``) a CPU hit whose bytes fit what is left
of the step's budget is computed in the step that admits it, its load landing before that step's
compute, instead of waiting a step for an asynchronous load. The step then takes longer by the
load's time on the host link, which every request of the batch waits for. This study runs the
connector's default setup (``kvtriton.setups.DEFAULT_SETUP``) on each workload of the tier study
(``bench.tier_study.study.workloads``, each with its split ``SPLITS``) at the budget 0 (off) and
at each candidate of ``LINK_MS``: the bytes the modeled H2D link moves in that many
milliseconds, so that the candidates sit where the loads cost a fraction of a step.

The rule, per workload and capacity: among the budgets whose train-part TTFT p50 and p90 are
within the tier study's tolerance of budget 0's (``ttft_tolerance_s``: one step at the full token
budget), the lowest train TTFT p50 (ties: the smaller budget; 0 is always a candidate). The
chosen budget's test-part TTFT p50, p90 and hit rate are reported beside budget 0's. One budget
for every workload is also chosen, on the train parts alone: among the budgets within the
tolerance on every workload, the lowest mean train TTFT p50 relative to budget 0's.

Run: ``python -m bench.tier_study.sync_loads [--full] [--workloads agent,cc_agentic,glm5]
[--json PATH] [--quiet]`` (``bench/results/sync_loads.json``). Quick (the default): the quick
workloads (the agent generator, the coding-agent cut, the GLM-5 sample) at CPU = GPU, a few
minutes on 2 cores. ``--full``: the tier study's full workloads, Mooncake's whole trace too, at
CPU 1x and 4x the GPU.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.choice import choose_on_train, figures
from bench.common import OneLineParser, write_result
from bench.tier_study.study import (
    SPLITS,
    run_all,
    slim,
    ttft_ok,
    ttft_tolerance_s,
    ttft_within,
    workloads,
)
from kvtriton.setups import DEFAULT_SETUP
from kvtriton.sim.splits import TEST, TRAIN, split_named

#: Candidate budgets as milliseconds of the modeled H2D link (its bytes per second times this).
LINK_MS = (1, 5, 20, 80)
QUICK_WORKLOADS = ("agent", "cc_agentic", "glm5")
FULL_WORKLOADS = ("agent", "cc_agentic", "mooncake", "glm5")
QUICK_RATIOS, FULL_RATIOS = (1,), (1, 4)
MIB = 1 << 20


def budgets(model: str = "llama3-8b", gpu: str = "H100") -> dict[int, float]:
    """Budget bytes -> link milliseconds: 0, and each of ``LINK_MS`` as the bytes the cost
    model's H2D link moves in that time, rounded down to whole MiB."""
    from kvtriton.sim.cost import CostModel

    rate = CostModel.named(model, gpu).conditions()["h2d_bytes_per_s"]
    out = {0: 0.0}
    for ms in LINK_MS:
        nbytes = int(rate * ms / 1e3) // MIB * MIB
        out[nbytes] = 1e3 * nbytes / rate
    return out


def _summary(row: dict, part: str) -> dict:
    p = figures(row, part)
    return {"ttft_p50_s": p["ttft_p50_s"], "ttft_p90_s": p["ttft_p90_s"],
            "token_hit_rate": p["token_hit_rate"]}


def choose(grid: list[dict], base: dict, tolerance: float) -> dict:
    """The entry of ``grid`` (rows by budget, smallest first) with the lowest train TTFT p50
    among those whose train TTFT p50 and p90 are within ``tolerance`` of ``base``'s (budget
    0's row, which always qualifies: it is within any tolerance of itself); ties: the smaller
    budget (the first)."""
    limit = figures(base, TRAIN)
    row = choose_on_train([g["row"] for g in grid], lambda f: -f["ttft_p50_s"],
                          lambda f: ttft_within(f, limit, tolerance))
    return next(g for g in grid if g["row"] is row)


def study_cell(tag: str, ratio: int, results: dict, sizes: dict[int, float]) -> dict:
    """One workload at one capacity: the grid, the budget chosen on train, and the test part's
    figures at budget 0 and at the chosen budget."""
    rows = {b: slim(results[(tag, ratio, b)]["rows"][0]) for b in sizes}
    base = rows[0]
    tolerance = ttft_tolerance_s(results[(tag, ratio, 0)]["conditions"])
    grid = [{"budget_bytes": b, "budget_mib": b / MIB, "link_ms": ms, "row": rows[b],
             "sync_loads": rows[b]["sync_loads"],
             "ttft_ok_train": b == 0 or ttft_ok(rows[b], base, tolerance, TRAIN),
             TRAIN: _summary(rows[b], TRAIN), TEST: _summary(rows[b], TEST)}
            for b, ms in sorted(sizes.items())]
    chosen = choose(grid, base, tolerance)
    off, on = _summary(base, TEST), _summary(chosen["row"], TEST)
    cell = {"workload": tag, "cpu_ratio": ratio, "ttft_tolerance_s": tolerance,
            "grid": [{k: v for k, v in g.items() if k != "row"} for g in grid],
            "chosen_budget_bytes": chosen["budget_bytes"],
            "chosen_budget_mib": chosen["budget_mib"],
            "test_budget_0": off, "test_chosen": on,
            "test_ttft_p50_change_s": on["ttft_p50_s"] - off["ttft_p50_s"],
            "test_ttft_p90_change_s": on["ttft_p90_s"] - off["ttft_p90_s"],
            "test_hit_rate_change_points": 100 * (on["token_hit_rate"] - off["token_hit_rate"]),
            "test_ttft_no_worse": ttft_ok(chosen["row"], base, tolerance, TEST)}
    print(f"{tag} CPU {ratio}x: chosen {chosen['budget_mib']:g} MiB/step on {TRAIN} "
          f"(p50 {chosen[TRAIN]['ttft_p50_s']:.3f} s against "
          f"{figures(base, TRAIN)['ttft_p50_s']:.3f} s off); {TEST}: p50 "
          f"{off['ttft_p50_s']:.3f} -> {on['ttft_p50_s']:.3f} s, p90 "
          f"{off['ttft_p90_s']:.3f} -> {on['ttft_p90_s']:.3f} s, hit rate "
          f"{off['token_hit_rate']:.1%} -> {on['token_hit_rate']:.1%}", flush=True)
    return cell


def choose_overall(cells: list[dict]) -> dict:
    """One budget for every cell, on the train parts: among the budgets within the tolerance on
    every cell, the lowest mean train TTFT p50 relative to budget 0's (ties: the smaller); its
    test figures in every cell beside budget 0's."""
    sizes = [g["budget_bytes"] for g in cells[0]["grid"]]

    def entry(cell: dict, b: int) -> dict:
        return next(g for g in cell["grid"] if g["budget_bytes"] == b)

    def mean(b: int) -> float:
        return sum(entry(c, b)[TRAIN]["ttft_p50_s"] / entry(c, 0)[TRAIN]["ttft_p50_s"]
                   for c in cells) / len(cells)

    fair = [b for b in sizes if all(entry(c, b)["ttft_ok_train"] for c in cells)]
    best = min(fair, key=lambda b: (mean(b), b))
    return {"budget_bytes": best, "budget_mib": best / MIB,
            "mean_train_p50_ratio": mean(best),
            "test": {f"{c['workload']}@{c['cpu_ratio']}x": {
                "budget_0": entry(c, 0)[TEST], "chosen": entry(c, best)[TEST]} for c in cells}}


def findings(name: str, doc: dict) -> dict:
    """The budget chosen per cell and for every workload, and each cell's test-part TTFT p50
    change at its choice."""
    return {"chosen_mib": {f"{c['workload']}@{c['cpu_ratio']}x": c["chosen_budget_mib"]
                           for c in doc["cells"]},
            "overall_mib": doc["overall"]["budget_mib"],
            "test_ttft_p50_change_s": {f"{c['workload']}@{c['cpu_ratio']}x":
                                       c["test_ttft_p50_change_s"] for c in doc["cells"]}}


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.tier_study.sync_loads",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="the full workloads, CPU 1x and 4x")
    ap.add_argument("--workloads", default=None,
                    help=f"comma-separated (default {','.join(QUICK_WORKLOADS)}; with --full "
                         f"{','.join(FULL_WORKLOADS)})")
    ap.add_argument("--json", default=None, help="output path (default bench/results/"
                                                 "sync_loads.json)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    known = FULL_WORKLOADS
    tags = ([t.strip() for t in args.workloads.split(",") if t.strip()] if args.workloads
            else list(FULL_WORKLOADS if args.full else QUICK_WORKLOADS))
    if bad := [t for t in tags if t not in known]:
        ap.error(f"--workloads: unknown {', '.join(map(repr, bad))}; known: {', '.join(known)}")
    ratios = FULL_RATIOS if args.full else QUICK_RATIOS
    t0 = time.perf_counter()
    sizes = budgets()
    wls = workloads(quick=not args.full)
    tasks = []
    for tag in tags:
        wl, gpu, _ = wls[tag]
        parts = split_named(SPLITS[tag], wl)
        for ratio in ratios:
            kw = {"setups": [DEFAULT_SETUP], "gpu_tokens": gpu, "cpu_tokens": ratio * gpu,
                  "parts": parts, "bound": False, "references": ()}
            tasks += [((tag, ratio, b), wl, {**kw, "sync_load_budget_bytes": b}) for b in sizes]
    results = run_all(tasks, not args.quiet, "sync loads")
    cells = [study_cell(tag, ratio, results, sizes) for tag in tags for ratio in ratios]
    overall = choose_overall(cells)
    print(f"every workload: {overall['budget_mib']:g} MiB/step (mean train p50 "
          f"{overall['mean_train_p50_ratio']:.3f}x budget 0's)")
    payload = {
        "setup": DEFAULT_SETUP, "full": args.full, "cpu_ratios": list(ratios),
        "budgets": [{"budget_bytes": b, "budget_mib": b / MIB, "link_ms": ms}
                    for b, ms in sorted(sizes.items())],
        "rule": "per workload and capacity: among the budgets whose train TTFT p50 and p90 are "
                "within the tolerance (one step at the full token budget) of budget 0's, the "
                "lowest train TTFT p50 (ties: the smaller budget); reported on the test part "
                "beside budget 0",
        "splits": {t: SPLITS[t] for t in tags}, "cells": cells, "overall": overall,
        "wall_s": time.perf_counter() - t0}
    path = Path(args.json) if args.json else None
    out = write_result(path.stem if path else "sync_loads", payload,
                       path.parent if path else None, findings)
    print(f"wrote {out}")
    return payload


if __name__ == "__main__":
    main()
