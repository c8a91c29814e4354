"""A block pool with ref counts, a pluggable free queue and a prefix-cache hash map.

The same class serves as the GPU pool (the prefix cache a scheduler allocates from) and as the
CPU tier (where completed stores are registered). Block 0 is the null block: never allocated,
never freed, never cached; tables use it for pages a group does not need.

A block with ref count 0 sits in the free queue and keeps its hashes until it is handed out
again, so it can still be hit ("evictable cached"). Which free block is handed out next is the
eviction queue's choice (``kvtriton.eviction``; LRU by default). Every operation costs O(1) per
block named; bad input raises ``ValueError`` before anything is changed.

Per-block state the batch calls read and write (ref counts, whether a block is hashed) lives in
``array.array``/``bytearray`` buffers with NumPy views over the same memory: a call naming a few
blocks indexes the buffers at list speed, a call naming many (a step's store batch: thousands of
CPU blocks allocated, thousands of GPU sources pinned) is a few array operations, with the
queue's batch calls (``pop_many``, ``push_many``, ``remove_many``) beside them.

Listeners come in two kinds. Per-key listeners (``add_listener``) are called once per key, right
after that one block's map entry changed: the loop reference reads the pool in that state.
Batch listeners (``add_batch_listener``) are called once per pool call that changed hashes (an
allocation that evicted, ``cache_blocks``, a reset) with two int64 arrays, every (key, block)
pair the call changed, once the whole call is applied: a step's allocation of n blocks is one
call to them, not n.

The key map's operations (registering and dropping keys, with their listener calls and events)
are ``BlockPool``'s base ``kvtriton.pool_keys.PoolKeyMap``; the listener signatures, the events
and ``GpuPool``, the interface the planner needs of a GPU pool, are in ``kvtriton.pool_interface``.
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter

import numpy as np

from kvtriton.eviction import EvictionQueue, make_eviction_queue
from kvtriton.pool_interface import (
    AllBlocksCleared,
    BatchCallback,
    BlockRemoved,
    BlockStored,
    PoolListeners,
)
from kvtriton.pool_keys import PoolKeyMap
from kvtriton.validation import is_int

__all__ = ["NULL_BLOCK", "BlockPool"]

NULL_BLOCK = 0


def all_distinct(ids: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether no id repeats in ``ids`` (int64, each < ``len(scratch)``): O(n), no sort. Each
    id's slot of ``scratch`` (any content, overwritten) keeps one of its positions, which differs
    from another occurrence's."""
    at = np.arange(len(ids))
    scratch[ids] = at
    return bool((scratch[ids] == at).all())


