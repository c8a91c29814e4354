"""Eviction queues: which free block a ``BlockPool`` hands out next.

A queue holds the pool's *free* blocks (ref count 0). The pool tells it when a block becomes
free (``push``, with the block's primary key or ``None`` if unhashed), when a free block is taken
back by a hit (``remove``; ``reuse=False`` when the taker is the one that took it last, such as a
waiting request whose lookup pins the same CPU hit every step), and when a victim's hashes are
dropped (``on_evicted``); ``pop`` picks the victim. Unhashed blocks hold nothing worth keeping, so
every queue hands them out first. Frequency-based queues (ARC, S3-FIFO) count only reuse: a
repeated touch puts the block back where it was, as vLLM's maintainers warn that one running
request's touches would otherwise fake frequency.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator

__all__ = [
    "EVICTION_QUEUES",
    "ARCQueue",
    "EvictionQueue",
    "LRUQueue",
    "S3FIFOQueue",
    "make_eviction_queue",
]


class EvictionQueue(ABC):
    """Interface of a free-block queue; see the module docstring for the protocol."""

    name = "base"

    @abstractmethod
    def reset(self, num_blocks: int) -> None:
        ...

    @abstractmethod
    def push(self, block_id: int, key: int | None) -> None:
        ...

    @abstractmethod
    def remove(self, block_id: int, reuse: bool = True) -> None:
        ...

    @abstractmethod
    def pop(self) -> int:
        ...

    @abstractmethod
    def __len__(self) -> int:
        ...

    @abstractmethod
    def __contains__(self, block_id: int) -> bool:
        ...

    @abstractmethod
    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        """Free blocks from the next victim on; starts past ``after`` when it is free."""
        ...

    def pop_many(self, n: int) -> list[int]:
        """The next ``n`` victims, in order (the caller checked that ``n`` are free)."""
        pop = self.pop
        return [pop() for _ in range(n)]

    def on_evicted(self, block_id: int, key: int) -> None:  # noqa: B027 - optional hook
        """The hashes of ``block_id`` (primary ``key``) are being dropped. Ghost lists use it.
        Policies without ghost state need nothing here."""

    def forget_block(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """``block_id`` was handed out by a queue wrapping this one, not by ``pop``: drop any
        per-block state (as ``pop`` would), so that its next push counts as a fresh block."""

    def note_reuse(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """``block_id``, held by a queue wrapping this one, was taken back by another user: when
        it returns here it counts as reused (frequency-based queues)."""

    def remembered_keys(self) -> Iterable[int]:
        """Keys of evicted blocks this queue still remembers (ghost lists): an owner of key ids
        must not hand these out to new hashes."""
        return ()


class _LinkedQueue:
    """Doubly-linked list over block ids in flat lists: O(1) push, remove and pop at both ends."""

    __slots__ = ("_in", "_len", "_n", "_next", "_prev")

    def __init__(self, num_blocks: int) -> None:
        s = num_blocks  # sentinel index
        self._n = num_blocks
        self._next = [s] * (num_blocks + 1)
        self._prev = [s] * (num_blocks + 1)
        self._in = bytearray(num_blocks)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, b: int) -> bool:
        return 0 <= b < self._n and self._in[b] == 1

    def append(self, b: int) -> None:
        s, nxt, prv = self._n, self._next, self._prev
        last = prv[s]
        nxt[last] = b
        prv[b] = last
        nxt[b] = s
        prv[s] = b
        self._in[b] = 1
        self._len += 1

    def appendleft(self, b: int) -> None:
        s, nxt, prv = self._n, self._next, self._prev
        first = nxt[s]
        prv[first] = b
        nxt[b] = first
        prv[b] = s
        nxt[s] = b
        self._in[b] = 1
        self._len += 1

    def remove(self, b: int) -> None:
        if not self._in[b]:
            raise KeyError(b)
        nxt, prv = self._next, self._prev
        p, q = prv[b], nxt[b]
        nxt[p] = q
        prv[q] = p
        self._in[b] = 0
        self._len -= 1

    def popleft(self) -> int:
        b = self._next[self._n]
        if b == self._n:
            raise IndexError("pop from an empty queue")
        self.remove(b)
        return b

    def popleft_many(self, n: int) -> list[int]:
        """Unlink the first ``n`` blocks in one walk."""
        if n > self._len:
            raise IndexError(f"pop of {n} from a queue of {self._len}")
        s, nxt, prv, inq = self._n, self._next, self._prev, self._in
        out = []
        b = nxt[s]
        for _ in range(n):
            out.append(b)
            inq[b] = 0
            b = nxt[b]
        nxt[s] = b
        prv[b] = s
        self._len -= n
        return out

    def first(self) -> int | None:
        b = self._next[self._n]
        return None if b == self._n else b

    def __iter__(self) -> Iterator[int]:
        return self.iter_from(self._next[self._n])

    def iter_from(self, b: int) -> Iterator[int]:
        s, nxt = self._n, self._next
        while b != s:
            following = nxt[b]
            yield b
            b = following

    def next_of(self, b: int) -> int:
        return self._next[b]


class LRUQueue(EvictionQueue):
    """Least recently freed first: vLLM's free queue. Unhashed blocks go to the head."""

    name = "lru"

    def reset(self, num_blocks: int) -> None:
        self._q = _LinkedQueue(num_blocks)

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._q.appendleft(block_id)
        else:
            self._q.append(block_id)

    def remove(self, block_id: int, reuse: bool = True) -> None:
        self._q.remove(block_id)

    def pop(self) -> int:
        return self._q.popleft()

    def pop_many(self, n: int) -> list[int]:
        return self._q.popleft_many(n)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._q

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self._q:
            return self._q.iter_from(self._q.next_of(after))
        return iter(self._q)


