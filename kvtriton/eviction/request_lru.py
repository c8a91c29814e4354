"""Request-scoped LRU: the eviction order of vLLM 0.33's offloading connector (its CPU tier's
``LRUCachePolicy``), over the free blocks, on the skeleton it shares with the request-scoped ARC
(``request_scoped.RequestScopedQueue``).

Recency belongs to keys and is given by the requests that use them, not by when a block joins
the free queue (taking a block back and freeing it changes nothing):

- An admitted request takes a provisional rank, one number for all its batches. Each of its keys
  is ranked (request rank, -position): within one request the later position goes first, so a
  chain's tail is evicted before its head. A cached key takes that rank when it is newer than its
  own. A key is cached from its store's start (``on_store_started``), as vLLM inserts it at
  ``prepare_store``; it can be evicted once its store completed and nothing holds its block.
- A stored key is ranked by the request it is stored for: the newest live request holding it
  (that request's *claim* on the key); a key no live request holds (a Mamba state, a block a
  lazy tier stores after its request left) is ranked newest, as vLLM ranks a key without a
  position.
- A finish commits: the request's keys up to its computed tokens each take a new rank, tail
  first, so its head is the newest of all.
- Unhashed blocks go first, the last freed first, as in every queue here.

The victim is the free block of least rank; ties (two groups' keys at one position) go by key,
then block, as vLLM's heap breaks them by key bytes. A rank is one int, the request's number
times ``_SPAN`` plus ``_SPAN - 1 - position``. The free blocks sit in a heap with lazy deletion:
O(log n) per push, pop and re-rank; admission and finish cost O(keys of the request).

Where this differs from vLLM 0.33's connector (``bench/conformance/native_policies.py`` drives both
with one event sequence and finds no difference in eviction order; these are what it leaves
out):

- The planner tells the queue of a request's keys once, at admission; vLLM's scheduler records
  them as the request's store batches reach them (a cached key past the request's computed
  tokens is re-ranked a few steps early here), and skips a key whose store by another request is
  still in flight.
- vLLM ranks a stored key by the request that stored it; here by the newest live request that
  holds it. They differ only when two live requests hold a key not yet cached and the older one
  stores it.
- vLLM shields the cached keys of the batch being stored from that batch's eviction; kvtriton's
  planner does not pin them (that is the planner's rule, not the queue's).
- A store the planner does not announce (a second tier's fetch into the CPU tier) is cached when
  its block is freed, not at its start.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from kvtriton.eviction.request_scoped import Lifetime, RequestScopedQueue

__all__ = ["RequestLRUQueue"]

#: Positions are below this many tokens: a rank is ``request * _SPAN + _SPAN - 1 - position``.
_SPAN = 1 << 40


class RequestLRUQueue(RequestScopedQueue):
    """Free blocks by the rank of their key, least first: vLLM 0.33's request-scoped LRU."""

    name = "reqlru"

    def reset(self, num_blocks: int) -> None:
        super().reset(num_blocks)
        self._rank: dict[int, int] = {}  # cached key -> rank
        self._stamp = [0] * num_blocks  # of a free block's live heap entry
        self._seq = 0
        self._heap: list[tuple[int, int, int, int]] = []  # (rank, key, block, stamp)

    def _new_rank(self) -> int:
        return self._newest_number() * _SPAN + _SPAN - 1

    def _enqueue(self, b: int, key: int) -> None:
        self._seq += 1
        self._stamp[b] = self._seq
        heapq.heappush(self._heap, (self._rank[key], key, b, self._seq))

    def _rerank(self, key: int, rank: int) -> None:
        self._rank[key] = rank
        for b in self._blocks[key]:
            if self._free[b]:
                self._enqueue(b, key)
        if len(self._heap) > 2 * self._num_free + 64:
            free, stamp = self._free, self._stamp
            self._heap = [e for e in self._heap if free[e[2]] and stamp[e[2]] == e[3]]
            heapq.heapify(self._heap)

    def rank_of(self, key: int) -> tuple[int, int] | None:
        """``(request or commit number, -position)`` of a cached key, vLLM's rank; None if no
        block holds it."""
        rank = self._rank.get(key)
        if rank is None:
            return None
        number, low = divmod(rank, _SPAN)
        return number, low - (_SPAN - 1)

    def _cached(self, key: int, storer: Lifetime | None, position: int, announced: bool) -> None:
        self._rank[key] = (storer.number * _SPAN + _SPAN - 1 - position if storer is not None
                           else self._new_rank())

    def _uncached(self, key: int, evicted: bool) -> None:
        del self._rank[key]

    def _freed(self, block_id: int, key: int) -> None:
        self._enqueue(block_id, key)

    def _victim(self) -> int:
        heap, free, stamp = self._heap, self._free, self._stamp
        while heap:
            _, _, b, s = heap[0]
            if free[b] and stamp[b] == s:
                return b
            heapq.heappop(heap)
        raise IndexError("pop from an empty queue")

    def _admitted(self, life: Lifetime) -> None:
        base = life.number * _SPAN + _SPAN - 1
        rank = self._rank
        for k, p in zip(life.keys, life.positions, strict=True):
            r = base - p
            if k in rank and rank[k] < r:
                self._rerank(k, r)

    def _finished(self, life: Lifetime, used: list[int]) -> None:
        rank = self._rank
        for k in reversed(used):
            r = self._new_rank()
            if k in rank:
                self._rerank(k, r)

    def _hashed_order(self) -> Iterator[int]:
        free, stamp = self._free, self._stamp
        for e in sorted(e for e in self._heap if free[e[2]] and stamp[e[2]] == e[3]):
            yield e[2]
