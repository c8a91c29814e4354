"""The loop reference: the store selection of ``selection.py`` written block by block.

This is the semantics in its plainest form, the baseline that the fused scan is tested against
and benchmarked with. With re-store on it walks every confirmed position of every scanned request
each step, as the re-scan re-store design does; with re-store off it walks ``[cursor, ready)``
only, the cursor-only control, as vLLM's ``SimpleCPUOffloadConnector`` stores. The phases of
``selection.py`` (candidates, classify, budget, cursor) run per candidate inside one loop, kept
inline because the loop's own cost is what the benchmarks compare against.
"""

from __future__ import annotations

import numpy as np

from kvtriton.planner.selection import Selection, StoreSelector
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.pool_interface import GpuPool
from kvtriton.specs import KVLayout

__all__ = ["LoopSelector"]


class _Row:
    __slots__ = ("cursor", "keys", "tables")

    def __init__(self, keys: list[list[int]]) -> None:
        self.keys = keys
        self.tables: list[list[int]] = [[] for _ in keys]
        self.cursor = [0] * len(keys)


class LoopSelector(StoreSelector):
    def __init__(self, layout: KVLayout, gpu_pool: GpuPool, cpu_pool: BlockPool, *,
                 restore: bool, max_restores_per_key: int | None = None) -> None:
        self._is_sliding = [g.kind == "sliding_window" for g in layout.groups]
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._restore = restore
        self._max_restores_per_key = max_restores_per_key
        self._rows: dict[int, _Row] = {}
        self._num_owners: dict[int, int] = {}  # key -> rows holding it (owned keys only)
        self._wanted: set[int] = set()
        self._in_flight_blocks: set[int] = set()
        self._in_flight_keys: set[int] = set()
        self._restore_count: dict[int, int] = {}
        self.running_evictions = 0
        self.running_present = 0

    # ---- tracking -------------------------------------------------------------------------

    def admit(self, row, primary_keys):
        keys = [[int(k) for k in ks] for ks in primary_keys]
        self._rows[row] = _Row(keys)
        for ks in keys:
            for k in ks:
                n = self._num_owners.get(k, 0)
                self._num_owners[k] = n + 1
                if not n and k in self._cpu_pool:
                    self.running_present += 1

    def release(self, row):
        state = self._rows.pop(row)
        for ks in state.keys:
            for k in ks:
                n = self._num_owners[k] - 1
                if n:
                    self._num_owners[k] = n
                else:
                    del self._num_owners[k]
                    self._wanted.discard(k)
                    self.running_present -= k in self._cpu_pool

    def append_blocks(self, row, group, block_ids):
        self._rows[row].tables[group].extend(block_ids)

    def table(self, row, group):
        return list(self._rows[row].tables[group])

    def cursor(self, row, group):
        return self._rows[row].cursor[group]

    # ---- pool events ----------------------------------------------------------------------

    def on_cpu_insert(self, key, block):
        self._wanted.discard(key)
        if key in self._num_owners and len(self._cpu_pool.cached_blocks(key)) == 1:  # new key
            self.running_present += 1

    def on_cpu_evict(self, key, block):
        # Listeners run once `block` left the map: another block may still hold the key.
        if key in self._num_owners and key not in self._cpu_pool:
            self.running_present -= 1
            self.running_evictions += 1
            if self._restore:
                self._wanted.add(key)

    def on_gpu_insert(self, key, block):
        pass  # the loop asks the GPU pool directly

    def on_gpu_evict(self, key, block):
        pass

    def set_in_flight(self, gpu_blocks, keys, value):
        if value:
            self._in_flight_blocks.update(gpu_blocks)
            self._in_flight_keys.update(keys)
        else:
            self._in_flight_blocks.difference_update(gpu_blocks)
            self._in_flight_keys.difference_update(keys)

    def in_flight(self, gpu_block, key):
        return gpu_block in self._in_flight_blocks or key in self._in_flight_keys

    def want(self, keys):
        if self._restore:
            self._wanted.update(k for k in keys
                                if k in self._num_owners and k not in self._cpu_pool)

    def wanted_below_cursor(self, row, group):
        state = self._rows[row]
        return [p for p in range(state.cursor[group]) if state.keys[group][p] in self._wanted]

    def in_flight_flags(self):
        return set(self._in_flight_blocks), set(self._in_flight_keys)

    @property
    def key_slots(self):
        return len(self._num_owners) + len(self._restore_count)

    def referenced_keys(self):
        keys = set(self._num_owners) | self._in_flight_keys | self._wanted
        return np.fromiter(keys, dtype=np.int64, count=len(keys))

    def forget_keys(self, keys):
        for k in np.asarray(keys).tolist():
            self._restore_count.pop(k, None)

    # ---- the scan -------------------------------------------------------------------------

    def select(self, rows, ready, budget, restore_budget):
        sel = Selection()
        out = sel.outcomes
        gpu, cpu = self._gpu_pool, self._cpu_pool
        first_selected: dict[int, bool] = {}  # key met in this pass -> its first one selected
        n_restores = 0
        for i, row in enumerate(rows):
            state = self._rows[row]
            for g, table in enumerate(state.tables):
                cur = state.cursor[g]
                spent = len(sel) >= budget  # nothing left when the pass got here: cursor stays
                stop = None  # the first deferred new position, or duplicate of an unselected key
                # Candidates: [cursor, ready), and with re-store on the wanted positions below the
                # cursor, even past `ready` (confirmed tokens can shrink, e.g. when output
                # placeholders grow).
                start, end = (0, max(cur, int(ready[i, g]))) if self._restore \
                    else (cur, int(ready[i, g]))
                keys = state.keys[g]
                for pos in range(start, end):
                    key = keys[pos]
                    is_restore = pos < cur
                    if is_restore and key not in self._wanted:
                        continue
                    src = table[pos]
                    if src == NULL_BLOCK and self._is_sliding[g]:
                        src = gpu.get_cached_block(key) or NULL_BLOCK
                    # Classify: the first matching outcome wins.
                    if src == NULL_BLOCK:
                        out.null += 1
                        continue
                    if gpu.block_hash(src) != key:
                        out.not_hashed += 1
                        continue
                    if src in self._in_flight_blocks or key in self._in_flight_keys:
                        out.in_flight += 1
                        continue
                    if key in cpu:
                        out.already_cached += 1
                        continue
                    if key in first_selected:
                        out.duplicate += 1
                        if not first_selected[key] and not is_restore and stop is None:
                            stop = pos
                        continue
                    # Budget: the re-store bounds, then the CPU blocks left.
                    if is_restore and (
                        (restore_budget is not None and n_restores >= restore_budget)
                        or (self._max_restores_per_key is not None
                            and self._restore_count.get(key, 0) >= self._max_restores_per_key)):
                        out.restore_capped += 1
                        first_selected[key] = False
                        continue
                    if len(sel) >= budget:
                        out.deferred += 1
                        first_selected[key] = False
                        if not is_restore and stop is None:
                            stop = pos
                        continue
                    first_selected[key] = True
                    sel.rows.append(row)
                    sel.groups.append(g)
                    sel.positions.append(pos)
                    sel.gpu_blocks.append(src)
                    sel.keys.append(key)
                    sel.restore.append(is_restore)
                    if is_restore:
                        n_restores += 1
                        out.restored += 1
                        times = self._restore_count.get(key, 0)
                        sel.thrash += times > 0
                        self._restore_count[key] = times + 1
                    else:
                        out.stored += 1
                # Cursor: never backwards.
                if not spent:
                    state.cursor[g] = max(cur, int(ready[i, g]) if stop is None else stop)
        self._wanted.difference_update(sel.keys)
        return sel

    # ---- checks for tests and fuzzing ------------------------------------------------------

    def check_invariants(self, *, idle=False):
        counts: dict[int, int] = {}
        for row, state in self._rows.items():
            assert len(state.tables) == len(state.keys) == len(state.cursor)
            for g, table in enumerate(state.tables):
                assert 0 <= state.cursor[g] <= len(table), (
                    f"row {row} group {g}: cursor {state.cursor[g]} past its table of {len(table)}")
            for ks in state.keys:
                for k in ks:
                    counts[k] = counts.get(k, 0) + 1
        assert counts == self._num_owners, "ownership counts differ from the rows' keys"
        cpu = self._cpu_pool
        present = sum(k in cpu for k in self._num_owners)
        assert self.running_present == present, (
            f"running_present {self.running_present}, recomputed {present}")
        assert self._wanted <= self._num_owners.keys(), "a wanted key is owned by no row"
        assert not any(k in cpu for k in self._wanted), "a wanted key is in the CPU"
        assert self._restore or not self._wanted, "a wanted key with re-store off"
        assert all(n > 0 for n in self._restore_count.values())
        assert NULL_BLOCK not in self._in_flight_blocks, "the null block is in flight"
        if idle:
            assert not self._rows and not self._num_owners, "rows still held"
            assert not self._in_flight_blocks and not self._in_flight_keys, (
                "in-flight flags still set")
            assert not self._wanted, "keys still wanted"
