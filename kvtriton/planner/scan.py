"""The fused store scan: one vectorized pass over presence masks per step.

State lives in arrays that persist across steps and are updated by events, never rebuilt:

- per positional group g, indexed ``[g, row, position]``: ``_block_table`` (GPU block ids,
  ``NULL_BLOCK`` where none) and ``_table_keys`` (primary keys, -1 past the row's keys); indexed
  ``[g, row]``: ``_num_blocks`` (table lengths) and ``_cursor``;
- per GPU block: ``_gpu_block_key`` (the primary key it holds, -1) and ``_in_flight_block``;
- per key: ``_in_cpu``, ``_in_flight_key``, ``_wanted``, ``_restore_count`` (times re-stored),
  ``_gpu_block_of_key`` (a GPU block caching it, -1), and its owners: ``_num_owners`` (how many
  rows hold it), ``_owner`` (one of them; the others in ``_extra_owners``), and where it sits in
  their tables, ``_key_group`` and ``_key_position`` (the same in every owner's table: a key is a
  chain hash, so it fixes the position).

A pass follows the phases of ``selection.py``: *candidates* are only the positions past each
cursor plus the owners' positions of wanted keys, so a step costs O(new + evicted) rather than
O(every stored block); *classify* decides all of them at once on the masks; *budget* applies the
re-store caps and the CPU budget; *cursor* advances the cursors. The arrays are NumPy's: on the
scheduler's CPU a NumPy op costs about a microsecond, a few times less than a torch op on CPU
tensors, and this pass is a few dozen such ops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import wraps
from itertools import chain

import numpy as np

from kvtriton.planner.selection import Selection, StoreSelector
from kvtriton.planner.stats import ScanOutcomes
from kvtriton.pool import NULL_BLOCK, BlockPool, GpuPool
from kvtriton.specs import KVLayout

__all__ = ["FusedSelector"]


def _grow(a: np.ndarray, axis: int, size: int, fill) -> np.ndarray:
    """``a`` padded with ``fill`` along ``axis`` to at least ``size`` (doubling)."""
    old = a.shape[axis]
    if size <= old:
        return a
    new = max(size, 2 * old)
    shape = list(a.shape)
    shape[axis] = new - old
    return np.concatenate([a, np.full(shape, fill, dtype=a.dtype)], axis=axis)


def _ragged_ranges(starts: np.ndarray, stops: np.ndarray):
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


@dataclass(slots=True)
class _Candidates:
    """One pass's candidates in (scan rank, group, position) order: ``rank`` indexes the pass's
    rows, ``src`` is the source GPU block (``NULL_BLOCK``: none), ``key`` the primary key."""

    rank: np.ndarray
    row: np.ndarray
    group: np.ndarray
    position: np.ndarray
    is_restore: np.ndarray
    src: np.ndarray
    key: np.ndarray


class FusedSelector(StoreSelector):
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
        which, pos = _ragged_ranges(n0, n1)
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

    # ---- the scan -------------------------------------------------------------------------

    def select(self, rows, ready, budget, restore_budget):
        sel = Selection()
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return sel
        ready = np.asarray(ready, dtype=np.int64).reshape(len(rows), self._num_groups)
        if not (self._restore and self._wanted_buf_len) and \
                (ready <= self._cursor[:, rows].T).all():
            # No new position past any cursor and nothing wanted: no candidate (most steps of
            # a decode-heavy batch), found in three array ops instead of a candidate pass.
            return sel
        cands = self._candidates(rows, ready)
        if cands is None:
            return sel
        firsts, dups = self._classify(cands, sel.outcomes)
        chosen, deferred = self._apply_budget(cands, firsts, budget, restore_budget,
                                              sel.outcomes)
        self._advance_cursors(rows, ready, cands, chosen, deferred, dups, budget)
        self._take(sel, cands, chosen)
        return sel

    def _candidates(self, rows: np.ndarray, ready: np.ndarray) -> _Candidates | None:
        """New positions ``[cursor, ready)`` of every row and group, and with re-store on the
        positions below the cursor of every scanned owner of a wanted key; None if there are
        none."""
        G = self._num_groups
        self._scan_rank[rows] = np.arange(len(rows))
        ranks, groups, positions, is_restore = [], [], [], []
        for g in range(G):
            which, pos = _ragged_ranges(self._cursor[g, rows], ready[:, g])
            ranks.append(which)
            groups.append(np.full(len(pos), g, dtype=np.int64))
            positions.append(pos)
            is_restore.append(np.zeros(len(pos), dtype=bool))
        if self._restore and self._wanted_buf_len:
            r_row, r_key = self._restore_candidates()
            r_rank = self._scan_rank[r_row]
            r_pos = self._key_position[r_key]
            if G == 1:
                r_group = np.zeros(len(r_key), dtype=np.int64)
                keep = (r_rank >= 0) & (r_pos < self._cursor[0][r_row])
            else:
                r_group = self._key_group[r_key]
                keep = (r_rank >= 0) & (r_pos < self._cursor[r_group, r_row])
            if not keep.all():
                r_rank, r_group, r_pos = r_rank[keep], r_group[keep], r_pos[keep]
            ranks.append(r_rank)
            groups.append(r_group)
            positions.append(r_pos)
            is_restore.append(np.ones(len(r_rank), dtype=bool))
        self._scan_rank[rows] = -1
        _, n_rows, n_cols = self._block_table.shape
        if len(ranks) == 1:
            # One group's new positions only: the ragged ranges are in candidate order already.
            rank, grp, pos, isr = ranks[0], groups[0], positions[0], is_restore[0]
            if len(rank) == 0:
                return None
        else:
            rank = np.concatenate(ranks)
            grp = np.concatenate(groups)
            pos = np.concatenate(positions)
            isr = np.concatenate(is_restore)
            if len(rank) == 0:
                return None
            # Keys are distinct; the stable sort runs fast over the presorted pieces.
            order = np.argsort((rank * G + grp) * n_cols + pos, kind="stable")
            rank, grp, pos, isr = rank[order], grp[order], pos[order], isr[order]
        row = rows[rank]
        flat = (grp * n_rows + row) * n_cols + pos
        src = self._block_table.ravel()[flat]
        key = self._table_keys.ravel()[flat]
        if not self._any_sliding:
            return _Candidates(rank, row, grp, pos, isr, src, key)
        lost = (src == NULL_BLOCK) & self._is_sliding[grp]
        if lost.any():
            found = self._gpu_block_of_key[key[lost]]
            src[lost] = np.where(found >= 0, found, NULL_BLOCK)
        return _Candidates(rank, row, grp, pos, isr, src, key)

    def _classify(self, c: _Candidates, out: ScanOutcomes) -> tuple[np.ndarray, np.ndarray]:
        """Outcomes up to ``duplicate``, first match wins; returns the indices of the surviving
        candidates that are their key's first occurrence in the pass, and of the duplicates."""
        # Each outcome is a subset of what `ok` still holds, so `^=` removes it from `ok`.
        ok = c.src != NULL_BLOCK
        not_hashed = ok & (self._gpu_block_key[c.src] != c.key)
        out.null = len(ok) - int(np.count_nonzero(ok))
        ok ^= not_hashed
        in_flight = ok & (self._in_flight_block[c.src] | self._in_flight_key[c.key])
        ok ^= in_flight
        cached = ok & self._in_cpu[c.key]
        ok ^= cached
        idx = np.flatnonzero(ok)
        is_first = self._first_occurrence(c.key[idx] if len(idx) < len(ok) else c.key)
        if is_first.all():
            firsts, dups = idx, idx[:0]
        else:
            firsts, dups = idx[is_first], idx[~is_first]
        out.not_hashed = int(not_hashed.sum())
        out.in_flight = int(in_flight.sum())
        out.already_cached = int(cached.sum())
        out.duplicate = len(dups)
        return firsts, dups

    def _apply_budget(self, c: _Candidates, firsts: np.ndarray, budget: int,
                      restore_budget: int | None, out: ScanOutcomes
                      ) -> tuple[np.ndarray, np.ndarray]:
        """``restore_capped`` (per-key or per-step bound) and ``deferred`` (no CPU block left)
        among ``firsts``; returns the indices of the selected and of the deferred candidates."""
        if self._max_restores_per_key is None and restore_budget is None:
            # No re-store cap: the first `budget` candidates are selected, the rest deferred.
            budget = max(budget, 0)
            out.restore_capped = 0
            out.deferred = max(0, len(firsts) - budget)
            if len(firsts) <= budget:
                return firsts, firsts[:0]
            return firsts[:budget], firsts[budget:]
        f_restore = c.is_restore[firsts]
        capped = np.zeros(len(firsts), dtype=bool)
        if self._max_restores_per_key is not None:
            capped |= f_restore & (self._restore_count[c.key[firsts]]
                                   >= self._max_restores_per_key)
        # The step cap admits the first `restore_budget` allowed re-stores; later ones are capped
        # only once all of those were selected, otherwise the budget ran out first (deferred).
        late = np.zeros(len(firsts), dtype=bool)
        if restore_budget is not None:
            allowed = f_restore & ~capped
            late = allowed & (np.cumsum(allowed) > restore_budget)
        eligible = ~capped & ~late
        chosen = eligible & (np.cumsum(eligible) <= budget)
        if late.any():
            admitted = np.flatnonzero(f_restore & ~capped & ~late)
            all_in = len(admitted) == 0 or chosen[admitted[-1]]
            capped |= late if all_in else np.zeros_like(late)
        deferred = ~capped & ~chosen
        out.restore_capped = int(capped.sum())
        out.deferred = int(deferred.sum())
        return firsts[chosen], firsts[deferred]

    def _advance_cursors(self, rows: np.ndarray, ready: np.ndarray, c: _Candidates,
                         chosen: np.ndarray, deferred: np.ndarray, dups: np.ndarray,
                         budget: int) -> None:
        """Each cursor moves to its first deferred new position, or duplicate of a key not
        selected, else to ``ready``; never backwards; not at all where the budget was spent
        before the pass reached its (row, group)."""
        if len(dups):
            # Which duplicates repeat a selected key: flag the selected keys, read, clear.
            chosen_keys = c.key[chosen]
            self._key_flag[chosen_keys] = True
            key_chosen = self._key_flag[c.key[dups]]
            self._key_flag[chosen_keys] = False
            stop_idx = np.concatenate([deferred, dups[~key_chosen]])
        else:
            stop_idx = deferred
        if len(stop_idx):
            stop_idx = stop_idx[~c.is_restore[stop_idx]]
        frozen = np.zeros(0, dtype=np.int64)
        if len(chosen) >= budget:
            # Segments (one per scanned row and group, in candidate order) that start with
            # the budget already spent.
            n = len(c.rank)
            picked = np.zeros(n, dtype=bool)
            picked[chosen] = True
            before = np.cumsum(picked) - picked
            starts = np.flatnonzero(np.concatenate(
                ([True], (c.rank[1:] != c.rank[:-1]) | (c.group[1:] != c.group[:-1]))))
            frozen = starts[before[starts] >= budget]
        cursor = self._cursor
        for g in range(self._num_groups):
            new_cursor = ready[:, g].copy()
            if len(stop_idx):
                s = stop_idx[c.group[stop_idx] == g]
                np.minimum.at(new_cursor, c.rank[s], c.position[s])
            if len(frozen):
                new_cursor[c.rank[frozen[c.group[frozen] == g]]] = 0  # max() keeps the old one
            cursor[g, rows] = np.maximum(cursor[g, rows], new_cursor)

    def _take(self, sel: Selection, c: _Candidates, chosen: np.ndarray) -> None:
        """Fill ``sel`` with the selected candidates; count re-stores and thrash; selected keys
        are no longer wanted."""
        out = sel.outcomes
        if len(chosen) == len(c.key):
            # Every candidate selected (chosen is then 0 .. n-1): the columns as they are.
            r_chosen, gpu, keys, rows, groups, positions = (
                c.is_restore, c.src, c.key, c.row, c.group, c.position)
        else:
            r_chosen, gpu, keys = c.is_restore[chosen], c.src[chosen], c.key[chosen]
            rows, groups, positions = c.row[chosen], c.group[chosen], c.position[chosen]
        out.restored = int(r_chosen.sum())
        out.stored = len(chosen) - out.restored
        if out.restored:
            rk = keys[r_chosen] if out.restored < len(keys) else keys
            sel.thrash = int((self._restore_count[rk] > 0).sum())
            self._restore_count[rk] += 1
        self._wanted[keys] = False
        if self._wanted_buf_len:
            # The candidates' pass compacted the buffer and nothing was pushed since.
            self._compact_wanted(unique=True)
        # The planner reads ids as lists (transfers, batches) and the rest as arrays: each
        # column is converted once, only where it is read.
        sel.rows = rows
        sel.groups = [0] * len(chosen) if self._num_groups == 1 else groups.tolist()
        sel.positions = positions
        sel.gpu_blocks = gpu.tolist()
        sel.keys = keys.tolist()
        sel.restore = r_chosen
        sel.arrays = (gpu, keys)

    # ---- checks for tests and fuzzing ------------------------------------------------------

    def check_invariants(self, *, idle=False):
        G, n_rows, n_cols = self._block_table.shape
        n_keys = len(self._in_cpu)
        assert self._num_groups == G and self._table_keys.shape == self._block_table.shape
        assert self._num_blocks.shape == self._cursor.shape == (G, n_rows) == (
            G, len(self._scan_rank))
        for a in (self._in_flight_key, self._wanted, self._restore_count, self._gpu_block_of_key,
                  self._num_owners, self._owner, self._key_position, self._key_group,
                  self._first_scratch, self._key_flag):
            assert len(a) == n_keys, "per-key arrays of different lengths"
        assert (self._scan_rank == -1).all(), "scan ranks left set after a pass"
        assert not self._key_flag.any(), "key flags left set after a pass"
        # Tables and cursors: rows not held are empty; cursors stay within their tables.
        assert (self._num_blocks <= n_cols).all()
        assert (self._cursor <= self._num_blocks).all(), "a cursor past its table's end"
        held = np.zeros(n_rows, dtype=bool)
        held[list(self._row_keys)] = True
        assert not self._num_blocks[:, ~held].any() and not self._cursor[:, ~held].any(), (
            "a released row kept its table or cursor")
        # Ownership: counts, owner and extra owners equal the held rows' keys, which sit at their
        # recorded group and position in every owner's table.
        counts = np.zeros(n_keys, dtype=np.int64)
        holders: dict[int, set[int]] = {}
        for row, ks in self._row_keys.items():
            counts[np.unique(ks)] += 1
            at = self._table_keys[self._key_group[ks], row, self._key_position[ks]]
            assert (at == ks).all(), f"row {row}: a key is not at its recorded position"
            for k in ks.tolist():
                holders.setdefault(k, set()).add(row)
        assert (self._num_owners == counts).all(), "ownership counts differ from the rows' keys"
        for k, owners in holders.items():
            extra = self._extra_owners.get(k, [])
            assert len(extra) == len(owners) - 1 and {int(self._owner[k]), *extra} == owners, (
                f"key {k}: owner {self._owner[k]}, extra {extra}, held by {sorted(owners)}")
        assert set(self._extra_owners) <= set(holders), "extra owners of an unowned key"
        owned = self._num_owners > 0
        assert (self._owner[~owned] == -1).all(), "an unowned key has an owner"
        # Mirrors of the pools.
        in_cpu = np.zeros(n_keys, dtype=bool)
        cpu = self._cpu_pool
        for b in range(1, cpu.num_blocks):
            for k in cpu.block_keys(b):
                assert k < n_keys, f"CPU key {k} past the key capacity"
                in_cpu[k] = True
        assert (self._in_cpu == in_cpu).all(), "CPU presence mask differs from the CPU pool"
        assert self.running_present == int((in_cpu & owned).sum()), "running_present drifted"
        gpu = self._gpu_pool
        block_key = np.full(len(self._gpu_block_key), -1, dtype=np.int64)
        block_of_key = np.full(n_keys, -1, dtype=np.int64)
        for b in range(1, gpu.num_blocks):
            keys = gpu.block_keys(b)
            if keys:
                block_key[b] = keys[0]
            for k in keys:
                block_of_key[k] = gpu.get_cached_block(k)
        assert (self._gpu_block_key == block_key).all(), "GPU block keys differ from the pool"
        assert (self._gpu_block_of_key == block_of_key).all(), (
            "GPU blocks of keys differ from the pool")
        assert not self._in_flight_block[NULL_BLOCK], "the null block is in flight"
        # Wanted keys are owned and absent from the CPU, and all in the buffer.
        assert not (self._wanted & ~owned).any(), "a wanted key is owned by no row"
        assert not (self._wanted & self._in_cpu).any(), "a wanted key is in the CPU"
        assert self._restore or not self._wanted.any(), "a wanted key with re-store off"
        buffered = set(self._wanted_buf[:self._wanted_buf_len].tolist())
        assert set(np.flatnonzero(self._wanted).tolist()) <= buffered, (
            "a wanted key missing from the wanted buffer")
        if idle:
            assert not owned.any() and not self._extra_owners and not self._row_keys, (
                "rows still held")
            assert not self._in_flight_block.any() and not self._in_flight_key.any(), (
                "in-flight flags still set")
            assert not self._wanted.any(), "keys still wanted"
