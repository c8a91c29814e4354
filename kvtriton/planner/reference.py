"""The loop reference: the store selection of ``selection.py`` written block by block.

This is the semantics in its plainest form, the baseline that the fused scan is tested against
and benchmarked with. With re-store on it walks every confirmed position of every scanned request
each step, as the seed-000 fix does; with re-store off it walks ``[cursor, ready)`` only, as the
seed-001 connector does.
"""

from __future__ import annotations

from kvtriton.planner.selection import Selection, StoreSelector
from kvtriton.pool import BlockPool
from kvtriton.specs import KVLayout

__all__ = ["LoopSelector"]


class _Row:
    __slots__ = ("cursor", "keys", "tables")

    def __init__(self, keys: list[list[int]]) -> None:
        self.keys = keys
        self.tables: list[list[int]] = [[] for _ in keys]
        self.cursor = [0] * len(keys)


class LoopSelector(StoreSelector):
    def __init__(self, layout: KVLayout, gpu_pool: BlockPool, cpu_pool: BlockPool, *,
                 restore: bool, max_restores_per_key: int | None = None) -> None:
        self._sliding = [g.kind == "sliding_window" for g in layout.groups]
        self._gpu = gpu_pool
        self._cpu = cpu_pool
        self._restore = restore
        self._max_per_key = max_restores_per_key
        self._rows: dict[int, _Row] = {}
        self._owners: dict[int, int] = {}
        self._wanted: set[int] = set()
        self._inflight_gpu: set[int] = set()
        self._inflight_key: set[int] = set()
        self._restored: dict[int, int] = {}
        self.running_evictions = 0
        self.running_present = 0

    # ---- tracking -------------------------------------------------------------------------

    def admit(self, row, primary_keys):
        keys = [[int(k) for k in ks] for ks in primary_keys]
        self._rows[row] = _Row(keys)
        for ks in keys:
            for k in ks:
                n = self._owners.get(k, 0)
                self._owners[k] = n + 1
                if not n and k in self._cpu:
                    self.running_present += 1

    def release(self, row):
        state = self._rows.pop(row)
        for ks in state.keys:
            for k in ks:
                n = self._owners[k] - 1
                if n:
                    self._owners[k] = n
                else:
                    del self._owners[k]
                    self._wanted.discard(k)
                    self.running_present -= k in self._cpu

    def append_blocks(self, row, group, block_ids):
        self._rows[row].tables[group].extend(block_ids)

    def table(self, row, group):
        return list(self._rows[row].tables[group])

    def cursor(self, row, group):
        return self._rows[row].cursor[group]

    # ---- pool events ----------------------------------------------------------------------

    def on_cpu_insert(self, key, block):
        self._wanted.discard(key)
        if key in self._owners and len(self._cpu.cached_blocks(key)) == 1:  # newly present
            self.running_present += 1

    def on_cpu_evict(self, key, block):
        # Listeners run once `block` left the map: another block may still hold the key.
        if key in self._owners and key not in self._cpu:
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
            self._inflight_gpu.update(gpu_blocks)
            self._inflight_key.update(keys)
        else:
            self._inflight_gpu.difference_update(gpu_blocks)
            self._inflight_key.difference_update(keys)

    def in_flight(self, gpu_block, key):
        return gpu_block in self._inflight_gpu or key in self._inflight_key

    def want(self, keys):
        if self._restore:
            self._wanted.update(k for k in keys if k in self._owners and k not in self._cpu)

    def wanted_below_cursor(self, row, group):
        state = self._rows[row]
        return [p for p in range(state.cursor[group]) if state.keys[group][p] in self._wanted]

    # ---- the scan -------------------------------------------------------------------------

    def select(self, rows, ready, budget, restore_budget):
        sel = Selection()
        out = sel.outcomes
        gpu, cpu = self._gpu, self._cpu
        first_selected: dict[int, bool] = {}
        n_restores = 0
        for i, row in enumerate(rows):
            state = self._rows[row]
            for g, table in enumerate(state.tables):
                cur = state.cursor[g]
                stop = None
                # Re-store candidates are every position below the cursor, even past `ready`
                # (confirmed tokens can shrink, e.g. when output placeholders grow).
                start, end = (0, max(cur, int(ready[i, g]))) if self._restore \
                    else (cur, int(ready[i, g]))
                keys = state.keys[g]
                for pos in range(start, end):
                    key = keys[pos]
                    is_restore = pos < cur
                    if is_restore and key not in self._wanted:
                        continue
                    src = table[pos]
                    if src == 0 and self._sliding[g]:
                        src = gpu.get_cached_block(key) or 0
                    if src == 0:
                        out.null += 1
                        continue
                    if gpu.block_hash(src) != key:
                        out.not_hashed += 1
                        continue
                    if src in self._inflight_gpu or key in self._inflight_key:
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
                    if is_restore and (
                        (restore_budget is not None and n_restores >= restore_budget)
                        or (self._max_per_key is not None
                            and self._restored.get(key, 0) >= self._max_per_key)):
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
                        times = self._restored.get(key, 0)
                        sel.thrash += times > 0
                        self._restored[key] = times + 1
                    else:
                        out.stored += 1
                state.cursor[g] = max(cur, int(ready[i, g]) if stop is None else stop)
        self._wanted.difference_update(sel.keys)
        return sel

