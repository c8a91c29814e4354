"""Next use in trace order, and the oracle eviction queue built on it (an oracle reference:
online setups can pass it, so it bounds nothing).

The simulator knows the whole workload, so for every key it knows which requests will hold it.
"Next use" is measured in *trace order* (the workload's request order, by arrival): the next use
of a key is the first request after the last admitted request that held it, in trace order,
that holds it again (``len(workload)``: never). It moves when a request is first admitted (its
lookup ran and it got blocks), not when it arrives: a waiting request still counts as a future
use. Closed-loop turns may be admitted out of trace order; the rule stays "trace order", which
is what this bound is: Belady's MIN rule for the CPU tier inside the serving loop, not a proof
of optimality (the GPU's own LRU, the store mode and the timing stay the setup's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from kvtriton.eviction.ranked import RankedHeapQueue

__all__ = ["NextUse", "NextUseQueue"]


class NextUse:
    """Per key (dense ids ``0 .. n_keys - 1``), the index of the next request that holds it.

    ``keys[i]``: the key ids of request ``i`` (any shape; repeats are fine). Memory: three int64
    entries per (request, distinct key) pair plus two per key."""

    def __init__(self, keys: list[np.ndarray], n_keys: int) -> None:
        self.never = len(keys)
        uniq = [np.unique(np.asarray(k, dtype=np.int64).ravel()) for k in keys]
        lens = np.array([len(u) for u in uniq], dtype=np.int64)
        flat = np.concatenate(uniq) if uniq else np.zeros(0, dtype=np.int64)
        req = np.repeat(np.arange(len(keys), dtype=np.int64), lens)
        order = np.lexsort((req, flat))
        self._req_sorted = req[order]
        sorted_keys = flat[order]
        self._start = np.searchsorted(sorted_keys, np.arange(n_keys), side="left")
        self._end = np.searchsorted(sorted_keys, np.arange(n_keys), side="right")
        # Where each (request, key) pair sits in the sorted order, grouped by request.
        where = np.empty(len(order), dtype=np.int64)
        where[order] = np.arange(len(order))
        self._offsets = np.concatenate([[0], np.cumsum(lens)])
        self._where = where
        self._flat = flat
        self._ptr = self._start.copy()
        self.next = np.full(n_keys, self.never, dtype=np.int64)
        has = self._start < self._end
        self.next[has] = self._req_sorted[self._start[has]]
        self._consumed = np.zeros(len(keys), dtype=bool)
        self._listeners: list[Callable[[np.ndarray], None]] = []

    def add_listener(self, on_change: Callable[[np.ndarray], None]) -> None:
        """``on_change(keys)`` after ``consume`` moved the next use of ``keys``."""
        self._listeners.append(on_change)

    def consume(self, i: int) -> None:
        """Request ``i`` was admitted: its keys' next use moves past it (once per request)."""
        if self._consumed[i]:
            return
        self._consumed[i] = True
        a, b = self._offsets[i], self._offsets[i + 1]
        ks, pos = self._flat[a:b], self._where[a:b]
        ptr = np.maximum(self._ptr[ks], pos + 1)
        self._ptr[ks] = ptr
        live = ptr < self._end[ks]
        nxt = np.full(len(ks), self.never, dtype=np.int64)
        nxt[live] = self._req_sorted[ptr[live]]
        changed = ks[nxt != self.next[ks]]
        self.next[ks] = nxt
        if len(changed):
            for cb in self._listeners:
                cb(changed)


class NextUseQueue(RankedHeapQueue):
    """Evict the free block whose key's next use is furthest (unhashed blocks first; ties: the
    one freed longest ago). A heap with lazy deletion: O(log n) per push, pop and re-rank."""

    name = "nextuse"

    def __init__(self, next_use: NextUse) -> None:
        self._nu = next_use
        next_use.add_listener(self._rerank_array)

    def reset(self, num_blocks: int) -> None:
        super().reset(num_blocks)  # entries (-next use, push order, stamp, block)
        self._pushed = [0] * num_blocks  # when the block was pushed (ties: earliest first)

    def _rank(self, block_id: int, key: int) -> tuple[int, int]:
        return -self._nu.next.item(key), self._pushed[block_id]

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._unhashed.appendleft(block_id)
            return
        self._pushed[block_id] = self._clock + 1  # the entry's own clock: a re-rank keeps it
        self._add(block_id, key)

    def _rerank_array(self, keys: np.ndarray) -> None:
        self._rerank(keys.tolist())

    def remembered_keys(self) -> Iterable[int]:
        return ()
