"""Free blocks by a rank, lowest first: a heap with lazy deletion, the skeleton of the queues
whose order changes while blocks sit in them (``lfu``: a key's demand estimate grows with every
request that holds it; ``nextuse``: a key's next use moves when a request is admitted).

An entry is ``(rank, tie, stamp, block)``: ``_rank(block, key)`` gives the first two, ``stamp``
is the block's current entry (a re-rank pushes a new entry and leaves the old one in the heap,
stale: its stamp is no longer the block's). Pops skip stale entries; the heap is compacted when
stale entries outnumber live ones four to one. Unhashed blocks go first, newest freed first, as
in every queue of ``kvtriton.eviction``.
"""

from __future__ import annotations

import heapq
from abc import abstractmethod
from collections.abc import Iterable, Iterator

from kvtriton.eviction.base import EvictionQueue, LinkedQueue

__all__ = ["RankedHeapQueue"]


class RankedHeapQueue(EvictionQueue):
    """Hashed free blocks in a heap by ``_rank`` (lowest first), unhashed blocks before them.
    A subclass gives ``_rank`` and calls ``_enter`` to re-rank a block it holds."""

    def reset(self, num_blocks: int) -> None:
        self._unhashed = LinkedQueue(num_blocks)
        self._heap: list[tuple[int, int, int, int]] = []
        self._stamp = [0] * num_blocks  # the stamp of the block's live entry (0: not in the heap)
        self._key = [-1] * num_blocks
        self._by_key: dict[int, set[int]] = {}  # key -> its blocks in the heap
        self._clock = 0
        self._len = 0

    @abstractmethod
    def _rank(self, block_id: int, key: int) -> tuple[int, int]:
        """(rank, tie-break) of ``block_id`` caching ``key``: lower leaves first."""

    def _enter(self, b: int, key: int) -> None:
        """Push a fresh entry for ``b``: any older one goes stale."""
        self._clock += 1
        self._stamp[b] = self._clock
        heapq.heappush(self._heap, (*self._rank(b, key), self._clock, b))

    def _add(self, b: int, key: int) -> None:
        """``b`` caching ``key`` joins the heap."""
        self._key[b] = key
        blocks = self._by_key.get(key)
        if blocks is None:
            self._by_key[key] = {b}
        else:
            blocks.add(b)
        self._enter(b, key)
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

    def _rerank(self, keys: Iterable[int]) -> None:
        """New entries for the blocks of ``keys`` whose rank changed."""
        by_key = self._by_key
        for k in keys:
            for b in by_key.get(k, ()):
                self._enter(b, k)

    def remove(self, block_id: int, reuse: bool = True) -> None:
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

    def _live(self) -> list[tuple[int, int, int, int]]:
        stamp = self._stamp
        return [e for e in self._heap if stamp[e[3]] == e[2]]

    def _compact(self) -> None:
        self._heap = self._live()
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._unhashed) + self._len

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._unhashed or (0 <= block_id < len(self._stamp)
                                              and self._stamp[block_id] != 0)

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        order = [*self._unhashed, *(b for *_, b in sorted(self._live()))]
        if after is not None and after in self:
            order = order[order.index(after) + 1:]
        return iter(order)
