"""``VllmGpuPool``: vLLM's GPU ``BlockPool`` seen through the interface the planner expects.

The planner's GPU pool is a ``kvtriton.pool_interface.GpuPool`` (``kvtriton.pool.BlockPool`` in the
simulator); in vLLM the GPU prefix cache is vLLM's own ``vllm.v1.core.block_pool.BlockPool``,
and it stays the truth: this view holds no block state of its own. Reads (a block's keys, the
block cached under a key, ref counts, the free queue in eviction order) go to vLLM's pool as it
is now, with hashes turned into dense ids by ``KeyIds``; ``touch`` and ``free_blocks`` are
vLLM's, on vLLM's block objects, so a block the planner pins for a transfer is pinned in the
scheduler's pool.

vLLM has no listener hook, and the planner keeps per-key presence arrays from insert/evict
events. So at bind time the view wraps, on that one pool instance (not the class), the methods
every hash change goes through: ``_insert_block_hash`` (an insert), ``_remove_cached_block_hashes``
(eviction, promotion, invalid blocks), ``reset_prefix_cache``, and ``cache_full_blocks`` /
``cache_partial_block``, which name the request whose hashes are about to be registered so the
adapter can bind them to that request's reserved ids first (``keys``). These are the same
private entry points vLLM's own SimpleCPUOffloadScheduler calls on its CPU pool; ``bind``
refuses a pool without them, naming the vLLM version.

vLLM hands those changes over one block at a time. Per-key listeners (``add_listener``) hear
each at once. For batch listeners (``add_batch_listener``) the view also wraps vLLM's calls
that change many blocks at a time (``get_new_blocks``, ``evict_blocks``, ``cache_full_blocks``,
``cache_partial_block``, ``move_block_hashes``, ``reset_prefix_cache``): inside one, the
per-block changes are kept in order and handed over at its end, hashes turned into ids in one
pass, as one (keys, block ids) pair of arrays per run of inserts or evictions. A change outside
those calls is handed over at once, as a batch of one.

Pins of blocks a running request holds (``pin_held``: a store batch's sources, thousands of
blocks a step when CPU evictions are re-stored) are kept in an array here instead of vLLM's
counts, which cost a call per block object: while vLLM holds a block, its count is at least 1
and the block cannot be handed out, so the pin changes nothing yet. vLLM drops references only in
``free_blocks`` and ``unpin_blocks`` (vLLM 0.32's ``BlockPool``; its other paths only add
references), and both are wrapped: before vLLM drops one on a block with pins kept here, they
move into the block's count, where a later ``free_blocks`` of the planner releases them. The
planner's view of a block's count (``ref_cnt``) is vLLM's plus the pins kept here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvtriton.pool import all_distinct
from kvtriton.pool_interface import PoolListeners
from kvtriton.vllm.keys import KeyIds

__all__ = ["VllmGpuPool"]

_HOOKED = ("_insert_block_hash", "_remove_cached_block_hashes", "reset_prefix_cache",
           "cache_full_blocks", "cache_partial_block")
# vLLM's calls that change many blocks' hashes at once: batch listeners hear them at their end.
_BATCHED = ("get_new_blocks", "evict_blocks", "cache_full_blocks", "cache_partial_block",
            "move_block_hashes", "reset_prefix_cache")
_INSERT, _EVICT = 0, 1


class _RefCounts:
    """``ref_cnt[b]``: vLLM's count on the block object plus the pins kept apart for it."""

    __slots__ = ("_blocks", "_kept")

    def __init__(self, blocks: list, kept: np.ndarray) -> None:
        self._blocks = blocks
        self._kept = kept

    def __getitem__(self, b: int) -> int:
        return self._blocks[b].ref_cnt + int(self._kept[b])

    def __len__(self) -> int:
        return len(self._blocks)


