"""Lazy mode: offload the hashed GPU blocks about to be evicted instead of storing eagerly.

Each step walks the GPU free queue (next to be evicted first) from a cursor that persists across
steps, and picks up to ``lazy_target_blocks`` blocks ahead of eviction (by default what two steps
can allocate) whose key the CPU does not hold and that are not being stored already.
"""

from __future__ import annotations

from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.selection import StoreSelector
from kvtriton.planner.stats import PlannerStats
from kvtriton.planner.stores import StoreJob
from kvtriton.pool import BlockPool
from kvtriton.specs import KVLayout

__all__ = ["LazyOffload"]


def _derive_target(layout: KVLayout, max_num_batched_tokens: int) -> int:
    """GPU blocks to keep offloaded ahead of eviction: what two steps can allocate."""
    target = 0
    for g in layout.groups:
        if g.kind == "mamba":
            target += 2
        elif g.kind == "sliding_window":
            target += -(-g.sliding_window // g.block_size) + 1
        else:
            target += -(-max_num_batched_tokens // g.block_size)
    return 2 * target


class LazyOffload:
    """The free-queue walk of lazy mode and its cursor."""

    def __init__(self, layout: KVLayout, config: PlannerConfig, gpu_pool: BlockPool,
                 cpu_pool: BlockPool, selector: StoreSelector, stats: PlannerStats) -> None:
        self._layout = layout
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._selector = selector
        self._stats = stats
        self._cursor: int | None = None
        self._target = config.lazy_target_blocks if config.lazy_target_blocks is not None \
            else _derive_target(layout, config.max_num_batched_tokens)

    def select(self, job: StoreJob) -> None:
        """Add to ``job`` the hashed GPU blocks about to be evicted that the CPU lacks (their CPU
        blocks are not allocated here)."""
        gpu_pool, cpu_pool = self._gpu_pool, self._cpu_pool
        free = cpu_pool.num_free_blocks
        if self._cursor is not None and gpu_pool.ref_cnt[self._cursor] > 0:
            self._cursor = None
        last = self._cursor
        for covered, b in enumerate(gpu_pool.iter_free(self._cursor)):
            if covered >= self._target or len(job.gpu) >= free:
                break
            last = b
            key = gpu_pool.block_hash(b)
            if key is None or key in cpu_pool or self._selector.in_flight(b, key) \
                    or key in job.keys:
                continue
            job.gpu.append(b)
            job.groups.append(self._group_of_key(key))
            job.keys.append(key)
        self._cursor = last
        self._stats.lazy_stored += len(job.gpu)

    def _group_of_key(self, key: int) -> int:
        # Lazy mode sees bare GPU blocks; which group a block belongs to is recorded when the
        # simulator or scheduler tags it (BlockPool.cache_block's group_idx is not kept), so a
        # single-group layout is the supported case.
        if self._layout.num_groups != 1:
            raise ValueError("lazy mode supports single-group layouts only")
        return 0

    def reset(self) -> None:
        self._cursor = None
