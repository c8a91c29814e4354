"""Per-step store-planning cost: loop control, loop re-store and the fused scan.

The setting in which vLLM's own scheduler was measured (``VLLM_ANCHOR_MS``): one full-attention
group, 16-token blocks, R running requests of 2,048 stored blocks each, one new block per request
per step, and about 1% of the stored blocks evicted from the CPU before each step (also run with
no eviction, where there is nothing to re-store and only the cost of looking remains).

Which blocks go (``--eviction``): ``lru`` (the default) takes the cached free CPU blocks at the
head of the CPU pool's own eviction order, the victims a real tier under pressure would drop
next; ``random`` draws them uniformly from all cached free CPU blocks, as the benchmark did
before. Both evict as many blocks, so the re-stores per step are the same; but a uniform draw
scatters the holes over every request and keeps hitting blocks it has just had re-stored
(``restore_thrash``), which a real tier does not: a re-stored block rejoins its pool's free
queue at the far end. ``bench_vs_vllm`` drives kvtriton's side through the same ``Scenario``.

Two times per step: *selection*, the selector's scan that decides what to store (the planning
itself, as ``PlannerStats.select_s`` measures it inside ``build_meta``), and the whole
``OffloadPlanner.build_meta`` call, which adds the bookkeeping of every selected block (a CPU
block allocated, its GPU source pinned, in-flight marks); that part grows with the number of
blocks stored, for any selector. The CPU evictions and store completions between steps are not
timed. Median and quartiles over the timed steps.

Run: ``python -m bench.bench_planner [--quick] [--eviction {lru,random}]``.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import NamedTuple

import numpy as np

from bench.common import OneLineParser, write_result
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request, StepOutput
from kvtriton.pool import BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout

LAYOUT = KVLayout([FullAttentionSpec(16, 8, 128, 32)], name="llama3-8b-like")
BLOCK = 16
VARIANTS = {
    "loop_control": PlannerConfig(scan="loop", restore=False),
    "loop_restore": PlannerConfig(scan="loop", restore=True),
    "fused_restore": PlannerConfig(scan="fused", restore=True),
    "fused_control": PlannerConfig(scan="fused", restore=False),
}
# vLLM 0.33.0's SimpleCPUOffloadScheduler on this machine class, from ../shared/docs/anchors.md.
VLLM_ANCHOR_MS = {
    16: {"control": 0.079, "restore_loop": 5.9},
    64: {"control": 0.29, "restore_loop": 43},
    128: {"control": 0.64, "restore_loop": 82},
    256: {"control": 1.41, "restore_loop": 191},
}


EVICTIONS = ("lru", "random")


def evict_cpu_blocks(cpu: BlockPool, fraction: float, eviction: str = "lru",
                     rng: np.random.Generator | None = None) -> list[int]:
    """Evict ``int(fraction * n)`` of the ``n`` cached free blocks of ``cpu``; return them.

    ``lru``: the first ones in ``cpu.iter_free()``, the pool's next victims. ``random``: a
    uniform draw from ``rng`` (needed then).
    """
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    # Listed before evicting: evict_cached moves each victim to the head of the free queue,
    # which would reorder an iteration still in progress.
    cached = [b for b in cpu.iter_free() if cpu.block_hash(b) is not None]
    n = int(len(cached) * fraction)
    if eviction == "lru":
        victims = cached[:n]
    else:
        if rng is None:
            raise ValueError("random eviction needs an rng")
        victims = rng.choice(cached, size=n, replace=False).tolist()
    for b in victims:
        cpu.evict_cached(b)
    return victims


class StepResult(NamedTuple):
    select_s: float  # the selector's scan inside build_meta
    build_s: float  # the whole build_meta call
    stored: int  # new blocks stored
    restored: int  # re-stores of blocks the CPU had lost
    planned: int  # blocks in the step's store batch (len(meta.store))


class Scenario:
    """R requests of ``blocks`` stored blocks, driven step by step, ``evict_fraction`` of the
    CPU's cached blocks evicted (``eviction``: ``lru`` or ``random``) before each step."""

    def __init__(self, config: PlannerConfig, num_requests: int, blocks: int, steps: int,
                 evict_fraction: float, seed: int, eviction: str = "lru") -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        self.rng = np.random.default_rng(seed)
        self.evict_fraction = evict_fraction
        self.eviction = eviction
        total = num_requests * (blocks + steps + 1)
        self.gpu = BlockPool(total + 1)
        self.cpu = BlockPool(int(total * 1.05) + 1, medium="CPU")
        self.planner = OffloadPlanner(LAYOUT, self.gpu, self.cpu, config)
        self.reqs: list[Request] = []
        self.tables: list[list[int]] = []
        n_keys = blocks + steps + 1
        new_ids = {}
        for i in range(num_requests):
            keys = np.arange(i * n_keys, (i + 1) * n_keys, dtype=np.int64)[None, :]
            req = Request(f"r{i}", keys, num_prompt_tokens=blocks * BLOCK,
                          num_tokens=blocks * BLOCK + 1)
            table = self.gpu.get_new_blocks(blocks)
            for pos, b in enumerate(table):
                self.gpu.cache_block(b, int(keys[0, pos]))
            self.planner.update_state_after_alloc(req, (table,), 0)
            req.num_computed_tokens = blocks * BLOCK
            self.reqs.append(req)
            self.tables.append(table)
            new_ids[req.request_id] = (list(table),)
        # Store everything once, untimed: the steady state has every block on the CPU.
        meta = self.planner.build_meta(StepOutput(
            num_scheduled_tokens={r.request_id: 1 for r in self.reqs}, new_block_ids=new_ids))
        self._complete(meta)

    def _complete(self, meta) -> None:
        if meta.store.event >= 0:
            self.planner.update_connector_output(completed_stores={meta.store.event: 1})

    def evict(self) -> list[int]:
        """The step's CPU evictions (untimed); returns the evicted blocks."""
        return evict_cpu_blocks(self.cpu, self.evict_fraction, self.eviction, self.rng)

    def advance(self) -> StepResult:
        """One step: evictions, one new block per request, the timed build_meta, completion."""
        self.evict()
        new_ids = {}
        for req, table in zip(self.reqs, self.tables, strict=True):
            pos = len(table)
            (b,) = self.gpu.get_new_blocks(1)
            self.gpu.cache_block(b, int(req.keys[0, pos]))
            table.append(b)
            new_ids[req.request_id] = ([b],)
        step = StepOutput(num_scheduled_tokens={r.request_id: BLOCK for r in self.reqs},
                          new_block_ids=new_ids)
        stats = self.planner.stats
        before = stats.scan.stored, stats.scan.restored, stats.select_s
        t0 = time.perf_counter()
        meta = self.planner.build_meta(step)
        dt = time.perf_counter() - t0
        for req in self.reqs:
            req.num_computed_tokens += BLOCK
            req.num_tokens += BLOCK
        self._complete(meta)
        s = stats.scan
        return StepResult(stats.select_s - before[2], dt, s.stored - before[0],
                          s.restored - before[1], len(meta.store))

    def step(self) -> tuple[float, float, int, int]:
        """One step; returns (selection seconds, build_meta seconds, new stores, re-stores)."""
        return self.advance()[:4]


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


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.bench_planner",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16, 64 and 128 requests, 10 steps")
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
    sizes = args.sizes or ([16, 64, 128] if args.quick else [16, 64, 128, 256])
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
        "vllm_anchor_ms": {"source": "shared/docs/anchors.md (vLLM 0.33.0, 2 vCPU)",
                           "by_requests": VLLM_ANCHOR_MS},
    }
    path = write_result(args.out, payload)
    for k, v in payload["targets"].items():
        print(f"  target {k}: {v['value']:.3g} ({v['target']}, {v['measure']}) "
              f"{'met' if v['met'] else 'MISSED'}; whole build_meta: {v['whole_build_meta']:.3g}")
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
