"""Lazy mode: offload the hashed GPU blocks about to be evicted instead of storing eagerly.

Each step walks the GPU free queue (next to be evicted first) from a cursor that persists across
steps, and picks up to ``lazy_target_blocks`` blocks ahead of eviction (by default what two steps
can allocate) whose key the CPU does not hold and that are not being stored already. The cursor is
the last block walked; the walk starts again from the head when that block left the free queue,
or when it was picked for a store: its store pins it, and once the store completes it rejoins the
free queue at the tail, where a walk resuming after it would skip every block in between.

Groups. The free queue holds bare GPU blocks of every KV-cache group (one pool serves them all,
as in vLLM), so each block's group comes from the GPU pool: ``block_group(b)``, the group the
block was cached for (``kvtriton.pool.BlockPool`` keeps ``cache_block``'s ``group_idx`` until the
block's hashes are evicted; vLLM's pool view reads it off the group id in the block's hash). It
is the group the worker copies the block from and the group the CPU block is registered for,
exactly as an eager store of that block would name it. A hashed block whose group the pool does
not know is skipped on a layout of several groups (never guessed: a wrong group copies another
group's bytes) and is group 0 on a single-group layout.

What is stored, per group kind: every hashed block that is about to be evicted, whatever its
kind, as the eager path stores every block of every group (full-attention and sliding-window
positions by its scan, Mamba states by their boundary hand-offs). A CPU hit at n tokens (n a
scheduler-block multiple) on a hybrid layout needs all of its groups at once
(``kvtriton.lookup.find_longest_hit``), so no group's blocks can be left out:

- full attention: every block of [0, n); any stored block is part of the hits that reach it.
- sliding window: the pages covering the last ``sliding_window - 1`` tokens before n. Every page
  lies in the window of some n, the hit at a request's end included (its window can start
  before the pages the request still held at the end), so every page is stored. Pages that left
  a running request's window were freed then, and are stored when they near eviction.
- Mamba: the state saved exactly at boundary n, one block per boundary. The states a request
  dropped while it ran (all but the last) serve hits at their own boundaries (a shared prefix),
  its last one, freed when it finishes, the hit of its next turn.

Lazy stores reach the CPU in the GPU's eviction order, so a window's early pages and a request's
earlier states reach it (and leave an LRU tier) before the full-attention blocks of the same
span; a hit that needs them ends where they are missing, as a GPU prefix hit would. A block
still referenced (a running request's) is never on the free queue: lazy mode stores nothing of
running requests and needs no re-store; only prefixes the GPU lets go are served from the CPU.

With hinted admission (``PlannerConfig.admission == "hinted"``,
``kvtriton.planner.admission.HintedAdmission``) the walk skips keys whose last holder finished
with the hint ``close``.
"""

from __future__ import annotations

import numpy as np

from kvtriton.planner.admission import HintedAdmission
from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.selection import StoreSelector
from kvtriton.planner.stats import PlannerStats
from kvtriton.planner.store_batches import StoreJob
from kvtriton.pool import BlockPool
from kvtriton.pool_interface import GpuPool
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
    """The free-queue walk of lazy mode and its cursor.

    ``ValueError`` (lazy mode on, a layout of several groups) for a GPU pool that cannot say
    which group a block belongs to (no ``block_group``)."""

    def __init__(self, layout: KVLayout, config: PlannerConfig, gpu_pool: GpuPool,
                 cpu_pool: BlockPool, selector: StoreSelector, stats: PlannerStats) -> None:
        self._layout = layout
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._selector = selector
        self._stats = stats
        self._cursor: int | None = None
        self._cursor_stored = False  # the cursor block was picked for a store
        self._target = config.lazy_target_blocks if config.lazy_target_blocks is not None \
            else _derive_target(layout, config.max_num_batched_tokens)
        self._num_groups = layout.num_groups
        block_group = getattr(gpu_pool, "block_group", None)
        self._block_group = block_group if callable(block_group) else None
        self._admission = HintedAdmission(gpu_pool, stats) if config.admission == "hinted" \
            else None
        # A CPU eviction that learns from demand hears of every admitted request's keys.
        eviction = cpu_pool.eviction
        self._demand = eviction.on_request if eviction.observes_requests else None
        if config.lazy and self._num_groups > 1 and self._block_group is None:
            raise ValueError(f"lazy mode on a layout of {self._num_groups} groups needs a GPU "
                             f"pool that knows each block's group (block_group); "
                             f"{type(gpu_pool).__name__} has none")

    def select(self, job: StoreJob) -> None:
        """Add to ``job`` the hashed GPU blocks about to be evicted that the CPU lacks, each
        with its group (their CPU blocks are not allocated here)."""
        gpu_pool, cpu_pool, selector = self._gpu_pool, self._cpu_pool, self._selector
        free = cpu_pool.num_free_blocks
        if self._cursor is not None and (self._cursor_stored
                                         or gpu_pool.ref_cnt[self._cursor] > 0):
            self._cursor = None
        last, last_stored = self._cursor, False
        group_of, G = self._group_of, self._num_groups
        queued = set(job.keys)
        refuses = self._admission.refuses if self._admission is not None else None
        # The walk covers up to ``_target`` free blocks a step, most of them already in the CPU:
        # the per-block lookups are bound once.
        target, stored, block_hash = self._target, job.gpu, gpu_pool.block_hash
        in_cpu, in_flight = cpu_pool.__contains__, selector.in_flight
        for covered, b in enumerate(gpu_pool.iter_free(self._cursor)):
            if covered >= target or len(stored) >= free:
                break
            last, last_stored = b, False
            key = block_hash(b)
            if key is None or in_cpu(key) or key in queued or in_flight(b, key):
                continue
            if refuses is not None and refuses(key):
                continue
            g = group_of(b)
            if g is None or not 0 <= g < G:
                continue  # a group the layout lacks, or unknown: never copy it as another's
            job.gpu.append(b)
            job.groups.append(g)
            job.keys.append(key)
            queued.add(key)
            last_stored = True
        self._cursor, self._cursor_stored = last, last_stored
        self._stats.lazy_stored += len(job.gpu)

    def _group_of(self, block: int) -> int | None:
        """The group ``block`` was cached for; a single-group layout's blocks are group 0
        whether or not their pool named it."""
        g = self._block_group(block) if self._block_group is not None else None
        if g is None and self._num_groups == 1:
            return 0
        return g

    # ---- hinted admission ---------------------------------------------------------------------

    def note_admitted(self, keys: np.ndarray) -> None:
        """A request holding ``keys`` was admitted (hinted admission lets them in again; a
        demand-learning CPU eviction counts them)."""
        if self._admission is not None:
            self._admission.note_admitted(keys)
        if self._demand is not None:
            self._demand(np.unique(keys))

    def note_finished(self, keys: np.ndarray, hint: str | None) -> None:
        """A request that held ``keys`` (its computed blocks) finished with ``hint``."""
        if self._admission is not None:
            self._admission.note_finished(keys, hint)

    @property
    def num_closed(self) -> int:
        """Keys held back by hinted admission (at most the keys the GPU caches)."""
        return self._admission.num_closed if self._admission is not None else 0

    def reset(self) -> None:
        self._cursor, self._cursor_stored = None, False
