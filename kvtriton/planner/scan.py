"""The fused store scan: one vectorized pass over presence masks per step.

State lives in arrays that persist across steps and are updated by events, never rebuilt:

- per positional group g: ``_tbl[g, row, pos]`` GPU block ids, ``_keys[g, row, pos]`` primary
  keys, ``_nblk[g, row]`` table lengths, ``_cur[g, row]`` cursors;
- per GPU block: ``_gpu_key`` (the key it holds, -1) and ``_inflight_gpu``;
- per key: ``_present`` (in the CPU), ``_inflight_key``, ``_wanted``, ``_restored`` (times
  re-stored), ``_gpu_of_key`` (a GPU block caching it), and its owners: ``_nown`` (how many rows
  hold it), ``_owner`` (one of them; the others in ``_extra_owners``), ``_pos`` and ``_group``.

Candidates are only positions past each cursor plus the owners' positions of wanted keys, so a
step costs O(new + evicted) rather than O(every stored block); the masks then decide all of them
at once. The arrays are NumPy's: on the scheduler's CPU a NumPy op costs about a microsecond,
a few times less than a torch op on CPU tensors, and this pass is a few dozen such ops.
"""

from __future__ import annotations

import numpy as np

from kvtriton.planner.selection import Selection, StoreSelector
from kvtriton.pool import BlockPool
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
    total = int(lens.sum())
    which = np.repeat(np.arange(len(lens)), lens)
    offsets = np.cumsum(lens) - lens
    pos = np.arange(total) - offsets[which] + starts[which]
    return which, pos


