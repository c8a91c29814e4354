"""Per-step store-planning cost: loop control, loop re-store and the fused scan.

The setting in which ``bench_vs_vllm`` measures vLLM's own scheduler beside kvtriton's planner,
in one process (its results are the comparison with vLLM; none is kept here): one full-attention
group, 16-token blocks, R running requests of 2,048 stored blocks each, one new block per request
per step, and about 1% of the stored blocks evicted from the CPU before each step (also run with
no eviction, where there is nothing to re-store and only the cost of looking remains).

Which blocks go (``--eviction``): ``lru`` (the default) takes the cached free CPU blocks at the
head of the CPU pool's own eviction order, the victims a real tier under pressure would drop
next; ``random`` draws them uniformly from all cached free CPU blocks, as the benchmark did
before. Both evict as many blocks, so the re-stores per step are the same; but a uniform draw
scatters the holes over every request and keeps hitting blocks it has just had re-stored
(``restore_thrash``), which a real tier does not: a re-stored block rejoins its pool's free
queue at the far end. The scenario (``bench.planner.scenarios.Scenario``) is shared with
``bench_vs_vllm``, which drives kvtriton's side through it, and the micro-benchmarks.

Two times per step: *selection*, the selector's scan that decides what to store (the planning
itself, as ``PlannerStats.select_s`` measures it inside ``build_meta``), and the whole
``OffloadPlanner.build_meta`` call, which adds the bookkeeping of every selected block (a CPU
block allocated, its GPU source pinned, in-flight marks); that part grows with the number of
blocks stored, for any selector. The CPU evictions and store completions between steps are not
timed. Median and quartiles over the timed steps.

Run: ``python -m bench.planner.scaling [--quick] [--eviction {lru,random}]``.
"""

from __future__ import annotations

import gc
import statistics
import time

from bench.common import OneLineParser, write_result
from bench.planner.scenarios import BLOCK, EVICTIONS, VARIANTS, Scenario


def run(sizes: list[int], blocks: int, steps: int, warmup: int, evict_fractions: list[float],
        variants: list[str], eviction: str = "lru") -> list[dict]:
    rows = []
    for evict in evict_fractions:
        for n in sizes:
            for name in variants:
                gc.collect()
                t0 = time.perf_counter()
                sc = Scenario(VARIANTS[name], n, blocks, steps + warmup, evict, seed=n,
                              eviction=eviction)
                setup_s = time.perf_counter() - t0
                sel_ms, times, stores, restores = [], [], [], []
                for i in range(steps + warmup):
                    sel, dt, st, rs = sc.step()
                    if i >= warmup:
                        sel_ms.append(sel * 1e3)
                        times.append(dt * 1e3)
                        stores.append(st)
                        restores.append(rs)
                q = statistics.quantiles(times, n=4)
                qs = statistics.quantiles(sel_ms, n=4)
                row = {
                    "variant": name, "requests": n, "blocks_per_request": blocks,
                    "evict_fraction": evict, "eviction": eviction,
                    "select_median_ms": statistics.median(sel_ms), "select_p25_ms": qs[0],
                    "select_p75_ms": qs[2],
                    "median_ms": statistics.median(times), "p25_ms": q[0], "p75_ms": q[2],
                    "stores_per_step": statistics.mean(stores),
                    "restores_per_step": statistics.mean(restores),
                    "restore_thrash": sc.planner.stats.restore_thrash,
                    "setup_s": setup_s,
                }
                rows.append(row)
                print(f"  evict {evict:4.0%} {name:14s} R={n:4d}  select "
                      f"{row['select_median_ms']:8.3f} ms  build_meta {row['median_ms']:8.3f} ms"
                      f"  stores {row['stores_per_step']:7.1f}  "
                      f"re-stores {row['restores_per_step']:7.1f}", flush=True)
    return rows


