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

import heapq
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from kvtriton.eviction.base import EvictionQueue, LinkedQueue

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


class NextUseQueue(EvictionQueue):
    """Evict the free block whose key's next use is furthest (unhashed blocks first; ties: the
    one freed longest ago). A heap with lazy deletion: O(log n) per push, pop and re-rank."""

    name = "nextuse"

    def __init__(self, next_use: NextUse) -> None:
        self._nu = next_use
        next_use.add_listener(self._rerank)

    def reset(self, num_blocks: int) -> None:
        self._unhashed = LinkedQueue(num_blocks)
        # Entries (-next use, push order, stamp, block): a re-rank keeps the push order.
        self._heap: list[tuple[int, int, int, int]] = []
        self._stamp = [0] * num_blocks  # stamp of the block's live heap entry (0: none)
        self._pushed = [0] * num_blocks  # when the block was pushed (ties: earliest first)
        self._key = [-1] * num_blocks
        self._by_key: dict[int, set[int]] = {}
        self._clock = 0
        self._len = 0

    def _enter(self, b: int, key: int) -> None:
        self._clock += 1
        self._stamp[b] = self._clock
        heapq.heappush(self._heap, (-self._nu.next.item(key), self._pushed[b], self._clock, b))

    def push(self, block_id: int, key: int | None) -> None:
        # Called for every block a waiting request's lookup unpins, step after step: ``_enter``
        # and the key's set are inlined (the new push order is the entry's clock).
        if key is None:
            self._unhashed.appendleft(block_id)
            return
        self._key[block_id] = key
        blocks = self._by_key.get(key)
        if blocks is None:
            self._by_key[key] = {block_id}
        else:
            blocks.add(block_id)
        self._clock = clock = self._clock + 1
        self._pushed[block_id] = self._stamp[block_id] = clock
        heapq.heappush(self._heap, (-self._nu.next.item(key), clock, clock, block_id))
        self._len += 1
        if len(self._heap) > 4 * self._len + 1024:
            self._compact()

    def _leave(self, b: int) -> None:
        self._stamp[b] = 0
        key = self._key[b]
        blocks = self._by_key[key]
        blocks.discard(b)
        if not blocks:
            del self._by_key[key]
        self._len -= 1

    def remove(self, block_id: int, reuse: bool = True) -> None:
        # A live heap entry (stamp) first: a block is either there or in the unhashed list.
        if self._stamp[block_id]:
            self._leave(block_id)
        elif block_id in self._unhashed:
            self._unhashed.remove(block_id)
        else:
            raise KeyError(block_id)

    def pop(self) -> int:
        if len(self._unhashed):
            return self._unhashed.popleft()
        heap, stamp = self._heap, self._stamp
        while heap:
            _, _, s, b = heapq.heappop(heap)
            if stamp[b] == s:
                self._leave(b)
                return b
        raise IndexError("pop from an empty queue")

    def pop_many(self, n: int) -> list[int]:
        # ``pop`` n times, its lookups hoisted (the pool asks for a whole allocation at once).
        unhashed = self._unhashed
        out = [unhashed.popleft() for _ in range(min(n, len(unhashed)))]
        heap, stamp, leave, heappop = self._heap, self._stamp, self._leave, heapq.heappop
        while len(out) < n:
            if not heap:
                raise IndexError("pop from an empty queue")
            _, _, s, b = heappop(heap)
            if stamp[b] == s:
                leave(b)
                out.append(b)
        return out

    def _rerank(self, keys: np.ndarray) -> None:
        by_key = self._by_key
        for k in keys.tolist():
            for b in by_key.get(k, ()):
                self._enter(b, k)

    def _compact(self) -> None:
        stamp = self._stamp
        self._heap = [e for e in self._heap if stamp[e[3]] == e[2]]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._unhashed) + self._len

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._unhashed or (0 <= block_id < len(self._stamp)
                                              and self._stamp[block_id] != 0)

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        stamp = self._stamp
        live = sorted(e for e in self._heap if stamp[e[3]] == e[2])
        order = [*self._unhashed, *(b for *_, b in live)]
        if after is not None and after in self:
            order = order[order.index(after) + 1:]
        return iter(order)

    def remembered_keys(self) -> Iterable[int]:
        return ()
