"""The fused scan's state: the arrays its pass reads, kept across steps.

They are updated by events (the planner's calls, the pools' listeners), never rebuilt:

- per positional group g, indexed ``[g, row, position]``: ``_block_table`` (GPU block ids,
  ``NULL_BLOCK`` where none) and ``_table_keys`` (primary keys, -1 past the row's keys); indexed
  ``[g, row]``: ``_num_blocks`` (table lengths) and ``_cursor``;
- per GPU block: ``_gpu_block_key`` (the primary key it holds, -1) and ``_in_flight_block``;
- per key: ``_in_cpu``, ``_in_flight_key``, ``_wanted``, ``_restore_count`` (times re-stored),
  ``_gpu_block_of_key`` (a GPU block caching it, -1), and its owners: ``_num_owners`` (how many
  rows hold it), ``_owner`` (one of them; the others in ``_extra_owners``), and where it sits in
  their tables, ``_key_group`` and ``_key_position`` (the same in every owner's table: a key is a
  chain hash, so it fixes the position).

``ScanState`` is everything of a ``StoreSelector`` but the pass itself: the rows' tables and
cursors (``admit``, ``append_blocks_many``, ``release``), the pools' mirrors kept by their
listeners, the in-flight flags and the wanted keys. The pass is ``FusedSelector``
(``kvtriton.planner.scan``): the bookkeeping apart, its phases read as one piece.
"""

from __future__ import annotations

import time
from functools import wraps
from itertools import chain

import numpy as np

from kvtriton.planner.selection import StoreSelector
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.pool_interface import GpuPool
from kvtriton.specs import KVLayout

__all__ = ["ScanState", "ragged_ranges"]


