"""The per-step planning scenario that ``bench_planner``, ``bench_vs_vllm`` and the
micro-benchmarks drive: R running requests of ``blocks`` stored blocks on kvtriton's pools, one
new block per request per step, ``evict_fraction`` of the CPU's cached blocks evicted before each
step (``lru``: the pool's next victims; ``random``: a uniform draw).

The setting is that in which vLLM's own scheduler was measured: one full-attention group of
16-token blocks (``LAYOUT``, ``BLOCK``); ``VARIANTS`` are the planner configurations compared.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

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
EVICTIONS = ("lru", "random")


def evict_cpu_blocks(cpu: BlockPool, fraction: float, eviction: str = "lru",
                     rng: np.random.Generator | None = None, count: int | None = None
                     ) -> list[int]:
    """Evict ``int(fraction * n)`` of the ``n`` cached free blocks of ``cpu`` (``count`` of
    them when given, at most ``n``); return them.

    ``lru``: the first ones in ``cpu.iter_free()``, the pool's next victims. ``random``: a
    uniform draw from ``rng`` (needed then).
    """
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    # Listed before evicting: evict_cached moves each victim to the head of the free queue,
    # which would reorder an iteration still in progress.
    cached = [b for b in cpu.iter_free() if cpu.block_hash(b) is not None]
    n = int(len(cached) * fraction) if count is None else min(count, len(cached))
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
    CPU's cached blocks evicted (``eviction``: ``lru`` or ``random``) before each step, or
    ``evict_per_request`` blocks per running request when given (the same blocks changed per
    step whatever the blocks held)."""

    def __init__(self, config: PlannerConfig, num_requests: int, blocks: int, steps: int,
                 evict_fraction: float, seed: int, eviction: str = "lru",
                 evict_per_request: int | None = None) -> None:
        if eviction not in EVICTIONS:
            raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
        if evict_per_request is not None and evict_per_request < 0:
            raise ValueError(f"evict_per_request must be >= 0, got {evict_per_request!r}")
        self.rng = np.random.default_rng(seed)
        self.evict_fraction = evict_fraction
        self.evict_count = None if evict_per_request is None \
            else evict_per_request * num_requests
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
            # One call per request: its listeners hear of the whole table at once.
            self.gpu.cache_blocks(table, keys[0, :blocks, None].tolist())
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
        return evict_cpu_blocks(self.cpu, self.evict_fraction, self.eviction, self.rng,
                                self.evict_count)

    def advance(self) -> StepResult:
        """One step: evictions, one new block per request, the timed build_meta, completion."""
        self.evict()
        new_ids = {}
        fresh = self.gpu.get_new_blocks(len(self.reqs))
        keys = []
        for req, table, b in zip(self.reqs, self.tables, fresh, strict=True):
            keys.append([int(req.keys[0, len(table)])])
            table.append(b)
            new_ids[req.request_id] = ([b],)
        self.gpu.cache_blocks(fresh, keys)
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