def targets(rows: list[dict], evict: float) -> dict:
    """The targets at 128 x 2,048, judged on the selection time at ``evict``; the whole
    build_meta figures are reported beside them."""
    sel = {(r["variant"], r["requests"]): r["select_median_ms"] for r in rows
           if r["evict_fraction"] == evict}
    whole = {(r["variant"], r["requests"]): r["median_ms"] for r in rows
             if r["evict_fraction"] == evict}
    out = {}
    measure = f"selection time, {evict:.0%} evicted per step"
    if ("fused_restore", 128) in sel and ("loop_restore", 128) in sel:
        v = sel["loop_restore", 128] / sel["fused_restore", 128]
        out["fused_vs_loop_restore_speedup_at_128"] = {
            "value": v, "target": ">= 50", "met": v >= 50, "measure": measure,
            "whole_build_meta": whole["loop_restore", 128] / whole["fused_restore", 128]}
    if ("fused_restore", 128) in sel and ("loop_control", 128) in sel:
        v = sel["fused_restore", 128] / sel["loop_control", 128]
        out["fused_restore_over_loop_control_at_128"] = {
            "value": v, "target": "<= 1", "met": v <= 1, "measure": measure,
            "whole_build_meta": whole["fused_restore", 128] / whole["loop_control", 128]}
    if ("fused_restore", 128) in sel:
        v = sel["fused_restore", 128]
        out["fused_restore_ms_at_128"] = {"value": v, "target": "< 1 ms", "met": v < 1,
                                          "measure": measure,
                                          "whole_build_meta": whole["fused_restore", 128]}
    return out


def findings(name: str, doc: dict) -> dict:
    """The fused re-store run with the most re-stores per step (ties: the most requests): its
    bookkeeping (the whole ``build_meta`` less the selection) beside its selection, both
    measured, in ms; ``None`` where no fused run re-stored anything."""
    runs = [r for r in doc["rows"] if r["restores_per_step"] > 0 and "fused" in r["variant"]]
    if not runs:
        return {"bookkeeping": None}
    r = max(runs, key=lambda r: (r["restores_per_step"], r["requests"]))
    return {"bookkeeping": {"requests": r["requests"], "restores_per_step": r["restores_per_step"],
                            "bookkeeping_ms": r["median_ms"] - r["select_median_ms"],
                            "select_ms": r["select_median_ms"]}}


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.planner.scaling",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 and 128 requests, 10 steps")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--evict", type=float, default=0.01, help="fraction evicted per step")
    ap.add_argument("--eviction", choices=EVICTIONS, default="lru",
                    help="which cached CPU blocks go: the pool's next victims (lru) or a uniform "
                         "draw (random, the harsher pre-LRU default)")
    ap.add_argument("--out", default="planner", help="result name under bench/results/")
    args = ap.parse_args(argv)
    # A fraction outside [0, 1] would fail deep in the eviction (or evict nothing) mid-run.
    if not 0.0 <= args.evict <= 1.0:
        ap.error(f"--evict must be a fraction in [0, 1], got {args.evict}")
    sizes = args.sizes or ([16, 128] if args.quick else [16, 64, 128, 256])
    steps = args.steps or (10 if args.quick else 20)
    print(f"planner scaling: {args.blocks} blocks/request, {steps} timed steps, "
          f"{args.evict:.0%} of CPU-cached blocks evicted per step, eviction {args.eviction}")
    evicts = sorted({0.0, args.evict})
    rows = run(sizes, args.blocks, steps, warmup=3, evict_fractions=evicts,
               variants=list(VARIANTS), eviction=args.eviction)
    payload = {
        "conditions": {"blocks_per_request": args.blocks, "block_tokens": BLOCK,
                       "timed_steps": steps, "warmup_steps": 3, "evict_fraction": args.evict,
                       "evict_fractions": evicts, "eviction": args.eviction,
                       "timed": "selector.select (selection) and OffloadPlanner.build_meta"},
        "rows": rows,
        "targets": {**targets(rows, args.evict),
                    **{f"{k}_no_eviction": v for k, v in targets(rows, 0.0).items()
                       if k == "fused_restore_over_loop_control_at_128"}},
    }
    path = write_result(args.out, payload, findings=findings)
    for k, v in payload["targets"].items():
        print(f"  target {k}: {v['value']:.3g} ({v['target']}, {v['measure']}) "
              f"{'met' if v['met'] else 'MISSED'}; whole build_meta: {v['whole_build_meta']:.3g}")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
