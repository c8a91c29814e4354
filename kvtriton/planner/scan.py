"""The fused store scan: one vectorized pass over presence masks per step.

The state it reads (per-row tables and cursors, per-GPU-block and per-key arrays) is
``ScanState``'s (``kvtriton.planner.scan_state``), kept current by the planner's calls and the
pools' listeners; ``FusedSelector`` adds the pass.

A pass follows the phases of ``selection.py``: *candidates* are only the positions past each
cursor plus the owners' positions of wanted keys, so a step costs O(new + evicted) rather than
O(every stored block); *classify* decides all of them at once on the masks; *budget* applies the
re-store caps and the CPU budget; *cursor* advances the cursors. The arrays are NumPy's: on the
scheduler's CPU a NumPy op costs about a microsecond, a few times less than a torch op on CPU
tensors, and this pass is a few dozen such ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtriton.planner.scan_state import ScanState, ragged_ranges
from kvtriton.planner.selection import Selection
from kvtriton.planner.stats import ScanOutcomes
from kvtriton.pool import NULL_BLOCK

__all__ = ["FusedSelector"]


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


class FusedSelector(ScanState):
    """``ScanState`` with the pass: ``select`` runs the four phases on its arrays;
    ``check_invariants`` checks the whole state against the rows and the pools."""

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
            which, pos = ragged_ranges(self._cursor[g, rows], ready[:, g])
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