class VllmGpuPool(PoolListeners):
    """The planner's GPU pool, backed by vLLM's ``BlockPool`` (see the module docstring).

    ``before_cache(request)`` is called with the vLLM ``Request`` whose hashes vLLM is about to
    register, before they are interned.
    """

    def __init__(self, pool: Any, keys: KeyIds,
                 before_cache: Callable[[Any], None] | None = None) -> None:
        missing = [m for m in _HOOKED if not callable(getattr(pool, m, None))]
        if not isinstance(getattr(getattr(pool, "cached_block_hash_to_block", None), "_cache",
                                  None), dict):
            missing.append("cached_block_hash_to_block._cache")
        if missing:
            import vllm

            raise RuntimeError(f"KVTritonConnector: vLLM {vllm.__version__}'s BlockPool has no "
                               f"{', '.join(missing)}; kvtriton.vllm supports vLLM 0.32")
        if not pool.enable_caching:
            raise ValueError("KVTritonConnector needs prefix caching: set "
                             "enable_prefix_caching=True")
        self._pool = pool
        self._blocks = pool.blocks
        self._keys = keys
        self._before_cache = before_cache
        self._init_listeners()
        # Changes of the vLLM call in progress (kind, hash, block id), for the batch listeners;
        # ``_depth``: how many wrapped calls are in progress (they nest: promotion in caching).
        self._pending: list[tuple[int, bytes, int]] = []
        self._depth = 0
        self.num_blocks: int = pool.num_gpu_blocks
        # Pins of ``pin_held`` not yet in vLLM's counts, per block, and their total.
        self._kept = np.zeros(self.num_blocks, dtype=np.int32)
        self._num_kept = 0
        self._scratch = np.zeros(self.num_blocks, dtype=np.int64)  # all_distinct's
        self.ref_cnt = _RefCounts(self._blocks, self._kept)
        self._hook()
        self._hook_batches()

    # ---- the hooks on vLLM's pool instance -----------------------------------------------------

    def _hook(self) -> None:
        pool, keys, blocks = self._pool, self._keys, self._blocks
        insert, remove = pool._insert_block_hash, pool._remove_cached_block_hashes
        reset, cache_full, cache_partial = (pool.reset_prefix_cache, pool.cache_full_blocks,
                                            pool.cache_partial_block)
        on_insert, on_evict = self._on_insert, self._on_evict

        def insert_block_hash(block_hash, block, num_tokens):
            # vLLM's insert is a no-op for a key the block already holds. (The map is looked up
            # each time: reset_prefix_cache replaces it.)
            new = block.block_hash != block_hash and not pool.cached_block_hash_to_block.contain(
                block_hash, block.block_id)
            insert(block_hash, block, num_tokens)
            if new and on_insert:
                kid = keys.id_of(block_hash)
                for cb in on_insert:
                    cb(kid, block.block_id)
            if new and self._on_insert_many:
                self._note(_INSERT, [block_hash], block.block_id)

        def remove_cached_block_hashes(block):
            removed = remove(block)
            if removed and on_evict:
                for h in removed:
                    kid = keys.id_of(h)
                    for cb in on_evict:
                        cb(kid, block.block_id)
            if removed and self._on_evict_many:
                self._note(_EVICT, removed, block.block_id)
            return removed

        def reset_prefix_cache():
            # vLLM swaps its maps wholesale here, without the remove path: report every key.
            held = [(h, b.block_id) for b in blocks for h in self._block_hashes(b)]
            ok = reset()
            if ok and on_evict:
                for h, bid in held:
                    kid = keys.id_of(h)
                    for cb in on_evict:
                        cb(kid, bid)
            if ok and self._on_evict_many:
                self._pending += [(_EVICT, h, bid) for h, bid in held]
                if not self._depth:
                    self._flush()
            return ok

        def cache_full_blocks(request, *args, **kwargs):
            if self._before_cache is not None:
                self._before_cache(request)
            return cache_full(request, *args, **kwargs)

        def cache_partial_block(request, *args, **kwargs):
            if self._before_cache is not None:
                self._before_cache(request)
            return cache_partial(request, *args, **kwargs)

        def dropping(call):
            # vLLM is about to drop references: pins kept apart on those blocks go into their
            # counts first, so that no block a transfer reads can reach the free queue.
            def run(blocks, *args, **kwargs):
                if self._num_kept:
                    blocks = list(blocks)
                    self._take_kept(blocks)
                return call(blocks, *args, **kwargs)
            return run

        pool.free_blocks = dropping(pool.free_blocks)
        if callable(getattr(pool, "unpin_blocks", None)):
            pool.unpin_blocks = dropping(pool.unpin_blocks)
        # Instance attributes shadow the class's methods for this pool only; vLLM's own code
        # calls them through ``self`` (eviction, promotion, moves), so every path sees them.
        pool._insert_block_hash = insert_block_hash
        pool._remove_cached_block_hashes = remove_cached_block_hashes
        pool.reset_prefix_cache = reset_prefix_cache
        pool.cache_full_blocks = cache_full_blocks
        pool.cache_partial_block = cache_partial_block

    def _hook_batches(self) -> None:
        pool = self._pool

        def batched(call):
            def run(*args, **kwargs):
                self._depth += 1
                try:
                    return call(*args, **kwargs)
                finally:
                    self._depth -= 1
                    if not self._depth and self._pending:
                        self._flush()
            return run

        for name in _BATCHED:
            if callable(getattr(pool, name, None)):
                setattr(pool, name, batched(getattr(pool, name)))

    def _note(self, kind: int, hashes: Sequence[bytes], block_id: int) -> None:
        self._pending += [(kind, h, block_id) for h in hashes]
        if not self._depth:
            self._flush()

    def _flush(self) -> None:
        """Hand the pending changes to the batch listeners: one call per run of one kind, in
        the order vLLM made them."""
        pending, self._pending = self._pending, []
        id_of = self._keys.id_of
        start = 0
        for i in range(1, len(pending) + 1):
            if i < len(pending) and pending[i][0] == pending[start][0]:
                continue
            run = pending[start:i]
            kids = np.fromiter((id_of(h) for _, h, _ in run), dtype=np.int64, count=len(run))
            bids = np.fromiter((b for _, _, b in run), dtype=np.int64, count=len(run))
            for cb in (self._on_insert_many if run[0][0] == _INSERT else self._on_evict_many):
                cb(kids, bids)
            start = i

    def _block_hashes(self, block) -> list[bytes]:
        h = block.block_hash
        if h is None:
            return []
        return [h, *self._pool.cached_block_hashes_by_block.get(block.block_id, ())]

    # ---- the kvtriton.pool.BlockPool interface the planner uses --------------------------------

    @property
    def vllm_pool(self) -> Any:
        return self._pool

    def block_hash(self, block_id: int) -> int | None:
        """The primary key id of ``block_id``, or None if vLLM has not hashed it."""
        h = self._blocks[block_id].block_hash
        return None if h is None else self._keys.id_of(h)

    def block_group(self, block_id: int) -> int | None:
        """The KV-cache group ``block_id`` is cached for, or None if vLLM has not hashed it:
        vLLM keys a block by ``BlockHashWithGroupId``, its hash followed by the group id in
        4 big-endian bytes (``get_group_id``; ``keys.group_suffixes``)."""
        h = self._blocks[block_id].block_hash
        return None if h is None else int.from_bytes(h[-4:], "big")

    def block_hash_bytes(self, block_ids: list[int]) -> list[bytes]:
        """vLLM's ``BlockHashWithGroupId`` of each of ``block_ids`` (all hashed)."""
        blocks = self._blocks
        return [blocks[b].block_hash for b in block_ids]

    def block_keys(self, block_id: int) -> tuple[int, ...]:
        """Every key id ``block_id`` is cached under: primary first, then the others vLLM
        registered on it (partial-block entries)."""
        id_of = self._keys.id_of
        return tuple(id_of(h) for h in self._block_hashes(self._blocks[block_id]))

    def get_cached_block(self, key: int) -> int | None:
        """One block vLLM has cached under key id ``key`` (vLLM's first), or None."""
        h = self._keys.hash_of(key) if 0 <= key < self._keys.capacity else None
        if h is None:
            return None
        block = self._pool.cached_block_hash_to_block.get_one_block(h)
        return None if block is None else block.block_id

    def __contains__(self, key: int) -> bool:
        return self.get_cached_block(key) is not None

    def referenced_keys(self) -> list[int]:
        """The ids of every hash vLLM's prefix cache holds now (all were interned when cached)."""
        get = self._keys.get
        ids = [get(h) for h in self._pool.cached_block_hash_to_block._cache]
        return [k for k in ids if k is not None]

    def touch(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """One more reference on each block (vLLM's ``touch``: a free block leaves its queue)."""
        if len(block_ids):
            if type(block_ids) is np.ndarray:
                block_ids = block_ids.tolist()
            self._pool.touch(list(map(self._blocks.__getitem__, block_ids)))

    #: Check at each ``pin_held`` that vLLM holds every block (a read per block object): on
    #: where ``KVTRITON_CHECK_HELD_PINS=1``, as the test suite sets it for every engine it runs.
    check_held = os.environ.get("KVTRITON_CHECK_HELD_PINS") == "1"

    def pin_held(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """One more reference on each block, each one a running request holds now (the caller
        knows it: a running request's full-attention table blocks). The pins are kept here,
        not in vLLM's counts (see the module docstring): a batch is two array operations."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if not len(ids):
            return
        if not (ids.min() >= 1 and ids.max() < self.num_blocks):
            raise ValueError(f"pin_held: a block id outside [1, {self.num_blocks}) in "
                             f"{ids.tolist()[:8]}")
        if self.check_held:
            free = [b for b in ids.tolist() if not self._blocks[b].ref_cnt]
            if free:
                raise AssertionError(f"pin_held: blocks {free[:8]} are not held by vLLM")
        # A fancy-index add counts a repeated id once: np.add.at does not, at 50x the cost.
        if all_distinct(ids, self._scratch):
            self._kept[ids] += 1
        else:
            np.add.at(self._kept, ids, 1)
        self._num_kept += len(ids)

    def _take_kept(self, blocks: list) -> None:
        """Move the pins kept here for any of ``blocks`` into vLLM's counts."""
        pool = self._pool
        # vLLM frees another pool's blocks through this one too (``block.pool``): not ours.
        ids = np.fromiter((b.block_id for b in blocks
                           if getattr(b, "pool", None) in (None, pool)), dtype=np.int64)
        kept = self._kept[ids]
        if not kept.any():
            return
        for b in np.unique(ids[kept > 0]).tolist():
            n = int(self._kept[b])
            self._blocks[b].ref_cnt += n
            self._kept[b] = 0
            self._num_kept -= n

    def free_blocks(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Drop one reference on each, in order (vLLM's ``free_blocks``: first in, first
        evicted among the hashed blocks that reach zero); a pin kept here is dropped here."""
        if not len(block_ids):
            return
        if self._num_kept:
            block_ids = self._drop_kept(block_ids)
        if block_ids:
            blocks = self._blocks
            self._pool.free_blocks([blocks[b] for b in block_ids])

    def _drop_kept(self, block_ids: Sequence[int] | np.ndarray) -> list[int]:
        """Release the pins kept here among ``block_ids`` (one per occurrence, while a block
        has any); returns the rest, in order, for vLLM."""
        ids = np.asarray(block_ids, dtype=np.int64)
        kept = self._kept[ids] > 0
        if not kept.any():
            return ids.tolist()
        if all_distinct(ids, self._scratch):
            self._kept[ids[kept]] -= 1
            self._num_kept -= int(kept.sum())
            return ids[~kept].tolist()
        rest = []
        for b in ids.tolist():
            if self._kept[b]:
                self._kept[b] -= 1
                self._num_kept -= 1
            else:
                rest.append(b)
        return rest

    @property
    def num_kept_pins(self) -> int:
        """Pins of ``pin_held`` kept apart from vLLM's counts now."""
        return self._num_kept

    def iter_free(self, after: int | None = None) -> Iterator[int]:
        """Free blocks in vLLM's eviction order (next victim first), after block ``after``."""
        cursor = None if after is None else self._blocks[after]
        for block in self._pool.free_block_queue.iter_blocks_after(cursor):
            yield block.block_id

    def is_free(self, block_id: int) -> bool:
        b = self._blocks[block_id]
        return b.ref_cnt == 0 and not b.is_null

    @property
    def num_free_blocks(self) -> int:
        return self._pool.get_num_free_blocks()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - 1 - self.num_free_blocks
