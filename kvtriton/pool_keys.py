"""The key map of ``BlockPool``: registering a block under its keys, and dropping them.

Every change to which keys are hittable happens here (``cache_block``, ``cache_blocks``, the
evictions an allocation causes, ``evict_cached``, ``reset_prefix_cache``), and with it every call to
the listeners and every event (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); the ref
counts and the free queue stay in ``kvtriton.pool``. ``PoolKeyMap`` is a base of ``BlockPool`` with
no state of its own: it works on the pool's buffers as ``BlockPool.__init__`` sets them up
(``_primary``, ``_aliases``, ``_group``, ``_hashed``, ``_map``, the listener lists, ``_events``) and
calls back into the pool for id checks (``_check_ids``), batch notification (``_notify_many``) and
the free queue's refill (``_fill_free_queue``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtriton.pool_interface import AllBlocksCleared, BlockRemoved, BlockStored
from kvtriton.validation import is_int

__all__ = ["PoolKeyMap"]

# The pool's logger: its records carry one name whichever half of the pool emits them.
logger = logging.getLogger("kvtriton.pool")


class PoolKeyMap:
    """The hashing operations of ``BlockPool`` (see the module docstring for the state they
    share with it)."""

    def cache_block(
        self,
        block_id: int,
        key: int,
        aliases: Sequence[int] = (),
        *,
        parent_key: int | None = None,
        token_ids: Sequence[int] = (),
        block_size: int = 0,
        lora_id: int | None = None,
        group_idx: int | None = None,
    ) -> None:
        """Register ``block_id`` under its primary ``key`` and ``aliases``; ``group_idx`` (the
        KV-cache group the block belongs to) is kept until the block's hashes are evicted
        (``block_group``) and named in its ``BlockStored`` event.

        The block must be unhashed and referenced (a free block would be evicted unseen).
        """
        if type(block_id) is not int or not 0 < block_id < self.num_blocks:
            self._check_ids([block_id], "cache_block")
        if self._primary[block_id] is not None:
            raise ValueError(f"cache_block: block {block_id} is already cached under "
                             f"{self._primary[block_id]:#x}")
        if self.ref_cnt[block_id] == 0:
            raise ValueError(f"cache_block: block {block_id} is free; cache it while referenced")
        aliases = tuple(a for a in dict.fromkeys(aliases) if a != key) if aliases else ()
        for k in (key, *aliases):
            # A None key would leave the block looking unhashed while the map holds it.
            if type(k) is not int and not is_int(k):  # the common case first: hot path
                raise ValueError(f"cache_block: key {k!r} of block {block_id} is not an int")
        if group_idx is not None and (not is_int(group_idx) or group_idx < 0):
            raise ValueError(f"cache_block: group_idx {group_idx!r} of block {block_id} is not "
                             "a non-negative int")
        self._register(block_id, key, aliases, group_idx)
        if self._on_insert_many:
            self._notify_many(self._on_insert_many, [key, *aliases],
                              [block_id] * (1 + len(aliases)))
        if self.enable_events:
            self._events.append(BlockStored([key, *aliases], parent_key, list(token_ids),
                                            block_size, lora_id, self.medium, None, group_idx))

    def _register(self, block_id: int, key: int, aliases: tuple[int, ...],
                  group_idx: int | None) -> None:
        self._primary[block_id] = key
        self._hashed[block_id] = 1
        self._group[block_id] = None if group_idx is None else int(group_idx)
        self._aliases[block_id] = aliases
        for k in (key, *aliases):
            self._map_add(k, block_id)
            for cb in self._on_insert:
                cb(k, block_id)

    def cache_blocks(self, block_ids: Sequence[int], keys: Sequence[Sequence[int]],
                     group_idx: Sequence[int | None] | None = None) -> None:
        """``cache_block`` for each block in order, ``keys[i]`` its primary key then aliases; the
        batch listeners are called once, after all of them. Every block is checked first: a bad
        one raises ``ValueError`` and none is cached."""
        n = len(block_ids)
        if len(keys) != n or (group_idx is not None and len(group_idx) != n):
            raise ValueError(f"cache_blocks: {n} blocks, {len(keys)} key lists, "
                             f"{n if group_idx is None else len(group_idx)} groups")
        self._check_ids(list(block_ids), "cache_blocks")
        groups = [None] * n if group_idx is None else list(group_idx)
        primary, ref = self._primary, self.ref_cnt
        todo = []
        for b, ks, g in zip(block_ids, keys, groups, strict=True):
            if not ks:
                raise ValueError(f"cache_blocks: block {b} has no key")
            if primary[b] is not None:
                raise ValueError(f"cache_blocks: block {b} is already cached under "
                                 f"{primary[b]:#x}")
            if ref[b] == 0:
                raise ValueError(f"cache_blocks: block {b} is free; cache it while referenced")
            for k in ks:
                if type(k) is not int and not is_int(k):
                    raise ValueError(f"cache_blocks: key {k!r} of block {b} is not an int")
            if g is not None and ((type(g) is not int and not is_int(g)) or g < 0):
                raise ValueError(f"cache_blocks: group_idx {g!r} of block {b} is not a "
                                 "non-negative int")
            key = ks[0]
            aliases = tuple(a for a in dict.fromkeys(ks[1:]) if a != key) if len(ks) > 1 else ()
            todo.append((b, key, aliases, g))
        if len({t[0] for t in todo}) != n:
            raise ValueError("cache_blocks: a block is named twice")
        all_keys, all_blocks = [], []
        # The common case inlined: a block with one key no other block holds, in a pool with
        # no per-key listener and no events (``_register`` then only sets its entries).
        quiet = not self._on_insert and not self.enable_events
        entries, groups_of, aliases_of, hashed = self._map, self._group, self._aliases, \
            self._hashed
        for b, key, aliases, g in todo:
            if quiet and not aliases and key not in entries:
                primary[b] = key
                hashed[b] = 1
                groups_of[b] = None if g is None else int(g)
                aliases_of[b] = ()
                entries[key] = b
                all_keys.append(key)
                all_blocks.append(b)
                continue
            self._register(b, key, aliases, g)
            all_keys.append(key)
            all_blocks.append(b)
            if aliases:
                all_keys += aliases
                all_blocks += [b] * len(aliases)
            if self.enable_events:
                self._events.append(BlockStored([key, *aliases], None, [], 0, None, self.medium,
                                                None, g))
        self._notify_many(self._on_insert_many, all_keys, all_blocks)

    def _map_add(self, key: int, b: int) -> None:
        entry = self._map.get(key)
        if entry is None:
            self._map[key] = b
        elif isinstance(entry, int):
            self._map[key] = {entry: None, b: None}
        else:
            entry[b] = None

    def _map_remove(self, key: int, b: int) -> None:
        entry = self._map[key]
        if isinstance(entry, int):
            del self._map[key]
            return
        del entry[b]
        if len(entry) == 1:
            self._map[key] = next(iter(entry))

    def _evict(self, b: int) -> tuple[int, ...]:
        """Drop the hashes of ``b``; per-key listeners are called, batch listeners are the
        caller's (``_evict_many``). Returns the keys dropped."""
        keys = self.block_keys(b)
        self._eviction.on_evicted(b, keys[0])
        self._primary[b] = None
        self._hashed[b] = 0
        self._group[b] = None
        self._last_user[b] = None
        self._aliases[b] = ()
        for k in keys:
            self._map_remove(k, b)
            for cb in self._on_evict:
                cb(k, b)
        if self.enable_events:
            self._events.append(BlockRemoved(list(keys), self.medium))
        return keys

    def _evict_many(self, blocks: list[int]) -> None:
        """Drop the hashes of ``blocks`` in order, then tell the batch listeners once."""
        if not self._on_evict_many:
            for b in blocks:
                self._evict(b)
            return
        if not self._on_evict and not self.enable_events:
            self._evict_many_quiet(blocks)
            return
        all_keys, all_blocks = [], []
        for b in blocks:
            keys = self._evict(b)
            all_keys += keys
            all_blocks += [b] * len(keys) if len(keys) > 1 else (b,)
        self._notify_many(self._on_evict_many, all_keys, all_blocks)

    def _evict_many_quiet(self, blocks: list[int]) -> None:
        """``_evict_many`` for a pool with batch listeners only (no per-key listener, no
        events), ``_evict`` inlined: the simulator's pools evict hundreds of thousands of
        blocks a run, and the per-block calls were a tenth of its time."""
        primary, aliases, group, last = self._primary, self._aliases, self._group, self._last_user
        on_evicted = self._eviction.on_evicted if self._tracks_evictions else None
        entries, hashed = self._map, self._hashed
        all_keys: list[int] = []
        all_blocks: list[int] = []
        for b in blocks:
            key, extra = primary[b], aliases[b]
            if on_evicted is not None:
                on_evicted(b, key)
            primary[b] = group[b] = last[b] = None
            hashed[b] = 0
            if extra:
                aliases[b] = ()
                for k in (key, *extra):
                    self._map_remove(k, b)
                all_keys += (key, *extra)
                all_blocks += [b] * (1 + len(extra))
                continue
            if type(entries[key]) is dict:  # other blocks share the key
                self._map_remove(key, b)
            else:
                del entries[key]
            all_keys.append(key)
            all_blocks.append(b)
        self._notify_many(self._on_evict_many, all_keys, all_blocks)

    def evict_cached(self, block_id: int) -> bool:
        """Drop the hashes of a free cached block now (it stays free, first to be reused).

        Returns False (and changes nothing) if the block is referenced or unhashed. Used to model
        outside pressure on a tier, e.g. the benchmark's per-step eviction rate.
        """
        self._check_ids([block_id], "evict_cached")
        if self.ref_cnt[block_id] or self._primary[block_id] is None:
            return False
        self._eviction.remove(block_id)
        self._evict_many([block_id])
        self._eviction.push(block_id, None)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash if no block is referenced; returns whether it did."""
        if self.num_used_blocks:
            logger.warning("reset_prefix_cache: %d blocks still referenced; not reset",
                           self.num_used_blocks)
            return False
        dropped = [(k, b) for b in range(1, self.num_blocks) for k in self.block_keys(b)]
        # Listeners see the pool as it is after the reset, as they do for a single eviction.
        self._map.clear()
        self._primary = [None] * self.num_blocks
        self._hashed_np[:] = False
        self._aliases = [()] * self.num_blocks
        self._group = [None] * self.num_blocks
        self._last_user = [None] * self.num_blocks
        self._fill_free_queue()
        for k, b in dropped:
            for cb in self._on_evict:
                cb(k, b)
        self._notify_many(self._on_evict_many, [k for k, _ in dropped], [b for _, b in dropped])
        if self.enable_events:
            self._events.append(AllBlocksCleared(self.medium))
        return True