def _grow(a: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    """``a`` padded with ``fill`` along ``axis`` to at least ``size`` (doubling)."""
    old = a.shape[axis]
    if size <= old:
        return a
    new = max(size, 2 * old)
    shape = list(a.shape)
    shape[axis] = new - old
    return np.concatenate([a, np.full(shape, fill, dtype=a.dtype)], axis=axis)


def ragged_ranges(starts: np.ndarray, stops: np.ndarray):
    """Flattened ``range(starts[i], stops[i])`` for all i, with the index i of each element."""
    lens = np.maximum(stops - starts, 0)
    if len(lens) and lens.max() <= 1:
        # At most one element per range (a decode step's one new block per request).
        which = np.flatnonzero(lens)
        return which, starts[which]
    total = int(lens.sum())
    which = np.repeat(np.arange(len(lens)), lens)
    offsets = np.cumsum(lens) - lens
    pos = np.arange(total) - offsets[which] + starts[which]
    return which, pos


def _timed_listener(listener):
    """A batch listener whose time is added to the selector's ``listen_s`` (the step part the
    benchmark reports as listeners)."""
    @wraps(listener)
    def timed(self, keys, blocks):
        t0 = time.perf_counter()
        listener(self, keys, blocks)
        self.listen_s += time.perf_counter() - t0
    return timed


class ScanState(StoreSelector):
    """The fused selector's tables, cursors, ownership, pool mirrors, in-flight flags and wanted
    keys (the module docstring names each array); ``FusedSelector`` adds the pass."""

    def __init__(self, layout: KVLayout, gpu_pool: GpuPool, cpu_pool: BlockPool, *,
                 restore: bool, max_restores_per_key: int | None = None,
                 rows: int = 64, cols: int = 256, keys: int = 4096) -> None:
        self._num_groups = G = layout.num_groups
        self._is_sliding = np.array([g.kind == "sliding_window" for g in layout.groups])
        self._any_sliding = bool(self._is_sliding.any())
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._restore = restore
        self._max_restores_per_key = max_restores_per_key
        self._block_table = np.full((G, rows, cols), NULL_BLOCK, dtype=np.int64)
        self._table_keys = np.full((G, rows, cols), -1, dtype=np.int64)
        self._num_blocks = np.zeros((G, rows), dtype=np.int64)
        self._cursor = np.zeros((G, rows), dtype=np.int64)
        self._scan_rank = np.full(rows, -1, dtype=np.int64)  # a row's rank in the pass, else -1
        n_gpu = gpu_pool.num_blocks
        self._gpu_block_key = np.full(n_gpu, -1, dtype=np.int64)
        self._in_flight_block = np.zeros(n_gpu, dtype=bool)
        self._in_cpu = np.zeros(keys, dtype=bool)
        self._in_flight_key = np.zeros(keys, dtype=bool)
        self._wanted = np.zeros(keys, dtype=bool)
        self._restore_count = np.zeros(keys, dtype=np.int32)
        self._gpu_block_of_key = np.full(keys, -1, dtype=np.int64)
        self._num_owners = np.zeros(keys, dtype=np.int32)
        self._owner = np.full(keys, -1, dtype=np.int64)
        self._key_position = np.zeros(keys, dtype=np.int64)
        self._key_group = np.zeros(keys, dtype=np.int64)
        # Per-pass scratch: see _first_occurrence; and key flags, all False between passes.
        self._first_scratch = np.zeros(keys, dtype=np.int64)
        self._key_flag = np.zeros(keys, dtype=bool)
        self._extra_owners: dict[int, list[int]] = {}
        self._row_keys: dict[int, np.ndarray] = {}
        # Keys that became wanted, appended by callbacks (may repeat or lapse; compacted per scan).
        self._wanted_buf = np.zeros(1024, dtype=np.int64)
        self._wanted_buf_len = 0
        self.running_evictions = 0
        self.running_present = 0
        # Seconds spent in the batch listeners (``bench.vllm.vs_vllm`` reports it per step).
        self.listen_s = 0.0

    # ---- capacity -------------------------------------------------------------------------

    def _ensure_keys(self, n: int) -> None:
        if n <= len(self._in_cpu):
            return
        self._in_cpu = _grow(self._in_cpu, 0, n, False)
        self._in_flight_key = _grow(self._in_flight_key, 0, n, False)
        self._wanted = _grow(self._wanted, 0, n, False)
        self._restore_count = _grow(self._restore_count, 0, n, 0)
        self._gpu_block_of_key = _grow(self._gpu_block_of_key, 0, n, -1)
        self._num_owners = _grow(self._num_owners, 0, n, 0)
        self._owner = _grow(self._owner, 0, n, -1)
        self._key_position = _grow(self._key_position, 0, n, 0)
        self._key_group = _grow(self._key_group, 0, n, 0)
        self._first_scratch = _grow(self._first_scratch, 0, n, 0)
        self._key_flag = _grow(self._key_flag, 0, n, False)

    def _ensure_rows(self, n: int) -> None:
        if n <= self._block_table.shape[1]:
            return
        self._block_table = _grow(self._block_table, 1, n, NULL_BLOCK)
        self._table_keys = _grow(self._table_keys, 1, n, -1)
        self._num_blocks = _grow(self._num_blocks, 1, n, 0)
        self._cursor = _grow(self._cursor, 1, n, 0)
        self._scan_rank = _grow(self._scan_rank, 0, n, -1)

    def _ensure_cols(self, n: int) -> None:
        if n <= self._block_table.shape[2]:
            return
        self._block_table = _grow(self._block_table, 2, n, NULL_BLOCK)
        self._table_keys = _grow(self._table_keys, 2, n, -1)

    # ---- tracking -------------------------------------------------------------------------

    def admit(self, row, primary_keys):
        self._ensure_rows(row + 1)
        parts = []
        for g, ks in enumerate(primary_keys):
            ks = np.asarray(ks, dtype=np.int64)
            n = len(ks)
            self._ensure_cols(n)
            self._table_keys[g, row, :n] = ks
            self._table_keys[g, row, n:] = -1
            if n:
                self._ensure_keys(int(ks.max()) + 1)
                self._key_position[ks] = np.arange(n)
                self._key_group[ks] = g
                parts.append(ks)
        self._num_blocks[:, row] = 0
        self._cursor[:, row] = 0
        allk = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self._row_keys[row] = allk
        shared = allk[self._num_owners[allk] > 0]
        first = allk[self._num_owners[allk] == 0]
        self._owner[first] = row
        self.running_present += int(self._in_cpu[first].sum())
        for k in shared.tolist():
            self._extra_owners.setdefault(k, []).append(row)
        self._num_owners[allk] += 1

    def release(self, row):
        allk = self._row_keys.pop(row)
        self._num_owners[allk] -= 1
        mine = self._owner[allk] == row
        gone = self._num_owners[allk] == 0
        self._owner[allk[mine & gone]] = -1
        self._wanted[allk[gone]] = False
        self.running_present -= int(self._in_cpu[allk[gone]].sum())
        extra = self._extra_owners
        for k in allk[mine & ~gone].tolist():  # hand ownership to another holder
            others = extra[k]
            self._owner[k] = others.pop(0)
            if not others:
                del extra[k]
        for k in allk[~mine].tolist():  # this row was one of the extra holders
            others = extra[k]
            others.remove(row)
            if not others:
                del extra[k]
        self._num_blocks[:, row] = 0
        self._cursor[:, row] = 0

    def append_blocks(self, row, group, block_ids):
        n0 = int(self._num_blocks[group, row])
        n1 = n0 + len(block_ids)
        self._ensure_cols(n1)
        self._block_table[group, row, n0:n1] = block_ids
        self._num_blocks[group, row] = n1

    def append_blocks_many(self, group, rows, block_ids):
        counts = np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))
        if not counts.any():
            return counts
        rows = np.asarray(rows, dtype=np.int64)
        total = int(counts.sum())
        flat = np.fromiter(chain.from_iterable(block_ids), dtype=np.int64, count=total)
        n0 = self._num_blocks[group, rows]
        if total == len(rows) and counts.all():
            # One new block per row (every decode step): each lands at its row's length.
            self._ensure_cols(int(n0.max()) + 1)
            self._block_table[group, rows, n0] = flat
            self._num_blocks[group, rows] = n0 + 1
            return counts
        n1 = n0 + counts
        self._ensure_cols(int(n1.max()))
        which, pos = ragged_ranges(n0, n1)
        self._block_table[group, rows[which], pos] = flat
        # Rows are distinct (one entry per request), so a plain assignment is exact.
        self._num_blocks[group, rows] = n1
        return counts

    def table(self, row, group):
        return self._block_table[group, row, :self._num_blocks[group, row]].tolist()

    def cursor(self, row, group):
        return int(self._cursor[group, row])

    # ---- pool events ----------------------------------------------------------------------

    def on_cpu_insert(self, key, block):
        if key >= len(self._in_cpu):
            self._ensure_keys(key + 1)
        if not self._in_cpu[key] and self._num_owners[key] > 0:
            self.running_present += 1
        self._in_cpu[key] = True
        self._wanted[key] = False

    def on_cpu_evict(self, key, block):
        if key >= len(self._in_cpu):
            self._ensure_keys(key + 1)
        if key in self._cpu_pool:  # another CPU block still holds it (`block` already left)
            return
        was_present = self._in_cpu[key]
        self._in_cpu[key] = False
        if self._num_owners[key] > 0:
            self.running_present -= int(was_present)
            self.running_evictions += 1
            if self._restore:
                self._wanted[key] = True
                self._push_wanted(key)

    def on_gpu_insert(self, key, block):
        if key >= len(self._in_cpu):
            self._ensure_keys(key + 1)
        if self._gpu_pool.block_hash(block) == key:
            self._gpu_block_key[block] = key
        if self._gpu_block_of_key[key] < 0:
            self._gpu_block_of_key[key] = block

    def on_gpu_evict(self, key, block):
        if self._gpu_block_key[block] == key:
            self._gpu_block_key[block] = -1
        if key < len(self._gpu_block_of_key) and self._gpu_block_of_key[key] == block:
            other = self._gpu_pool.get_cached_block(key)
            self._gpu_block_of_key[key] = -1 if other is None else other

    batch_listeners = True

    @_timed_listener
    def on_cpu_insert_many(self, keys, blocks):
        self._ensure_keys(int(keys.max()) + 1)
        u = keys[self._first_occurrence(keys)]
        self.running_present += int((~self._in_cpu[u] & (self._num_owners[u] > 0)).sum())
        self._in_cpu[u] = True
        self._wanted[u] = False

    @_timed_listener
    def on_cpu_evict_many(self, keys, blocks):
        self._ensure_keys(int(keys.max()) + 1)
        u = keys[self._first_occurrence(keys)]
        # Called after the whole pool call: a key some other CPU block still holds stays.
        held = np.fromiter(map(self._cpu_pool.__contains__, u.tolist()), dtype=bool,
                           count=len(u))
        gone = u[~held]
        owned = gone[self._num_owners[gone] > 0]
        self.running_present -= int(self._in_cpu[owned].sum())
        self.running_evictions += len(owned)
        self._in_cpu[gone] = False
        if self._restore and len(owned):
            self._wanted[owned] = True
            self._push_wanted_many(owned)

    @_timed_listener
    def on_gpu_insert_many(self, keys, blocks):
        self._ensure_keys(int(keys.max()) + 1)
        block_hash = self._gpu_pool.block_hash
        primary = np.fromiter((block_hash(b) == k for k, b in zip(keys.tolist(), blocks.tolist(),
                                                                   strict=True)),
                              dtype=bool, count=len(keys))
        self._gpu_block_key[blocks[primary]] = keys[primary]
        # The first block inserted under a key the selector had no block for is the one.
        none = self._gpu_block_of_key[keys] < 0
        k, b = keys[none], blocks[none]
        first = self._first_occurrence(k)
        self._gpu_block_of_key[k[first]] = b[first]

    @_timed_listener
    def on_gpu_evict_many(self, keys, blocks):
        mine = self._gpu_block_key[blocks] == keys
        self._gpu_block_key[blocks[mine]] = -1
        inside = keys < len(self._gpu_block_of_key)
        k, b = keys[inside], blocks[inside]
        lost = k[self._gpu_block_of_key[k] == b]
        get = self._gpu_pool.get_cached_block
        for key in np.unique(lost).tolist():
            other = get(key)
            self._gpu_block_of_key[key] = -1 if other is None else other

    def set_in_flight(self, gpu_blocks, keys, value):
        if len(keys):
            self._ensure_keys((int(keys.max()) if type(keys) is np.ndarray else max(keys)) + 1)
        self._in_flight_block[gpu_blocks] = value
        self._in_flight_key[keys] = value

    def in_flight(self, gpu_block, key):
        return bool(self._in_flight_block[gpu_block]
                    or (key < len(self._in_flight_key) and self._in_flight_key[key]))

    def in_flight_flags(self):
        return (set(np.flatnonzero(self._in_flight_block).tolist()),
                set(np.flatnonzero(self._in_flight_key).tolist()))

    def want(self, keys):
        if not self._restore:
            return
        for k in keys:
            if k < len(self._num_owners) and self._num_owners[k] > 0 and not self._in_cpu[k]:
                self._wanted[k] = True
                self._push_wanted(k)

    def wanted_below_cursor(self, row, group):
        cur = int(self._cursor[group, row])
        ks = self._table_keys[group, row, :cur]
        return np.flatnonzero(self._wanted[ks]).tolist()

    @property
    def key_slots(self):
        return len(self._in_cpu)

    def referenced_keys(self):
        return np.flatnonzero((self._num_owners > 0) | self._in_flight_key | self._wanted)

    def forget_keys(self, keys):
        keys = np.asarray(keys, dtype=np.int64)
        keys = keys[keys < len(self._in_cpu)]
        self._restore_count[keys] = 0
        self._key_position[keys] = 0
        self._key_group[keys] = 0

    # ---- wanted keys ----------------------------------------------------------------------

    def _first_occurrence(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the first occurrence of each key in ``keys``; O(n), no sort.

        Writing positions in reverse leaves each key's scratch slot holding its first position.
        """
        at = np.arange(len(keys))
        self._first_scratch[keys[::-1]] = at[::-1]
        return self._first_scratch[keys] == at

    def _push_wanted(self, key: int) -> None:
        if self._wanted_buf_len == len(self._wanted_buf):
            self._wanted_buf = _grow(self._wanted_buf, 0, 2 * self._wanted_buf_len, 0)
        self._wanted_buf[self._wanted_buf_len] = key
        self._wanted_buf_len += 1

    def _push_wanted_many(self, keys: np.ndarray) -> None:
        n = self._wanted_buf_len + len(keys)
        self._wanted_buf = _grow(self._wanted_buf, 0, n, 0)
        self._wanted_buf[self._wanted_buf_len:n] = keys
        self._wanted_buf_len = n

    def _compact_wanted(self, unique: bool = False) -> np.ndarray:
        """The keys still wanted, once each; the buffer is rewritten to hold just them.
        ``unique``: the buffer holds each key once already (compacted earlier in this pass,
        nothing pushed since), so only the keys no longer wanted are dropped."""
        w = self._wanted_buf[:self._wanted_buf_len]
        w = w[self._wanted[w]]
        if not unique:
            w = w[self._first_occurrence(w)]
        self._wanted_buf_len = len(w)
        self._wanted_buf[:len(w)] = w
        return w

    def _restore_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, key) for every owner of every wanted key."""
        w = self._compact_wanted()
        rows, keys = [self._owner[w]], [w]
        shared = w[self._num_owners[w] > 1]
        if not len(shared):
            return rows[0], w
        for k in shared.tolist():
            extra = self._extra_owners[k]
            rows.append(np.asarray(extra, dtype=np.int64))
            keys.append(np.full(len(extra), k, dtype=np.int64))
        return np.concatenate(rows), np.concatenate(keys)
