"""Planner cost beside vLLM's own, in one process, interleaved step by step.

The setting of ``bench_planner`` (``bench.scenarios``): one
full-attention group of 16-token blocks, R running requests of 2,048 stored blocks each, one new
block per request per step, and 1% of the CPU tier's cached blocks evicted before each step in
LRU order (the tier's next victims, as a real tier's pressure evicts them), CPU blocks freed head
first (vLLM's order) in every variant. Variants, each with its own pools and requests:

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
and to ``vllm_rescan_restore``, and for re-store rows the cost per stored block. The targets at
R = 128 (``targets``) are checked and written with the figures to ``bench/results/vs_vllm.json``.

Run: ``python -m bench.bench_vs_vllm [--quick]`` (needs vLLM).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import write_result
from bench.scenarios import BLOCK, LAYOUT, Scenario, evict_cpu_blocks
from kvtriton.planner import PlannerConfig

VARIANTS = ("vllm_control", "vllm_rescan_restore", "kvt_loop_control", "kvt_fused_control",
            "kvt_fused_restore", "kvt_connector_fused_control", "kvt_connector_fused_restore")
KVT_CONFIGS = {
    "kvt_loop_control": PlannerConfig(scan="loop", restore=False, cpu_free_order="head_first"),
    "kvt_fused_control": PlannerConfig(scan="fused", restore=False, cpu_free_order="head_first"),
    "kvt_fused_restore": PlannerConfig(scan="fused", restore=True, cpu_free_order="head_first"),
}
CONNECTOR_CONFIGS = {
    "kvt_connector_fused_control": {"restore": False, "cpu_free_order": "head_first"},
    "kvt_connector_fused_restore": {"restore": True, "cpu_free_order": "head_first"},
}
# The running requests the targets are judged at.
TARGET_R = 128


def _hash(i: int) -> bytes:
    """A distinct 32-byte block hash (vLLM's sha256 hashes are 32 bytes)."""
    return i.to_bytes(32, "big")


# ---- vLLM's side ---------------------------------------------------------------------------------


@dataclass(eq=False)
class _VllmRequest:
    """What vLLM's manager and the connector read of a ``vllm.v1.request.Request``."""

    request_id: str
    block_hashes: list[bytes]
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    max_tokens: int
    num_output_placeholders: int = 0
    num_preemptions: int = 0
    lora_request: Any = None
    skip_reading_prefix_cache: bool = False
    all_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Blocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@dataclass
class _Cached:
    req_ids: list[str]
    new_block_ids: list[tuple[list[int], ...] | None]
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class _SchedulerOutput:
    """The fields of vLLM's ``SchedulerOutput`` a connector's ``build_connector_meta`` reads."""

    scheduled_cached_reqs: _Cached
    num_scheduled_tokens: dict[str, int]
    scheduled_new_reqs: list = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    kv_connector_block_state: Any = None


def _rescan_manager_class():
    """vLLM's manager with the original re-store design: a re-scan from block 0 after a CPU
    eviction."""
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    class RescanRestoreScheduler(SimpleCPUOffloadScheduler):
        """Phase 1a re-stores every stored block (below the cursor) whose hash the CPU evicted,
        Phase 1b stores the new ones past the cursor, both under the step's CPU budget; the
        cursor then moves to the furthest position decided. Only on steps after an eviction."""

        def bind_evictions(self) -> None:
            pool = self.cpu_block_pool
            evict = pool._maybe_evict_cached_block
            self.evictions = 0

            def counted(block):
                hit = evict(block)
                self.evictions += hit
                return hit

            pool._maybe_evict_cached_block = counted
            self._seen = 0

        def _select_eager_blocks_to_store(self, state, block_ids_by_group):
            if self.evictions == self._seen:
                return super()._select_eager_blocks_to_store(state, block_ids_by_group)
            blocks = self._gpu_block_pool.blocks
            cached = self.cpu_block_pool.cached_block_hash_to_block.get_one_block
            in_flight = self._in_flight_store_gpu_blocks
            free = self.cpu_block_pool.get_num_free_blocks()
            ids = block_ids_by_group[0]
            req = state.request
            ready = min(len(ids), (req.num_computed_tokens - req.num_output_placeholders)
                        // self.group_block_sizes[0])
            start = state.num_stored_blocks[0]
            chosen: list[int] = []
            reached = max(start, ready)
            # Phase 1a (positions below the cursor) then 1b (new ones), the same per-block
            # checks in the order cheapest-to-exit first: most stored blocks are still cached.
            for pos, bid in enumerate(ids[:ready]):
                block = blocks[bid]
                h = block.block_hash
                if (h is not None and cached(h) is None and not block.is_null
                        and bid not in in_flight):
                    if len(chosen) >= free:
                        reached = max(start, pos)  # the cursor stops at the first deferred
                        break
                    chosen.append(bid)
            return chosen, [reached - start], None

        def build_connector_meta(self, scheduler_output):
            meta = super().build_connector_meta(scheduler_output)
            self._seen = self.evictions
            return meta

    return RescanRestoreScheduler


class VllmScenario:
    """R requests on vLLM pools, driven step by step through vLLM's manager or the connector."""

    def __init__(self, variant: str, num_requests: int, blocks: int, steps: int,
                 evict_fraction: float, model_dir: str) -> None:
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

        from kvtriton.sim.vllm_scheduler import make_configs

        self.variant = variant
        self.evict_fraction = evict_fraction
        total = num_requests * (blocks + steps + 1)
        n_cpu = int(total * 1.05)
        vllm_config, kv_cache_config, cpu_bytes = make_configs(
            model_dir, list(LAYOUT.groups), num_gpu_blocks=total + 1, kv_connector=None,
            cpu_blocks=n_cpu, max_num_seqs=max(num_requests, 16),
            max_num_batched_tokens=max(8192, num_requests * BLOCK), max_model_len=65536)
        self.gpu = VllmBlockPool(total + 1, enable_caching=True, hash_block_size=BLOCK)
        if variant in CONNECTOR_CONFIGS:
            from kvtriton.vllm.config import parse_extra_config
            from kvtriton.vllm.scheduler_side import SchedulerSide

            cfg = parse_extra_config({"cpu_bytes_per_rank": cpu_bytes,
                                      **CONNECTOR_CONFIGS[variant]})
            self.side = SchedulerSide(vllm_config, kv_cache_config, cfg)
            self.manager = None
            self.cpu = None
            self.side.bind_gpu_block_pool(self.gpu)
            build = self.side.build_connector_meta
        else:
            from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

            cls = (_rescan_manager_class() if variant == "vllm_rescan_restore"
                   else SimpleCPUOffloadScheduler)
            self.manager = cls(vllm_config, kv_cache_config, cpu_bytes,
                               scheduler_block_size=BLOCK, hash_block_size=BLOCK)
            if variant == "vllm_rescan_restore":
                self.manager.bind_evictions()
            self.manager.bind_gpu_block_pool(self.gpu)
            self.cpu = self.manager.cpu_block_pool
            self.side = None
            build = self.manager.build_connector_meta
        self._build = build
        self._next_hash = 0
        self.reqs: list[_VllmRequest] = []
        self.tables: list[list[int]] = []
        for i in range(num_requests):
            req = _VllmRequest(f"r{i}", [], blocks * BLOCK, blocks * BLOCK + 1, 0,
                               max_tokens=(steps + 2) * BLOCK)
            table = [b.block_id for b in self.gpu.get_new_blocks(blocks)]
            self._cache(req, table, blocks)
            self._alloc(req, table)
            req.num_computed_tokens = blocks * BLOCK
            self.reqs.append(req)
            self.tables.append(table)
        # Store everything once, untimed: the steady state has every block on the CPU.
        self._complete(self._build(self._output({r.request_id: ([*t],) for r, t in
                                                 zip(self.reqs, self.tables, strict=True)})))

    def _cache(self, req: _VllmRequest, table: list[int], n: int) -> None:
        """Hash the last ``n`` blocks of ``table`` as vLLM's allocator does (``cache_full_blocks``,
        which the connector's adapter hooks)."""
        for _ in range(n):
            req.block_hashes.append(_hash(self._next_hash))
            self._next_hash += 1
        blocks = [self.gpu.blocks[b] for b in table]
        self.gpu.cache_full_blocks(req, blocks, len(table) - n, len(table), BLOCK, 0)

    def _alloc(self, req: _VllmRequest, table: list[int]) -> None:
        if self.side is not None:
            self.side.update_state_after_alloc(req, _Blocks(list(table)), 0)
        else:
            self.manager.update_state_after_alloc(req, _Blocks(list(table)), 0)

    def _output(self, new_ids: dict[str, tuple[list[int], ...]]) -> _SchedulerOutput:
        rids = list(new_ids)
        return _SchedulerOutput(_Cached(rids, [new_ids[r] for r in rids]),
                                {r: BLOCK for r in rids})

    def _complete(self, meta: Any) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        if self.side is not None:
            from kvtriton.vllm.metadata import KVTritonWorkerMetadata

            if meta.store.event >= 0:
                self.side.update_connector_output(KVConnectorOutput(
                    kv_connector_worker_meta=KVTritonWorkerMetadata({meta.store.event: 1})))
        elif meta.store_event >= 0:
            from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

            self.manager.update_connector_output(KVConnectorOutput(
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata({meta.store_event: 1})))

    def _evict(self) -> None:
        """``evict_fraction`` of the cached CPU blocks, the next victims first (LRU)."""
        if self.side is not None:
            evict_cpu_blocks(self.side.cpu_pool, self.evict_fraction, "lru")
            return
        pool = self.cpu
        cached = [b for b in pool.free_block_queue.iter_blocks_after(None)
                  if b.block_hash is not None]
        for b in cached[:int(len(cached) * self.evict_fraction)]:
            pool._maybe_evict_cached_block(b)

    def step(self) -> tuple[float, int]:
        """One step; returns (build seconds, blocks stored)."""
        self._evict()
        new_ids = {}
        for req, table in zip(self.reqs, self.tables, strict=True):
            (b,) = self.gpu.get_new_blocks(1)
            table.append(b.block_id)
            self._cache(req, table, 1)
            new_ids[req.request_id] = ([b.block_id],)
        so = self._output(new_ids)
        t0 = time.perf_counter()
        meta = self._build(so)
        dt = time.perf_counter() - t0
        for req in self.reqs:
            req.num_computed_tokens += BLOCK
            req.num_tokens += BLOCK
        stored = len(meta.store) if self.side is not None else len(meta.store_gpu_blocks)
        self._complete(meta)
        return dt, stored


# ---- kvtriton's side -----------------------------------------------------------------------------


class KvtScenario(Scenario):
    """R requests on kvtriton's pools through ``OffloadPlanner.build_meta``: the planner
    benchmark's scenario (``bench.scenarios``) with LRU eviction, reporting what the vLLM
    variants report."""

    def __init__(self, variant: str, num_requests: int, blocks: int, steps: int,
                 evict_fraction: float) -> None:
        # LRU draws nothing from the seed; it is fixed only because Scenario takes one.
        super().__init__(KVT_CONFIGS[variant], num_requests, blocks, steps, evict_fraction,
                         seed=0, eviction="lru")

    def step(self) -> tuple[float, int]:
        """One step; returns (build seconds, blocks stored)."""
        r = self.advance()
        return r.build_s, r.planned


# ---- the run -------------------------------------------------------------------------------------


def _scenario(variant: str, r: int, blocks: int, steps: int, evict: float, model_dir: str):
    if variant in KVT_CONFIGS:
        return KvtScenario(variant, r, blocks, steps, evict)
    return VllmScenario(variant, r, blocks, steps, evict, model_dir)


def run_size(r: int, blocks: int, steps: int, warmup: int, evict: float, variants: list[str],
             model_dir: str) -> list[dict]:
    """Every variant at R = ``r``, stepped interleaved; one row per variant."""
    scen, setup = {}, {}
    for v in variants:
        gc.collect()
        t0 = time.perf_counter()
        scen[v] = _scenario(v, r, blocks, steps + warmup, evict, model_dir)
        setup[v] = time.perf_counter() - t0
    times: dict[str, list[float]] = {v: [] for v in variants}
    stored: dict[str, list[int]] = {v: [] for v in variants}
    gc.disable()  # a collection inside one variant's timed call would charge it alone
    try:
        for i in range(steps + warmup):
            for v in variants:
                dt, n = scen[v].step()
                if i >= warmup:
                    times[v].append(dt * 1e3)
                    stored[v].append(n)
            gc.collect()
    finally:
        gc.enable()
    rows = []
    for v in variants:
        q = statistics.quantiles(times[v], n=4)
        med = statistics.median(times[v])
        per_step = statistics.mean(stored[v])
        rows.append({"variant": v, "requests": r, "blocks_per_request": blocks,
                     "evict_fraction": evict, "median_ms": med, "p25_ms": q[0], "p75_ms": q[2],
                     "stored_per_step": per_step,
                     "us_per_stored_block": 1e3 * med / per_step if per_step else None,
                     "setup_s": setup[v]})
    del scen
    gc.collect()
    base = {row["variant"]: row for row in rows}
    for row in rows:
        for ref in ("vllm_control", "vllm_rescan_restore"):
            if ref in base:
                row[f"x_vs_{ref}"] = base[ref]["median_ms"] / row["median_ms"]
    return rows


def targets(rows: list[dict]) -> dict:
    """The three targets at R = 128, each with its figure and whether it was met."""
    at = {row["variant"]: row for row in rows if row["requests"] == TARGET_R}
    out = {}
    need = ("vllm_control", "vllm_rescan_restore", "kvt_fused_control", "kvt_fused_restore")
    if not all(v in at for v in need):
        return out
    for prefix in ("kvt", "kvt_connector"):
        c, rs = at.get(f"{prefix}_fused_control"), at.get(f"{prefix}_fused_restore")
        if c is None or rs is None:
            continue
        speedup = at["vllm_rescan_restore"]["median_ms"] / rs["median_ms"]
        slowdown = c["median_ms"] / at["vllm_control"]["median_ms"]
        per_block = rs["us_per_stored_block"] / at["vllm_control"]["us_per_stored_block"]
        out[prefix] = {
            "fused_restore_x_cheaper_than_rescan": {"value": speedup, "target": ">= 50",
                                                    "met": speedup >= 50},
            "fused_control_time_over_vllm_control": {"value": slowdown, "target": "<= 1",
                                                     "met": slowdown <= 1},
            "restore_cost_per_block_over_vllm_control": {"value": per_block,
                                                         "target": "<= 0.1",
                                                         "met": per_block <= 0.1},
        }
    return out


def _print(rows: list[dict]) -> None:
    print(f"{'variant':30s} {'R':>4s} {'median ms':>10s} {'p25-p75 ms':>17s} {'stored/step':>11s}"
          f" {'us/block':>9s} {'x vs ctl':>8s} {'x vs rescan':>11s}")
    for row in rows:
        per = row["us_per_stored_block"]
        print(f"{row['variant']:30s} {row['requests']:4d} {row['median_ms']:10.3f} "
              f"{row['p25_ms']:8.3f}-{row['p75_ms']:<8.3f} {row['stored_per_step']:11.1f} "
              f"{per if per is not None else float('nan'):9.3f} "
              f"{row.get('x_vs_vllm_control', float('nan')):8.2f} "
              f"{row.get('x_vs_vllm_rescan_restore', float('nan')):11.1f}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="R = 16, 64, 128; fewer steps")
    ap.add_argument("--sizes", type=int, nargs="+", default=None)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--evict", type=float, default=0.01)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = ap.parse_args(argv)
    sizes = args.sizes or ([16, 64, 128] if args.quick else [16, 64, 128, 256])
    steps = args.steps or (10 if args.quick else 20)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm

    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        model_dir = str(tiny_model_dir(tmp, 65536))
        for r in sizes:
            print(f"\nR = {r}: {args.blocks} blocks per request, {steps} timed steps", flush=True)
            size_rows = run_size(r, args.blocks, steps, args.warmup, args.evict, args.variants,
                                 model_dir)
            _print(size_rows)
            rows += size_rows
    met = targets(rows)
    for prefix, checks in met.items():
        print(f"\ntargets at R = {TARGET_R} ({prefix}):")
        for name, t in checks.items():
            print(f"  {name}: {t['value']:.3f} (target {t['target']}): "
                  f"{'met' if t['met'] else 'MISSED'}")
    payload = {"settings": {"sizes": sizes, "blocks_per_request": args.blocks, "steps": steps,
                            "warmup": args.warmup, "evict_fraction": args.evict,
                            "eviction_order": "lru", "cpu_free_order": "head_first",
                            "block_tokens": BLOCK, "vllm": vllm.__version__},
               "rows": rows, "targets": met}
    path = write_result("vs_vllm", payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
