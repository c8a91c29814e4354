"""Continuation hints on a tier's eviction: protect what will be reused soon, drop what will not.

A request may end with a hint about its context (``kvtriton.records.HINTS``): ``continue``
(an agent turn that ended in a tool call: the next turn comes within seconds and extends this
context) or ``close`` (the client closed the session). ``HintedQueue`` wraps any eviction queue
and keeps two segments beside it: *drop* blocks (keys last held by a closed session), evicted
first, and *protected* blocks (keys of a turn hinted ``continue``), evicted last and bounded by a
share of the tier. Past it, a block of the oldest hint (``demote="oldest"``, the default: a
``continue`` hinted long ago is the least likely to come back soon) or of the newest
(``demote="newest"``: for a waiting-queue lookahead, whose newest arrival is admitted last)
returns to the wrapped queue, the deepest block of that hint's chain first: a hit needs a chain's
head, and a tail kept without its head serves nothing. Everything else is the wrapped queue's
business (any queue of ``kvtriton.eviction``), including whether a touch is reuse. The same
segments serve the waiting-queue lookahead and sessions (``kvtriton.tier_signals``): ``role``
names which, in the queue's name.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

import numpy as np

from kvtriton.eviction.base import EvictionQueue, LinkedQueue, skip_past

__all__ = ["CLOSED", "NORMAL", "PROTECTED", "HintedQueue"]

NORMAL, PROTECTED, CLOSED = 0, 1, 2

_BASE, _PROTECTED, _CLOSED, _UNHASHED = 0, 1, 2, 3


class HintedQueue(EvictionQueue):
    """``base`` plus the drop and protected segments; ``level`` of each key set by ``hint``.

    Pop order: unhashed blocks, drop blocks (oldest first), the wrapped queue's order, protected
    blocks (oldest first). ``protect_share``: the most of the pool protected blocks may hold;
    ``demote``: whose blocks a full protected segment lets go first, the oldest hint's or the
    newest's; ``role``: what protects (``hints``, ``waiting``, ``sessions``), for its name."""

    def __init__(self, base: EvictionQueue, protect_share: float,
                 demote: str = "oldest", role: str = "hints") -> None:
        if not 0.0 <= protect_share <= 1.0:
            raise ValueError(f"protect_share must be in [0, 1], got {protect_share!r}")
        if demote not in ("oldest", "newest"):
            raise ValueError(f"demote must be 'oldest' or 'newest', got {demote!r}")
        self.base = base
        self.protect_share = protect_share
        self._newest_first = demote == "newest"
        self.name = f"{base.name}+{role}"
        self._level = np.zeros(0, dtype=np.uint8)
        self._depth = np.zeros(0, dtype=np.int32)  # chain position of a key, from ``hint``
        self._epoch = np.zeros(0, dtype=np.int64)  # the ``hint`` call that protected a key
        self._hints = 0
        #: Blocks demoted from the protected segment because it was full (a count).
        self.protect_overflow = 0

    @property
    def observes_requests(self) -> bool:  # type: ignore[override]
        return self.base.observes_requests

    def on_request(self, keys: np.ndarray) -> None:
        self.base.on_request(keys)

    def reset(self, num_blocks: int) -> None:
        self.base.reset(num_blocks)
        self._unhashed = LinkedQueue(num_blocks)
        self._protected = LinkedQueue(num_blocks)
        self._closed = LinkedQueue(num_blocks)
        self._cap = int(self.protect_share * max(1, num_blocks - 1))
        self._where = bytearray(num_blocks)  # segment of a free block, or where it left from
        self._key = [-1] * num_blocks
        # Protected blocks by (hint rank, -depth, stamp): the first entry leaves when the segment
        # is full. An entry whose stamp is not its block's current one is stale.
        self._deepest: list[tuple[int, int, int, int]] = []
        self._stamp = [0] * num_blocks
        # A block's age in the segment (its stamp) is renewed only when it comes back fresh:
        # handed out and cached again, under another key, or after a real use. A request's own
        # repeated touch (reuse=False) or a hint moving it keeps the age, as the wrapped queues
        # put such a block back where it was. ``_heaped``: the stamp of the block's entry still
        # in the heap (0: none), so a block put back costs no push.
        self._fresh = [True] * num_blocks
        self._heaped = [0] * num_blocks
        self._clock = 0

    def level(self, key: int) -> int:
        return int(self._level[key]) if key < len(self._level) else NORMAL

    def _place(self, b: int, key: int) -> None:
        lv = self.level(key)
        if lv == CLOSED:
            self._closed.append(b)
            self._where[b] = _CLOSED
        elif lv == PROTECTED and self._cap > 0:
            self._protected.append(b)
            self._where[b] = _PROTECTED
            if self._fresh[b]:
                self._fresh[b] = False
                self._clock += 1
                self._stamp[b] = self._clock
            if self._heaped[b] != self._stamp[b]:
                self._heaped[b] = self._stamp[b]
                heapq.heappush(self._deepest, self._entry(b))
                if len(self._deepest) > 2 * len(self._protected) + 64:
                    self._rebuild_heap()
            if len(self._protected) > self._cap:
                old = self._pop_deepest()
                self.protect_overflow += 1
                self._where[old] = _BASE
                self.base.push(old, self._key[old])
        else:
            self._where[b] = _BASE
            self.base.push(b, key)

    def _entry(self, b: int) -> tuple[int, int, int, int]:
        key = self._key[b]
        known = 0 <= key < len(self._depth)
        epoch = int(self._epoch[key]) if known else 0
        depth = int(self._depth[key]) if known else 0
        return (-epoch if self._newest_first else epoch, -depth, self._stamp[b], b)

    def _pop_deepest(self) -> int:
        """Take the first protected block to demote out of its segment: of the oldest (or the
        newest) hint, the deepest in its chain, the oldest among equals."""
        heap, protected = self._deepest, self._protected
        while True:
            _, _, stamp, b = heapq.heappop(heap)
            if self._heaped[b] == stamp:
                self._heaped[b] = 0
            if stamp == self._stamp[b] and self._where[b] == _PROTECTED and b in protected:
                protected.remove(b)
                return b

    def _rebuild_heap(self) -> None:
        """Drop the entries of blocks that left the segment, so the heap stays bounded."""
        self._heaped = [0] * len(self._heaped)
        for p in self._protected:
            self._heaped[p] = self._stamp[p]
        self._deepest = [self._entry(p) for p in self._protected]
        heapq.heapify(self._deepest)

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._unhashed.appendleft(block_id)
            self._where[block_id] = _UNHASHED
            return
        if self._key[block_id] != key:
            self._fresh[block_id] = True
            self._heaped[block_id] = 0  # the old entry has the old key's depth
        self._key[block_id] = key
        self._place(block_id, key)

    def _segment(self, where: int) -> LinkedQueue:
        return {_PROTECTED: self._protected, _CLOSED: self._closed,
                _UNHASHED: self._unhashed}[where]

    def remove(self, block_id: int, reuse: bool = True) -> None:
        where = self._where[block_id]
        if reuse:
            self._fresh[block_id] = True  # a real use: it comes back younger
        if where == _BASE:
            self.base.remove(block_id, reuse)
        else:
            self._segment(where).remove(block_id)
            if reuse:
                self.base.note_reuse(block_id)

    def pop(self) -> int:
        b = self._take()
        self._fresh[b] = True  # handed out: whatever it holds next is new
        return b

    def _take(self) -> int:
        for seg, where in ((self._unhashed, _UNHASHED), (self._closed, _CLOSED)):
            if len(seg):
                b = seg.popleft()
                self._where[b] = where
                self.base.forget_block(b)
                return b
        if len(self.base):
            b = self.base.pop()
            self._where[b] = _BASE
            return b
        b = self._protected.popleft()  # IndexError when every segment is empty
        self._where[b] = _PROTECTED
        self.base.forget_block(b)
        return b

    def on_evicted(self, block_id: int, key: int) -> None:
        if self._where[block_id] == _BASE:
            self.base.on_evicted(block_id, key)

    def hint(self, keys: np.ndarray, level: int, free_block_of,
             depths: np.ndarray | None = None) -> None:
        """Set the level of ``keys`` (int array); ``free_block_of(key)`` names the free block
        holding a key (None if none is free), which moves to its new segment now. Protecting
        keys again renews them: they belong to this hint from now on. ``depths``: each key's
        position in its chain (0: the head), which decides what a full protected segment lets go
        within one hint; None leaves the depths as they were (0 if never given)."""
        keys = np.asarray(keys, dtype=np.int64)
        if not len(keys):
            return
        top = int(keys.max())
        if top >= len(self._level):
            size = max(2 * len(self._level), top + 1)
            self._level = np.concatenate([self._level,
                                          np.zeros(size - len(self._level), np.uint8)])
            self._depth = np.concatenate([self._depth,
                                          np.zeros(size - len(self._depth), np.int32)])
            self._epoch = np.concatenate([self._epoch,
                                          np.zeros(size - len(self._epoch), np.int64)])
        if depths is not None:
            self._depth[keys] = depths
        renewed = level == PROTECTED
        moved = keys if renewed else keys[self._level[keys] != level]
        if renewed:
            self._hints += 1
            self._epoch[keys] = self._hints
        self._level[keys] = level
        for k in moved.tolist():
            b = free_block_of(k)
            if b is None or b not in self or self._key[b] != k:
                continue
            self.remove(b, reuse=False)
            if renewed:
                self._fresh[b] = True  # this hint's block now: a new age, a new entry
            self._place(b, k)

    def let_go(self, keys: np.ndarray, free_block_of) -> None:
        """Protection over: the free blocks of ``keys`` go first now (the drop segment, where
        their age put them in a recency order: older than anything used since they were
        protected), and ``keys`` return to the plain order for any later free."""
        keys = np.asarray(keys, dtype=np.int64)
        if not len(keys):
            return
        self.hint(keys, CLOSED, free_block_of)
        self._level[keys] = NORMAL

    @property
    def last_hint(self) -> int:
        """The serial of the last ``hint`` that protected keys (the epoch it gave them)."""
        return self._hints

    def clear_epochs(self, keys: np.ndarray) -> None:
        """``keys`` name other blocks now (recycled ids): no earlier hint protected them."""
        keys = np.asarray(keys, dtype=np.int64)
        self._epoch[keys[keys < len(self._epoch)]] = 0

    def epochs(self, keys: np.ndarray) -> np.ndarray:
        """The serial of the ``hint`` that last protected each key (0: never)."""
        out = np.zeros(len(keys), dtype=np.int64)
        inside = keys < len(self._epoch)
        out[inside] = self._epoch[keys[inside]]
        return out

    def __len__(self) -> int:
        return len(self._unhashed) + len(self._closed) + len(self.base) + len(self._protected)

    def __contains__(self, block_id: int) -> bool:
        return (block_id in self._unhashed or block_id in self._closed
                or block_id in self.base or block_id in self._protected)

    def _order(self) -> Iterator[int]:
        yield from self._unhashed
        yield from self._closed
        yield from self.base.iter_blocks()
        yield from self._protected

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self:
            return skip_past(self._order(), after)
        return self._order()

    def remembered_keys(self) -> Iterable[int]:
        return self.base.remembered_keys()

    @property
    def protected_blocks(self) -> int:
        return len(self._protected)

    @property
    def protect_capacity(self) -> int:
        """The most blocks the protected segment holds (0 before ``reset`` sizes the pool)."""
        return getattr(self, "_cap", 0)