def _skip_past(order: Iterator[int], after: int) -> Iterator[int]:
    """``order`` from the block following ``after`` on (O(position of ``after``) to find it)."""
    for b in order:
        if b == after:
            break
    return order


def _remember(ghost: OrderedDict[int, None], key: int, limit: int) -> None:
    ghost[key] = None
    ghost.move_to_end(key)
    while len(ghost) > limit:
        ghost.popitem(last=False)


class ARCQueue(EvictionQueue):
    """Adaptive replacement (Megiddo & Modha, FAST'03) over the free blocks.

    T1 holds free blocks whose content has been used by one holder since it was cached; T2 those
    taken back by a hit (``remove``) at least once, which return to T2's MRU end when freed again.
    B1 and B2 are ghost lists of the keys of blocks evicted from T1 and T2, each bounded by the
    pool size. A freshly cached block whose key is in B1 raises the target size ``p`` of T1 by
    ``max(1, |B2| // |B1|)``; one in B2 lowers it by ``max(1, |B1| // |B2|)``; either way it
    enters T2, as in ARC (vLLM's ``ARCOffloadingManager`` enters it in T1 and adapts on touch).
    ``pop`` takes T1's LRU block while ``|T1| > p`` (or T2 is empty), else T2's LRU block.

    Only free blocks live here, so ``p`` steers the free part of the pool; referenced blocks are
    outside any list. Every operation is O(1); ``iter_blocks(after)`` finds ``after`` by walking.
    """

    name = "arc"

    def reset(self, num_blocks: int) -> None:
        self._cap = max(1, num_blocks - 1)
        self._unhashed = _LinkedQueue(num_blocks)
        self._t1 = _LinkedQueue(num_blocks)
        self._t2 = _LinkedQueue(num_blocks)
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self.p = 0
        # Per block: content not yet seen by a hashed push (handed out since), and the list it
        # last left (1: T1, 2: T2) so that ``on_evicted`` knows its ghost list.
        self._fresh = bytearray(b"\x01") * num_blocks
        self._left = bytearray(num_blocks)
        self._repeat = bytearray(num_blocks)  # taken back by its last taker: not reuse

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._fresh[block_id] = 1
            self._unhashed.appendleft(block_id)
            return
        if not self._fresh[block_id]:
            if self._repeat[block_id] and self._left[block_id] == 1:
                self._t1.append(block_id)
            else:
                self._t2.append(block_id)  # back from a hit by another request: used twice
            self._repeat[block_id] = 0
            return
        self._fresh[block_id] = 0
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(self.p + max(1, len(b2) // len(b1)), self._cap)
            del b1[key]
            self._t2.append(block_id)
        elif key in b2:
            self.p = max(self.p - max(1, len(b1) // len(b2)), 0)
            del b2[key]
            self._t2.append(block_id)
        else:
            self._t1.append(block_id)

    def remove(self, block_id: int, reuse: bool = True) -> None:
        if block_id in self._t1:
            self._t1.remove(block_id)
            self._left[block_id] = 1
        elif block_id in self._t2:
            self._t2.remove(block_id)
            self._left[block_id] = 2
        else:
            self._unhashed.remove(block_id)
        self._repeat[block_id] = not reuse

    def _take_t1(self, n1: int, n2: int) -> bool:
        return n1 > 0 and (n1 > self.p or n2 == 0)

    def pop(self) -> int:
        if len(self._unhashed):
            b = self._unhashed.popleft()
        elif self._take_t1(len(self._t1), len(self._t2)):
            b = self._t1.popleft()
            self._left[b] = 1
        else:
            b = self._t2.popleft()  # IndexError when every list is empty
            self._left[b] = 2
        self._fresh[b] = 1
        return b

    def on_evicted(self, block_id: int, key: int) -> None:
        ghost = self._b1 if self._left[block_id] == 1 else self._b2
        _remember(ghost, key, self._cap)
        self._fresh[block_id] = 1

    def forget_block(self, block_id: int) -> None:
        self._fresh[block_id] = 1
        self._repeat[block_id] = 0

    def note_reuse(self, block_id: int) -> None:
        self._repeat[block_id] = 0

    def __len__(self) -> int:
        return len(self._unhashed) + len(self._t1) + len(self._t2)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._unhashed or block_id in self._t1 or block_id in self._t2

    def _order(self) -> Iterator[int]:
        yield from self._unhashed
        i1, i2 = iter(self._t1), iter(self._t2)
        n1, n2 = len(self._t1), len(self._t2)
        while n1 or n2:
            if self._take_t1(n1, n2):
                n1 -= 1
                yield next(i1)
            else:
                n2 -= 1
                yield next(i2)

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self:
            return _skip_past(self._order(), after)
        return self._order()

    @property
    def ghost_sizes(self) -> tuple[int, int]:
        """``(|B1|, |B2|)``."""
        return len(self._b1), len(self._b2)

    def remembered_keys(self) -> Iterable[int]:
        return [*self._b1, *self._b2]


class S3FIFOQueue(EvictionQueue):
    """S3-FIFO (Yang et al., SOSP'23) over the free blocks: a small FIFO S, a main FIFO M, and a
    ghost FIFO G of keys evicted from S.

    A freshly cached block enters S, or M if its key is in G. A hit (``remove``) takes the block
    out; when freed again it returns to M's tail: from S that is S3-FIFO's promotion of a block
    used again, from M it also earns one more pass (frequency, at most 3). ``pop`` evicts S's
    head while S holds more than ``small_fraction`` of the pool (or M is empty), recording its key
    in G; otherwise M's head, which goes back to M's tail with its frequency lowered by one while
    that is positive (CLOCK-like reinsertion). O(1) amortized per operation: each reinsertion is
    paid for by an earlier hit.
    """

    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1) -> None:
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction!r}")
        self.small_fraction = small_fraction

    def reset(self, num_blocks: int) -> None:
        self._cap = max(1, num_blocks - 1)
        self._small_target = max(1, int(self._cap * self.small_fraction))
        self._unhashed = _LinkedQueue(num_blocks)
        self._small = _LinkedQueue(num_blocks)
        self._main = _LinkedQueue(num_blocks)
        self._ghost: OrderedDict[int, None] = OrderedDict()
        self._fresh = bytearray(b"\x01") * num_blocks
        self._freq = bytearray(num_blocks)
        self._left = bytearray(num_blocks)  # 1: left S, 2: left M
        self._repeat = bytearray(num_blocks)  # taken back by its last taker: not reuse

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._fresh[block_id] = 1
            self._unhashed.appendleft(block_id)
            return
        if not self._fresh[block_id]:
            if self._repeat[block_id]:
                self._repeat[block_id] = 0
                (self._small if self._left[block_id] == 1 else self._main).append(block_id)
                return
            if self._left[block_id] == 2:
                self._freq[block_id] = min(self._freq[block_id] + 1, 3)
            else:
                self._freq[block_id] = 0
            self._main.append(block_id)
            return
        self._fresh[block_id] = 0
        self._freq[block_id] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main.append(block_id)
        else:
            self._small.append(block_id)

    def remove(self, block_id: int, reuse: bool = True) -> None:
        if block_id in self._small:
            self._small.remove(block_id)
            self._left[block_id] = 1
        elif block_id in self._main:
            self._main.remove(block_id)
            self._left[block_id] = 2
        else:
            self._unhashed.remove(block_id)
        self._repeat[block_id] = not reuse

    def pop(self) -> int:
        if len(self._unhashed):
            b = self._unhashed.popleft()
        elif len(self._small) > self._small_target or not len(self._main):
            b = self._small.popleft()  # IndexError when every queue is empty
            self._left[b] = 1
        else:
            main, freq = self._main, self._freq
            b = main.popleft()
            while freq[b]:
                freq[b] -= 1
                main.append(b)
                b = main.popleft()
            self._left[b] = 2
        self._fresh[b] = 1
        return b

    def on_evicted(self, block_id: int, key: int) -> None:
        if self._left[block_id] == 1:
            _remember(self._ghost, key, self._cap)
        self._fresh[block_id] = 1

    def forget_block(self, block_id: int) -> None:
        self._fresh[block_id] = 1
        self._repeat[block_id] = 0

    def note_reuse(self, block_id: int) -> None:
        self._repeat[block_id] = 0

    def remembered_keys(self) -> Iterable[int]:
        return list(self._ghost)

    def __len__(self) -> int:
        return len(self._unhashed) + len(self._small) + len(self._main)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._unhashed or block_id in self._small or block_id in self._main

    def _order(self) -> Iterator[int]:
        yield from self._unhashed
        small = iter(self._small)
        for _ in range(len(self._small) - self._small_target):
            yield next(small)
        # Reinsertion keeps M's relative order, so M drains in passes by remaining frequency.
        freq = self._freq
        for level in range(4):
            yield from (b for b in self._main if freq[b] == level)
        yield from small

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self:
            return _skip_past(self._order(), after)
        return self._order()


EVICTION_QUEUES: dict[str, type[EvictionQueue]] = {
    "lru": LRUQueue,
    "arc": ARCQueue,
    "s3fifo": S3FIFOQueue,
}


def make_eviction_queue(name: str) -> EvictionQueue:
    """A fresh eviction queue by name (``lru`` and any registered in ``EVICTION_QUEUES``)."""
    try:
        return EVICTION_QUEUES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction {name!r}; known: {sorted(EVICTION_QUEUES)}") from None