class FusedSelector(StoreSelector):
    def __init__(self, layout: KVLayout, gpu_pool: BlockPool, cpu_pool: BlockPool, *,
                 restore: bool, max_restores_per_key: int | None = None,
                 rows: int = 64, cols: int = 256, keys: int = 4096) -> None:
        self._G = layout.num_groups
        self._sliding = np.array([g.kind == "sliding_window" for g in layout.groups])
        self._gpu = gpu_pool
        self._cpu = cpu_pool
        self._restore = restore
        self._max_per_key = max_restores_per_key
        G = self._G
        self._tbl = np.zeros((G, rows, cols), dtype=np.int64)
        self._keys = np.full((G, rows, cols), -1, dtype=np.int64)
        self._nblk = np.zeros((G, rows), dtype=np.int64)
        self._cur = np.zeros((G, rows), dtype=np.int64)
        self._rank = np.full(rows, -1, dtype=np.int64)
        n_gpu = gpu_pool.num_blocks
        self._gpu_key = np.full(n_gpu, -1, dtype=np.int64)
        self._inflight_gpu = np.zeros(n_gpu, dtype=bool)
        self._present = np.zeros(keys, dtype=bool)
        self._inflight_key = np.zeros(keys, dtype=bool)
        self._wanted = np.zeros(keys, dtype=bool)
        self._restored = np.zeros(keys, dtype=np.int32)
        self._gpu_of_key = np.full(keys, -1, dtype=np.int64)
        self._nown = np.zeros(keys, dtype=np.int32)
        self._owner = np.full(keys, -1, dtype=np.int64)
        self._pos = np.zeros(keys, dtype=np.int64)
        self._group = np.zeros(keys, dtype=np.int64)
        self._scratch = np.zeros(keys, dtype=np.int64)  # per-pass scratch, see _first_occurrence
        self._flag = np.zeros(keys, dtype=bool)  # per-pass scratch, all False between passes
        self._extra_owners: dict[int, list[int]] = {}
        self._row_keys: dict[int, np.ndarray] = {}
        # Keys that became wanted, appended by callbacks (may repeat or lapse; compacted per scan).
        self._wanted_buf = np.zeros(1024, dtype=np.int64)
        self._n_wanted = 0
        self.running_evictions = 0
        self.running_present = 0

    # ---- capacity -------------------------------------------------------------------------

    def _ensure_keys(self, n: int) -> None:
        if n <= len(self._present):
            return
        self._present = _grow(self._present, 0, n, False)
        self._inflight_key = _grow(self._inflight_key, 0, n, False)
        self._wanted = _grow(self._wanted, 0, n, False)
        self._restored = _grow(self._restored, 0, n, 0)
        self._gpu_of_key = _grow(self._gpu_of_key, 0, n, -1)
        self._nown = _grow(self._nown, 0, n, 0)
        self._owner = _grow(self._owner, 0, n, -1)
        self._pos = _grow(self._pos, 0, n, 0)
        self._group = _grow(self._group, 0, n, 0)
        self._scratch = _grow(self._scratch, 0, n, 0)
        self._flag = _grow(self._flag, 0, n, False)

    def _ensure_rows(self, n: int) -> None:
        if n <= self._tbl.shape[1]:
            return
        self._tbl = _grow(self._tbl, 1, n, 0)
        self._keys = _grow(self._keys, 1, n, -1)
        self._nblk = _grow(self._nblk, 1, n, 0)
        self._cur = _grow(self._cur, 1, n, 0)
        self._rank = _grow(self._rank, 0, n, -1)

    def _ensure_cols(self, n: int) -> None:
        if n <= self._tbl.shape[2]:
            return
        self._tbl = _grow(self._tbl, 2, n, 0)
        self._keys = _grow(self._keys, 2, n, -1)

    # ---- tracking -------------------------------------------------------------------------

    def admit(self, row, primary_keys):
        self._ensure_rows(row + 1)
        parts = []
        for g, ks in enumerate(primary_keys):
            ks = np.asarray(ks, dtype=np.int64)
            n = len(ks)
            self._ensure_cols(n)
            self._keys[g, row, :n] = ks
            self._keys[g, row, n:] = -1
            if n:
                self._ensure_keys(int(ks.max()) + 1)
                self._pos[ks] = np.arange(n)
                self._group[ks] = g
                parts.append(ks)
        self._nblk[:, row] = 0
        self._cur[:, row] = 0
        allk = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self._row_keys[row] = allk
        shared = allk[self._nown[allk] > 0]
        first = allk[self._nown[allk] == 0]
        self._owner[first] = row
        self.running_present += int(self._present[first].sum())
        for k in shared.tolist():
            self._extra_owners.setdefault(k, []).append(row)
        self._nown[allk] += 1

    def release(self, row):
        allk = self._row_keys.pop(row)
        self._nown[allk] -= 1
        mine = self._owner[allk] == row
        gone = self._nown[allk] == 0
        self._owner[allk[mine & gone]] = -1
        self._wanted[allk[gone]] = False
        self.running_present -= int(self._present[allk[gone]].sum())
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
        self._nblk[:, row] = 0
        self._cur[:, row] = 0

    def append_blocks(self, row, group, block_ids):
        n0 = int(self._nblk[group, row])
        n1 = n0 + len(block_ids)
        self._ensure_cols(n1)
        self._tbl[group, row, n0:n1] = block_ids
        self._nblk[group, row] = n1

    def table(self, row, group):
        return self._tbl[group, row, :self._nblk[group, row]].tolist()

    def cursor(self, row, group):
        return int(self._cur[group, row])

    # ---- pool events ----------------------------------------------------------------------

    def on_cpu_insert(self, key, block):
        if key >= len(self._present):
            self._ensure_keys(key + 1)
        if not self._present[key] and self._nown[key] > 0:
            self.running_present += 1
        self._present[key] = True
        self._wanted[key] = False

    def on_cpu_evict(self, key, block):
        if key >= len(self._present):
            self._ensure_keys(key + 1)
        if key in self._cpu:  # another CPU block still holds it (`block` already left the map)
            return
        was_present = self._present[key]
        self._present[key] = False
        if self._nown[key] > 0:
            self.running_present -= int(was_present)
            self.running_evictions += 1
            if self._restore:
                self._wanted[key] = True
                self._push_wanted(key)

    def on_gpu_insert(self, key, block):
        if key >= len(self._present):
            self._ensure_keys(key + 1)
        if self._gpu.block_hash(block) == key:
            self._gpu_key[block] = key
        if self._gpu_of_key[key] < 0:
            self._gpu_of_key[key] = block

    def on_gpu_evict(self, key, block):
        if self._gpu_key[block] == key:
            self._gpu_key[block] = -1
        if key < len(self._gpu_of_key) and self._gpu_of_key[key] == block:
            other = self._gpu.get_cached_block(key)
            self._gpu_of_key[key] = -1 if other is None else other

    def set_in_flight(self, gpu_blocks, keys, value):
        if keys:
            self._ensure_keys(max(keys) + 1)
        self._inflight_gpu[gpu_blocks] = value
        self._inflight_key[keys] = value

    def in_flight(self, gpu_block, key):
        return bool(self._inflight_gpu[gpu_block]
                    or (key < len(self._inflight_key) and self._inflight_key[key]))

    def want(self, keys):
        if not self._restore:
            return
        for k in keys:
            if k < len(self._nown) and self._nown[k] > 0 and not self._present[k]:
                self._wanted[k] = True
                self._push_wanted(k)

    def wanted_below_cursor(self, row, group):
        cur = int(self._cur[group, row])
        ks = self._keys[group, row, :cur]
        return np.flatnonzero(self._wanted[ks]).tolist()

    # ---- the scan -------------------------------------------------------------------------

    def _first_occurrence(self, keys: np.ndarray) -> np.ndarray:
        """Mask of the first occurrence of each key in ``keys``; O(n), no sort.

        Writing positions in reverse leaves each key's scratch slot holding its first position.
        """
        at = np.arange(len(keys))
        self._scratch[keys[::-1]] = at[::-1]
        return self._scratch[keys] == at

    def _push_wanted(self, key: int) -> None:
        if self._n_wanted == len(self._wanted_buf):
            self._wanted_buf = _grow(self._wanted_buf, 0, 2 * self._n_wanted, 0)
        self._wanted_buf[self._n_wanted] = key
        self._n_wanted += 1

    def _compact_wanted(self) -> np.ndarray:
        """The keys still wanted, once each; the buffer is rewritten to hold just them."""
        w = self._wanted_buf[:self._n_wanted]
        w = w[self._wanted[w]]
        w = w[self._first_occurrence(w)]
        self._n_wanted = len(w)
        self._wanted_buf[:len(w)] = w
        return w

    def _restore_candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, key) for every owner of every wanted key."""
        w = self._compact_wanted()
        rows, keys = [self._owner[w]], [w]
        shared = w[self._nown[w] > 1]
        for k in shared.tolist() if len(shared) else ():
            extra = self._extra_owners[k]
            rows.append(np.asarray(extra, dtype=np.int64))
            keys.append(np.full(len(extra), k, dtype=np.int64))
        return np.concatenate(rows), np.concatenate(keys)

    def select(self, rows, ready, budget, restore_budget):
        sel = Selection()
        out = sel.outcomes
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if n == 0:
            return sel
        G = self._G
        ready = np.asarray(ready, dtype=np.int64).reshape(n, G)
        self._rank[rows] = np.arange(n)
        ranks, groups, positions, is_restore = [], [], [], []
        for g in range(G):
            which, pos = _ragged_ranges(self._cur[g, rows], ready[:, g])
            ranks.append(which)
            groups.append(np.full(len(pos), g, dtype=np.int64))
            positions.append(pos)
            is_restore.append(np.zeros(len(pos), dtype=bool))
        if self._restore and self._n_wanted:
            rrow, rkey = self._restore_candidates()
            rrank = self._rank[rrow]
            rgroup = self._group[rkey]
            rpos = self._pos[rkey]
            keep = (rrank >= 0) & (rpos < self._cur.ravel()[rgroup * self._cur.shape[1] + rrow])
            ranks.append(rrank[keep])
            groups.append(rgroup[keep])
            positions.append(rpos[keep])
            is_restore.append(np.ones(int(keep.sum()), dtype=bool))
        rank = np.concatenate(ranks)
        grp = np.concatenate(groups)
        pos = np.concatenate(positions)
        isr = np.concatenate(is_restore)
        self._rank[rows] = -1
        if len(rank) == 0:
            return sel
        order = np.argsort((rank * G + grp) * self._tbl.shape[2] + pos)  # keys are distinct
        rank, grp, pos, isr = rank[order], grp[order], pos[order], isr[order]
        row = rows[rank]
        flat = (grp * self._tbl.shape[1] + row) * self._tbl.shape[2] + pos
        src = self._tbl.ravel()[flat]
        key = self._keys.ravel()[flat]
        lost = (src == 0) & self._sliding[grp]
        if lost.any():
            src[lost] = np.maximum(self._gpu_of_key[key[lost]], 0)

        null = src == 0
        not_hashed = ~null & (self._gpu_key[src] != key)
        ok = ~null & ~not_hashed
        in_flight = ok & (self._inflight_gpu[src] | self._inflight_key[key])
        ok &= ~in_flight
        cached = ok & self._present[key]
        ok &= ~cached

        idx = np.flatnonzero(ok)
        is_first = self._first_occurrence(key[idx])
        firsts, dups = idx[is_first], idx[~is_first]

        f_restore = isr[firsts]
        capped = np.zeros(len(firsts), dtype=bool)
        if self._max_per_key is not None:
            capped |= f_restore & (self._restored[key[firsts]] >= self._max_per_key)
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

        chosen_idx = firsts[chosen]
        # Which duplicates repeat a selected key: flag the selected keys, read, clear.
        self._flag[key[chosen_idx]] = True
        key_chosen = self._flag[key[dups]]
        self._flag[key[chosen_idx]] = False

        # Cursor: first deferred new position, or duplicate of an unselected key, else ready.
        stop_idx = np.concatenate([firsts[deferred], dups[~key_chosen]])
        stop_idx = stop_idx[~isr[stop_idx]]
        cur = self._cur
        for g in range(G):
            new_cur = ready[:, g].copy()
            s = stop_idx[grp[stop_idx] == g]
            np.minimum.at(new_cur, rank[s], pos[s])
            cur[g, rows] = np.maximum(cur[g, rows], new_cur)

        out.null = int(null.sum())
        out.not_hashed = int(not_hashed.sum())
        out.in_flight = int(in_flight.sum())
        out.already_cached = int(cached.sum())
        out.duplicate = len(dups)
        out.restore_capped = int(capped.sum())
        out.deferred = int(deferred.sum())
        r_chosen = isr[chosen_idx]
        out.restored = int(r_chosen.sum())
        out.stored = len(chosen_idx) - out.restored

        if out.restored:
            rk = key[chosen_idx[r_chosen]]
            sel.thrash = int((self._restored[rk] > 0).sum())
            self._restored[rk] += 1
        self._wanted[key[chosen_idx]] = False
        if self._n_wanted:
            self._compact_wanted()
        sel.rows = row[chosen_idx].tolist()
        sel.groups = grp[chosen_idx].tolist()
        sel.positions = pos[chosen_idx].tolist()
        sel.gpu_blocks = src[chosen_idx].tolist()
        sel.keys = key[chosen_idx].tolist()
        sel.restore = r_chosen.tolist()
        return sel