class BlockPool(PoolKeyMap, PoolListeners):
    """``num_blocks`` blocks (block 0 is the null block) with ref counts and a hash map.

    ``on_insert(key, block_id)`` and ``on_evict(key, block_id)`` listeners see every key that
    becomes hittable or stops being hittable; the planner keeps its presence tensors with them.
    """

    #: Up to this many blocks a call loops in Python: below it, array calls cost more than they
    #: save (tests set 0 on an instance to run every batch through the arrays).
    batch_min = 16

    def __init__(
        self,
        num_blocks: int,
        *,
        eviction: str | EvictionQueue = "lru",
        medium: str = "GPU",
        enable_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is null), got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.medium = medium
        self.enable_events = enable_events
        #: References per block id (0: free); ``_ref`` is a NumPy view of the same memory.
        self.ref_cnt = array("i", [0]) * num_blocks
        self._ref = np.frombuffer(self.ref_cnt, dtype=np.intc)
        # 1 where a block is hashed (its primary key is not None); ``_hashed_np`` views it.
        self._hashed = bytearray(num_blocks)
        self._hashed_np = np.frombuffer(self._hashed, dtype=bool)
        # Scratch of the distinct-ids check (``_distinct``): any content, one slot per block.
        self._scratch = np.zeros(num_blocks, dtype=np.int64)
        # Primary key per block (None: unhashed) and its aliases (hash boundaries inside it).
        self._primary: list[int | None] = [None] * num_blocks
        self._aliases: list[tuple[int, ...]] = [()] * num_blocks
        # Per hashed block: the KV-cache group it was cached for (``cache_block``'s
        # ``group_idx``; None when not named), so a pool of several groups' blocks can tell them
        # apart (lazy offload walks bare free blocks).
        self._group: list[int | None] = [None] * num_blocks
        # Per block: who last took it back from the free queue (``touch``'s ``user``), so that a
        # request pinning the same block again is not mistaken for reuse by a frequency policy.
        self._last_user: list[object] = [None] * num_blocks
        # key -> block id, or key -> {block id: None} when several blocks share the key.
        self._map: dict[int, int | dict[int, None]] = {}
        self._eviction = make_eviction_queue(eviction) if isinstance(eviction, str) else eviction
        # A queue that keeps nothing of evicted keys needs no call per victim.
        self._tracks_evictions = type(self._eviction).on_evicted is not EvictionQueue.on_evicted
        self._fill_free_queue()
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._init_listeners()

    def _fill_free_queue(self) -> None:
        # Unhashed blocks enter at the head, so pushing in descending order hands out 1, 2, ...
        self._eviction.reset(self.num_blocks)
        blocks = np.arange(self.num_blocks - 1, 0, -1, dtype=np.int64)
        self._eviction.push_many(blocks, np.zeros(len(blocks), dtype=bool), self._primary)

    # ---- listeners and introspection -------------------------------------------------------

    def _notify_many(self, listeners: list[BatchCallback], keys: list[int],
                     blocks: list[int]) -> None:
        if listeners and keys:
            k = np.array(keys, dtype=np.int64)
            b = np.array(blocks, dtype=np.int64)
            for cb in listeners:
                cb(k, b)

    @property
    def eviction(self) -> EvictionQueue:
        """The free queue: which free block is handed out (and so evicted) next."""
        return self._eviction

    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``get_new_blocks`` can hand out now (free, cached or not)."""
        return len(self._eviction)

    @property
    def num_used_blocks(self) -> int:
        """Non-null blocks with a reference."""
        return self.num_blocks - 1 - len(self._eviction)

    @property
    def num_cached_keys(self) -> int:
        return len(self._map)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding cached data (hashed), referenced or free: the pool's fill, which
        ``num_used_blocks`` is not (a cached block nothing references is free)."""
        return int(np.count_nonzero(self._hashed_np))

    def is_free(self, block_id: int) -> bool:
        # Ref count 0 is free-queue membership (check_invariants holds them equal) and cheaper
        # than asking the queue; the null block has ref count 0 and is never free.
        return self.ref_cnt[block_id] == 0 and block_id != NULL_BLOCK

    def count_free(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` (a list) are free: ref count 0, the null block excepted."""
        if len(block_ids) < 2:
            return sum(1 for b in block_ids if not self.ref_cnt[b] and b != NULL_BLOCK)
        # One C-level read of every count (an itemgetter over the buffer): a scheduler's
        # admission asks it of every GPU block a prefix hit touches.
        return itemgetter(*block_ids)(self.ref_cnt).count(0) - block_ids.count(NULL_BLOCK)

    def count_present(self, keys) -> int:
        """How many of ``keys`` are registered (one C-level pass; lookups' hole counts)."""
        return sum(map(self._map.__contains__, keys))

    def block_hash(self, block_id: int) -> int | None:
        """The primary key of ``block_id`` or ``None``."""
        return self._primary[block_id]

    def block_group(self, block_id: int) -> int | None:
        """The group ``block_id`` was cached for (``cache_block``'s ``group_idx``), or ``None``
        (unhashed, or cached without one)."""
        return self._group[block_id]

    def block_keys(self, block_id: int) -> tuple[int, ...]:
        """Every key ``block_id`` is registered under: primary first, then aliases."""
        p = self._primary[block_id]
        return () if p is None else (p, *self._aliases[block_id])

    def get_cached_block(self, key: int) -> int | None:
        """One block registered under ``key`` (the first registered), or ``None``."""
        entry = self._map.get(key)
        if type(entry) is dict:
            return next(iter(entry))
        return entry

    def cached_prefix(self, keys: Iterable[int]) -> list[int]:
        """``get_cached_block`` of each of ``keys`` up to the first that is not cached: the
        blocks of the longest cached run of leading keys. One map read per key, without a call
        per key (the lookups' prefix walks read thousands of keys a step)."""
        out = []
        append = out.append
        for entry in map(self._map.get, keys):
            if entry is None:
                break
            append(next(iter(entry)) if type(entry) is dict else entry)
        return out

    def cached_blocks(self, key: int) -> list[int]:
        entry = self._map.get(key)
        if entry is None:
            return []
        return [entry] if isinstance(entry, int) else list(entry)

    def __contains__(self, key: int) -> bool:
        return key in self._map

    def iter_free(self, after: int | None = None) -> Iterator[int]:
        """Free blocks in eviction order (next victim first), optionally after ``after``."""
        return self._eviction.iter_blocks(after)

    def referenced_keys(self) -> list[int]:
        """Every key this pool refers to: the cached ones, those its eviction queue remembers
        (ghost lists) and those named by events not yet taken. A key id outside this list can
        be given to another hash without this pool noticing."""
        out = list(self._map)
        out += self._eviction.remembered_keys()
        for ev in self._events:
            if not isinstance(ev, AllBlocksCleared):
                out += ev.block_hashes
        return out

    def take_events(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        events, self._events = self._events, []
        return events

    # ---- validation ------------------------------------------------------------------------

    def _check_ids(self, block_ids: Sequence[int], what: str) -> None:
        if type(block_ids) is np.ndarray:
            # One vectorized range check for the arrays a planner batch passes.
            if not len(block_ids) or (block_ids.dtype.kind in "iu" and block_ids.ndim == 1
                                      and block_ids.min() >= 1
                                      and block_ids.max() < self.num_blocks):
                return
            block_ids = block_ids.tolist()
        if not block_ids:
            return
        # Fast path: plain ints within [1, n). The loop below finds the culprit for the message.
        try:
            if (min(block_ids) >= 1 and max(block_ids) < self.num_blocks
                    and {*map(type, block_ids)} == {int}):  # C-level: no call per id
                return
        except TypeError:  # mixed types: the loop names the bad one
            pass
        n = self.num_blocks
        for b in block_ids:
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < n:
                raise ValueError(f"{what}: block id {b!r} out of range [0, {n})")
            if b == NULL_BLOCK:
                raise ValueError(f"{what}: block id 0 is the null block")

    def _id_array(self, block_ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        """``block_ids`` checked (``_check_ids``) as an int64 array."""
        if type(block_ids) is np.ndarray and block_ids.dtype.kind in "iu" \
                and block_ids.ndim == 1:
            self._check_ids(block_ids, what)
            return block_ids.astype(np.int64, copy=False)
        block_ids = block_ids.tolist() if type(block_ids) is np.ndarray else block_ids
        self._check_ids(block_ids, what)
        return np.array(block_ids, dtype=np.int64)

    def _distinct(self, ids: np.ndarray) -> bool:
        return all_distinct(ids, self._scratch)

    # ---- allocation ------------------------------------------------------------------------

    def get_new_blocks(self, n: int) -> list[int]:
        """Hand out ``n`` blocks with ref count 1, evicting the hashes they still carried."""
        out = self._allocate(n)
        return out if type(out) is list else out.tolist()

    def _allocate(self, n: int) -> list[int] | np.ndarray:
        if (type(n) is not int and not is_int(n)) or n < 0:  # the common case first: hot path
            raise ValueError(f"get_new_blocks: n must be a non-negative int, got {n!r}")
        n = int(n)
        if n > len(self._eviction):
            raise ValueError(f"get_new_blocks: asked for {n} blocks, {len(self._eviction)} free")
        out = self._eviction.pop_many(n)
        if type(out) is np.ndarray:
            self._ref[out] = 1
            victims = out[self._hashed_np[out]]
            if len(victims):
                self._evict_many(victims.tolist())
            return out
        hashed, ref = self._hashed, self.ref_cnt
        victims = [b for b in out if hashed[b]]
        for b in out:
            ref[b] = 1
        if victims:
            self._evict_many(victims)
        return out

    def touch(self, block_ids: Sequence[int] | np.ndarray, user: object = None) -> None:
        """Take one more reference on each block; a free block leaves the free queue (a hit).

        ``user`` (a request id, say) names who takes the blocks: a free block taken again by
        the user that took it last is a repeated touch, not reuse, and the eviction queue is
        told so (a waiting request's lookup pins its CPU hit every step it stays waiting).
        ``None``: every touch of a free block counts as reuse."""
        if len(block_ids) > self.batch_min:
            self._touch_many(self._id_array(block_ids, "touch"), user)
            return
        self._check_ids(block_ids, "touch")
        remove, ref, last = self._eviction.remove, self.ref_cnt, self._last_user
        if type(block_ids) is np.ndarray:
            block_ids = block_ids.tolist()
        for b in block_ids:
            r = ref[b]
            if not r:
                remove(b, reuse=user is None or last[b] != user)
                if user is not None:
                    last[b] = user
            ref[b] = r + 1

    def pin_held(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """``touch``: this pool's counts are arrays, so a pin costs as little either way."""
        self.touch(block_ids)

    def _touch_many(self, ids: np.ndarray, user: object) -> None:
        """``touch`` in array operations: the free blocks leave the queue (once each, in the
        order first named), then every reference is added."""
        distinct = self._distinct(ids)
        free = ids[self._ref[ids] == 0]
        if len(free):
            if not distinct:
                _, first = np.unique(free, return_index=True)
                free = free[np.sort(first)]
            if user is None:
                self._eviction.remove_many(free, True)
            else:
                remove, last = self._eviction.remove, self._last_user
                for b in free.tolist():
                    remove(b, reuse=last[b] != user)
                    last[b] = user
        if distinct:
            self._ref[ids] += 1
        else:
            np.add.at(self._ref, ids, 1)

    def free_blocks(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Drop one reference on each block, in order.

        Blocks reaching ref count 0 join the free queue: unhashed ones at the head (reused
        first), hashed ones at the tail in the order given, so pass a chain's tail first to make
        its head the last to go.
        """
        if type(block_ids) is not np.ndarray:
            block_ids = list(block_ids)
        if len(block_ids) > self.batch_min:
            ids = self._id_array(block_ids, "free_blocks")
            if self._distinct(ids):
                self._free_distinct(ids)
                return
            block_ids = ids.tolist()
        elif type(block_ids) is np.ndarray:
            block_ids = block_ids.tolist()
        self._check_ids(block_ids, "free_blocks")
        ref = self.ref_cnt
        # Distinct ids (the usual case) only need ref >= 1 each, checked in one C-level min;
        # repeats need their multiplicity. The loop finds the culprit for the message.
        if len(set(block_ids)) < len(block_ids) or \
                (block_ids and min(map(ref.__getitem__, block_ids)) < 1):
            for b, times in Counter(block_ids).items():
                if ref[b] < times:
                    raise ValueError(f"free_blocks: block {b} freed {times}x with ref count "
                                     f"{ref[b]} (double free)")
        push, primary = self._eviction.push, self._primary
        for b in block_ids:
            left = ref[b] - 1
            ref[b] = left
            if not left:
                push(b, primary[b])

    def _free_distinct(self, ids: np.ndarray) -> None:
        """``free_blocks`` of distinct ids in array operations: the blocks reaching 0 are pushed
        in the order given, as the loop would push them."""
        left = self._ref[ids] - 1
        if (left < 0).any():
            b = int(ids[np.argmax(left < 0)])
            raise ValueError(f"free_blocks: block {b} freed 1x with ref count 0 (double free)")
        self._ref[ids] = left
        zero = ids[left == 0]
        if len(zero):
            self._eviction.push_many(zero, self._hashed_np[zero], self._primary)

    # ---- checks for tests and fuzzing ------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if any pool invariant is broken (O(num_blocks))."""
        assert self.ref_cnt[NULL_BLOCK] == 0 and NULL_BLOCK not in self._eviction
        assert self._primary[NULL_BLOCK] is None
        for b in range(1, self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} ref count {self.ref_cnt[b]}"
            assert (b in self._eviction) == (self.ref_cnt[b] == 0), f"block {b} queue membership"
            assert self._primary[b] is not None or self._group[b] is None, (
                f"unhashed block {b} keeps group {self._group[b]}")
            assert bool(self._hashed[b]) == (self._primary[b] is not None), (
                f"block {b}: hashed flag {self._hashed[b]}, primary {self._primary[b]}")
            for k in self.block_keys(b):
                assert b in self.cached_blocks(k), f"block {b} key {k:#x} missing from map"
        n_map = 0
        for k, entry in self._map.items():
            blocks = [entry] if isinstance(entry, int) else list(entry)
            for b in blocks:
                assert k in self.block_keys(b), f"map key {k:#x} -> block {b} not on block"
                n_map += 1
        assert n_map == sum(len(self.block_keys(b)) for b in range(self.num_blocks))
        free = sum(1 for b in range(1, self.num_blocks) if not self.ref_cnt[b])
        assert len(self._eviction) == free


def cached_prefix_blocks(pool: BlockPool, keys: Iterable[int]) -> list[int]:
    """Blocks of the longest run of leading ``keys`` cached in ``pool``."""
    return pool.cached_prefix(keys)
