"""Eviction policies: which free block a ``BlockPool`` hands out next.

A policy holds the pool's *free* blocks (ref count 0). The pool tells it when a block becomes
free (``push``, with the block's primary key or ``None`` if unhashed), when a free block is taken
back by a hit (``remove``), and when a victim's hashes are dropped (``on_evicted``); ``pop`` picks
the victim. Unhashed blocks hold nothing worth keeping, so every policy hands them out first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

__all__ = ["POLICIES", "EvictionPolicy", "LRUPolicy", "make_policy"]


class EvictionPolicy(ABC):
    """Interface of a free-block queue; see the module docstring for the protocol."""

    name = "base"

    @abstractmethod
    def reset(self, num_blocks: int) -> None:
        ...

    @abstractmethod
    def push(self, block_id: int, key: int | None) -> None:
        ...

    @abstractmethod
    def remove(self, block_id: int) -> None:
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

    def on_evicted(self, block_id: int, key: int) -> None:
        """The hashes of ``block_id`` (primary ``key``) are being dropped. Ghost lists use it."""


class _LinkedQueue:
    """Doubly-linked list over block ids in flat lists: O(1) push, remove and pop at both ends."""

    __slots__ = ("_n", "_next", "_prev", "_in", "_len")

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


class LRUPolicy(EvictionPolicy):
    """Least recently freed first: vLLM's free queue. Unhashed blocks go to the head."""

    name = "lru"

    def reset(self, num_blocks: int) -> None:
        self._q = _LinkedQueue(num_blocks)

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._q.appendleft(block_id)
        else:
            self._q.append(block_id)

    def remove(self, block_id: int) -> None:
        self._q.remove(block_id)

    def pop(self) -> int:
        return self._q.popleft()

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._q

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self._q:
            return self._q.iter_from(self._q.next_of(after))
        return iter(self._q)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name (``lru`` and any registered in ``POLICIES``)."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
