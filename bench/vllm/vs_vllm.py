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
"""

from __future__ import annotations

import gc
import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from bench.common import OneLineParser, write_result
from bench.planner.scenarios import BLOCK, LAYOUT, Scenario, evict_cpu_blocks
from bench.vllm.vs_vllm_findings import findings
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
# The running requests the targets are judged at.
TARGET_RS = (128, 256)
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


# ---- the run -------------------------------------------------------------------------------------


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


def _target(name: str, r: int, blocks: int | str, value: float, target: str, ok: bool,
            measure: str, value_min: float | None = None,
            compared: tuple[str, str] | None = None) -> dict:
    """One verdict, judged on the medians; ``value_min`` is the same ratio of the fastest steps,
    beside it: on a loaded machine a long step is more often cut by the OS scheduler, so the
    medians of the longer variants carry more of others' time than the shorter ones'.
    ``compared``: the two variants of the ratio (numerator first), at ``r`` and ``blocks``."""
    return {"name": name, "requests": r, "blocks_per_request": blocks, "value": value,
            "target": target, "met": ok, "measure": measure, "value_min": value_min,
            "compared": None if compared is None else list(compared)}


# The ratio targets at each of ``TARGET_RS``: name, numerator and denominator variants (per-step
# medians), the target as written, and its check on (numerator, denominator).
RATIO_TARGETS = (
    ("fused_restore_over_vllm_control", "kvt_fused_restore", "vllm_control", "<= 1",
     lambda x, y: x <= y),
    ("fused_control_over_vllm_control", "kvt_fused_control", "vllm_control", "<= 0.6",
     lambda x, y: x <= 0.6 * y),
    ("rescan_over_fused_restore", "vllm_rescan_restore", "kvt_fused_restore", ">= 100",
     lambda x, y: x >= 100 * y),
    *((f"connector_over_planner_{mode}", f"kvt_connector_fused_{mode}", f"kvt_fused_{mode}",
       "<= 1.10", lambda x, y: x <= 1.10 * y) for mode in ("control", "restore")),
)


def targets(rows: list[dict]) -> list[dict]:
    """The targets at R = 128 and 256, for every block count run, each with its figure and
    verdict. Ratios are of per-step medians of the same run."""
    at = {(row["variant"], row["requests"], row["blocks_per_request"]): row for row in rows}
    out = []
    counts = sorted({row["blocks_per_request"] for row in rows})

    def ms(v, r, b, key="median_ms"):
        row = at.get((v, r, b))
        return None if row is None else row[key]

    def low(a, b, r, blocks):
        """The ratio a / b of the fastest steps."""
        x, y = ms(a, r, blocks, "min_ms"), ms(b, r, blocks, "min_ms")
        return None if x is None or y is None else x / y

    for b in counts:
        for r in TARGET_RS:
            for name, num, den, target, ok in RATIO_TARGETS:
                x, y = ms(num, r, b), ms(den, r, b)
                if x is not None and y is not None:
                    out.append(_target(name, r, b, x / y, target, ok(x, y),
                                       f"per-step time, {num} / {den}", low(num, den, r, b),
                                       (num, den)))
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        for r in TARGET_RS:
            for v in ("kvt_fused_control", "kvt_connector_fused_control"):
                a, z = ms(v, r, lo), ms(v, r, hi)
                if a is not None and z is not None:
                    out.append(_target(f"blocks_{lo}_to_{hi}_{v}", r, f"{lo}->{hi}", z / a,
                                       "within 0.8-1.2", 0.8 < z / a < 1.2,
                                       "per-step time, same new blocks per step",
                                       ms(v, r, hi, "min_ms") / ms(v, r, lo, "min_ms")))
            for v in ("kvt_fused_restore", "kvt_connector_fused_restore"):
                a, z = at.get((v, r, lo)), at.get((v, r, hi))
                if a is None or z is None or not a["us_per_stored_block"] \
                        or not z["us_per_stored_block"]:
                    continue
                more = z["stored_per_step"] / a["stored_per_step"]
                if abs(more - 1) <= 0.05:
                    # Evictions per request: as many blocks change per step at both counts.
                    ratio = z["median_ms"] / a["median_ms"]
                    measure = (f"per-step time, {z['stored_per_step']:.0f} and "
                               f"{a['stored_per_step']:.0f} blocks stored per step")
                    fastest = z["min_ms"] / a["min_ms"]
                else:
                    # A share of the cached blocks evicted: the changes grow with the blocks
                    # held, so the cost per block changed is what may not grow.
                    ratio = z["us_per_stored_block"] / a["us_per_stored_block"]
                    measure = (f"time per stored block: {more:.1f}x the blocks stored per step "
                               f"at {hi} (per-step time {z['median_ms'] / a['median_ms']:.2f}x)")
                    fastest = None
                out.append(_target(f"blocks_{lo}_to_{hi}_{v}", r, f"{lo}->{hi}", ratio,
                                   "within 0.8-1.2", 0.8 < ratio < 1.2, measure, fastest))
    return out


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
