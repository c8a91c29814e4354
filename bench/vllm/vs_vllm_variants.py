"""The variants ``bench.vllm.vs_vllm`` steps side by side (``VARIANTS``), each a scenario of R
running requests with pools of its own: on vLLM's pools (``VllmScenario``) vLLM's manager, its
re-scan re-store subclass or kvtriton's connector; on kvtriton's pools (``KvtScenario``) the
planner alone. A step returns its build time, the blocks it stored and that time by part
(``PARTS``).

Kept apart from the study's run and verdict so that a scenario can be built and stepped alone:
the tests step the kvtriton side and use the stand-in for vLLM's request (``_VllmRequest``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from bench.planner.scenarios import BLOCK, LAYOUT, Scenario, evict_cpu_blocks
from kvtriton.planner import PlannerConfig

VARIANTS = ("vllm_control", "vllm_rescan_restore", "kvt_loop_control", "kvt_fused_control",
            "kvt_fused_restore", "kvt_connector_fused_control", "kvt_connector_fused_restore")
KVT_CONFIGS = {
    "kvt_loop_control": PlannerConfig(scan="loop", restore=False, cpu_free_order="head_first"),
    "kvt_fused_control": PlannerConfig(scan="fused", restore=False, cpu_free_order="head_first"),
    "kvt_fused_restore": PlannerConfig(scan="fused", restore=True, cpu_free_order="head_first"),
}
CONNECTOR_CONFIGS = {
    "kvt_connector_fused_control": {"setup": "eager"},
    "kvt_connector_fused_restore": {"setup": "eager+restore"},
}
PARTS = ("lookup", "tables", "selection", "cpu_alloc", "listeners", "pin", "adapter", "meta")


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
                 evict_fraction: float, model_dir: str, max_model_len: int = 65536,
                 evict_per_request: int | None = None) -> None:
        from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

        from kvtriton.sim.vllm_scheduler import make_configs

        self.variant = variant
        self.evict_fraction = evict_fraction
        self.evict_count = None if evict_per_request is None \
            else evict_per_request * num_requests
        total = num_requests * (blocks + steps + 1)
        n_cpu = int(total * 1.05)
        vllm_config, kv_cache_config, cpu_bytes = make_configs(
            model_dir, list(LAYOUT.groups), num_gpu_blocks=total + 1, kv_connector=None,
            cpu_blocks=n_cpu, max_num_seqs=max(num_requests, 16),
            max_num_batched_tokens=max(8192, num_requests * BLOCK), max_model_len=max_model_len)
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
        self.planner = self.side.planner if self.side is not None else None
        if self.planner is not None:
            self._planner_s = 0.0
            planner_build = self.planner.build_meta

            def timed_build(step):
                t0 = time.perf_counter()
                try:
                    return planner_build(step)
                finally:
                    self._planner_s += time.perf_counter() - t0

            self.planner.build_meta = timed_build
        self._parts: dict[str, float] | None = None
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
        """``evict_fraction`` of the cached CPU blocks (``evict_count`` when set), the next
        victims first (LRU)."""
        if self.side is not None:
            evict_cpu_blocks(self.side.cpu_pool, self.evict_fraction, "lru",
                             count=self.evict_count)
            return
        pool = self.cpu
        cached = [b for b in pool.free_block_queue.iter_blocks_after(None)
                  if b.block_hash is not None]
        n = int(len(cached) * self.evict_fraction) if self.evict_count is None \
            else self.evict_count
        for b in cached[:n]:
            pool._maybe_evict_cached_block(b)

    def time_parts(self) -> None:
        """Time vLLM's selection, CPU allocation and GPU pin from now on (the extra steps after
        the timed ones: the wrappers cost a little each call)."""
        m = self.manager
        parts = self._parts = dict.fromkeys(PARTS, 0.0)

        def timer(obj, name, part):
            call = getattr(obj, name)

            def run(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return call(*args, **kwargs)
                finally:
                    parts[part] += time.perf_counter() - t0
            setattr(obj, name, run)

        timer(m, "_select_eager_blocks_to_store", "selection")
        timer(m.cpu_block_pool, "get_new_blocks", "cpu_alloc")
        timer(self.gpu, "touch", "pin")

    def step(self) -> tuple[float, int, dict[str, float]]:
        """One step; returns (build seconds, blocks stored, seconds by part)."""
        self._evict()
        new_ids = {}
        for req, table in zip(self.reqs, self.tables, strict=True):
            (b,) = self.gpu.get_new_blocks(1)
            table.append(b.block_id)
            self._cache(req, table, 1)
            new_ids[req.request_id] = ([b.block_id],)
        so = self._output(new_ids)
        if self.planner is not None:
            before = _planner_parts(self.planner)
            self._planner_s = 0.0
        elif self._parts is not None:
            for k in PARTS:
                self._parts[k] = 0.0
        t0 = time.perf_counter()
        meta = self._build(so)
        dt = time.perf_counter() - t0
        if self.planner is not None:
            parts = _parts_since(self.planner, before, self._planner_s)
            parts["adapter"] = dt - self._planner_s
        elif self._parts is not None:
            parts = dict(self._parts)
            parts["meta"] = dt - sum(parts.values())
        else:
            parts = {}
        for req in self.reqs:
            req.num_computed_tokens += BLOCK
            req.num_tokens += BLOCK
        stored = len(meta.store) if self.side is not None else len(meta.store_gpu_blocks)
        self._complete(meta)
        return dt, stored, parts


# ---- kvtriton's side -----------------------------------------------------------------------------


class KvtScenario(Scenario):
    """R requests on kvtriton's pools through ``OffloadPlanner.build_meta``: the planner
    benchmark's scenario (``bench.planner.scenarios``) with LRU eviction, reporting what the vLLM
    variants report."""

    def __init__(self, variant: str, num_requests: int, blocks: int, steps: int,
                 evict_fraction: float, evict_per_request: int | None = None) -> None:
        # LRU draws nothing from the seed; it is fixed only because Scenario takes one.
        super().__init__(KVT_CONFIGS[variant], num_requests, blocks, steps, evict_fraction,
                         seed=0, eviction="lru", evict_per_request=evict_per_request)

    def time_parts(self) -> None:
        """Nothing to set up: the planner counts its parts in every step."""

    def step(self) -> tuple[float, int, dict[str, float]]:
        """One step; returns (build seconds, blocks stored, seconds by part)."""
        before = _planner_parts(self.planner)
        r = self.advance()
        return r.build_s, r.planned, _parts_since(self.planner, before, r.build_s)


def _planner_parts(planner) -> tuple[float, ...]:
    st = planner.stats
    return st.tables_s, st.select_s, st.alloc_s, st.pin_s, st.listen_s


def _parts_since(planner, before: tuple[float, ...], build_s: float) -> dict[str, float]:
    """The planner's parts of one ``build_meta`` of ``build_s`` seconds (``meta``: the rest)."""
    tables, select, alloc, pin, listen = (a - b for a, b in
                                          zip(_planner_parts(planner), before, strict=True))
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(tables=tables, selection=select, cpu_alloc=alloc, listeners=listen, pin=pin)
    parts["meta"] = build_s - tables - select - alloc - listen - pin
    return parts
