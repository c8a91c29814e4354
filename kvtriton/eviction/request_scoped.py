"""What the request-scoped queues share (``request_lru``: ``reqlru``; ``request_arc``:
``reqarc``; vLLM 0.33's offloading orders over the free blocks): ``RequestScopedQueue``, their
skeleton, and ``Lifetime``, a live request as they see it.

A key is cached from its store's start (``on_store_started``, as vLLM inserts it at
``prepare_store``) and attributed to the newest live request that holds it; each order is what
a subclass does with those events, an admission and a finish.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtriton.eviction.base import EvictionQueue, LinkedQueue, skip_past

__all__ = ["Lifetime", "RequestScopedQueue"]


@dataclass(slots=True, eq=False)
class Lifetime:
    """A live request: its number (its provisional rank), its keys head to tail (by position,
    then group) with their positions, the keys stored for it, and (ARC) the keys it found
    cached and ready at admission."""

    number: int
    keys: list[int]
    positions: list[int]
    inserted: set[int] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)


class RequestScopedQueue(EvictionQueue):
    """The skeleton of the request-scoped queues: unhashed blocks first, then the hashed free
    blocks in the order a subclass keeps by key.

    It keeps which key each block holds (from the store's start: the blocks handed out after
    ``on_store_started`` are bound to its keys in order), whether a block is free, which keys are
    cached and which of those are still being stored, and the live requests with their claims on
    keys. Subclasses say what a newly cached key, a dropped one, a freed block, an admission and a
    finish do to their order, and pick the victim."""

    observes_request_lifetimes = True

    def reset(self, num_blocks: int) -> None:
        self._n = num_blocks
        self._next = 0  # request and commit numbers
        self._unhashed = LinkedQueue(num_blocks)
        self._key: list[int | None] = [None] * num_blocks
        self._free = bytearray(num_blocks)  # free and hashed
        self._num_free = 0
        self._blocks: dict[int, list[int]] = {}  # cached key -> its blocks
        self._storing: set[int] = set()  # cached keys whose store has not completed
        self._requests: dict[str, Lifetime] = {}
        self._by_number: dict[int, Lifetime] = {}
        self._claims: dict[int, dict[int, int]] = {}  # key -> {request number: position}
        self._pending: list[int] = []  # keys of the store taking its blocks
        self._handed: list[int] = []  # blocks handed out since it started

    # ---- what subclasses decide --------------------------------------------------------------

    @abstractmethod
    def _cached(self, key: int, storer: Lifetime | None, position: int, announced: bool) -> None:
        """``key`` became cached, stored for ``storer`` at ``position`` (None: no live request
        holds it); ``announced``: its store named it in ``on_store_started``."""

    @abstractmethod
    def _uncached(self, key: int, evicted: bool) -> None:
        """``key`` left the cache: evicted by ``pop`` or dropped (a failed store, a block a
        wrapping queue handed out)."""

    def _freed(self, block_id: int, key: int) -> None:
        """``block_id``, holding ``key``, became free."""

    def _store_started(self, keys: list[int]) -> None:
        """A store of ``keys`` is about to take its blocks (before any eviction for it)."""

    @abstractmethod
    def _victim(self) -> int:
        """The next hashed free block to hand out, left in place (``IndexError`` if none)."""

    @abstractmethod
    def _admitted(self, life: Lifetime) -> None:
        """``life`` was admitted and holds its claims."""

    @abstractmethod
    def _finished(self, life: Lifetime, used: list[int]) -> None:
        """``life`` finished having used ``used`` (head to tail); its claims are still held."""

    @abstractmethod
    def _hashed_order(self) -> Iterator[int]:
        """The hashed free blocks in the order ``pop`` would take them."""

    # ---- keys and blocks ---------------------------------------------------------------------

    def _newest_number(self) -> int:
        self._next += 1
        return self._next

    def _bind(self, b: int, key: int, announced: bool) -> None:
        """``b`` holds ``key`` from now on."""
        self._unbind(b, evicted=False)
        self._key[b] = key
        blocks = self._blocks.get(key)
        if blocks is not None:
            blocks.append(b)
            return
        self._blocks[key] = [b]
        self._storing.add(key)
        claims = self._claims.get(key)
        if claims:
            number = max(claims)
            storer = self._by_number[number]
            storer.inserted.add(key)
            self._cached(key, storer, claims[number], announced)
        else:
            self._cached(key, None, 0, announced)

    def _unbind(self, b: int, evicted: bool) -> None:
        key = self._key[b]
        if key is None:
            return
        self._key[b] = None
        blocks = self._blocks[key]
        blocks.remove(b)
        if not blocks:
            del self._blocks[key]
            self._storing.discard(key)
            self._uncached(key, evicted)

    def _handed_out(self, b: int) -> None:
        if self._pending:
            self._handed.append(b)
            if len(self._handed) == len(self._pending):
                # All the store's evictions are done: its keys enter now, as vLLM inserts them.
                keys, blocks = self._pending, self._handed
                self._pending, self._handed = [], []
                for blk, key in zip(blocks, keys, strict=True):
                    self._bind(blk, key, announced=True)

    def on_store_started(self, keys: Sequence[int]) -> None:
        self._pending = [int(k) for k in keys]
        self._handed = []
        self._store_started(self._pending)

    def push(self, block_id: int, key: int | None) -> None:
        if block_id in self:
            raise ValueError(f"{type(self).__name__}.push: block {block_id} is already queued")
        if key is None:
            self._unbind(block_id, evicted=False)
            self._unhashed.appendleft(block_id)
            return
        if self._key[block_id] != key:
            self._bind(block_id, key, announced=False)
        self._storing.discard(key)
        self._free[block_id] = 1
        self._num_free += 1
        self._freed(block_id, key)

    def remove(self, block_id: int, reuse: bool = True) -> None:
        if self._free[block_id]:
            self._free[block_id] = 0
            self._num_free -= 1
        else:
            self._unhashed.remove(block_id)  # KeyError when not queued

    def pop(self) -> int:
        if len(self._unhashed):
            b = self._unhashed.popleft()
        else:
            b = self._victim()
            self._free[b] = 0
            self._num_free -= 1
            self._unbind(b, evicted=True)
        self._handed_out(b)
        return b

    def forget_block(self, block_id: int) -> None:
        self._unbind(block_id, evicted=False)
        self._handed_out(block_id)

    def __len__(self) -> int:
        return len(self._unhashed) + self._num_free

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < self._n and (self._free[block_id] == 1
                                            or block_id in self._unhashed)

    def _order(self) -> Iterator[int]:
        yield from list(self._unhashed)
        yield from self._hashed_order()

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        """Free blocks in pop order (a snapshot of the hashed ones)."""
        if after is not None and after in self:
            return skip_past(self._order(), after)
        return self._order()

    def remembered_keys(self) -> Iterable[int]:
        return [*self._claims, *self._pending]

    def is_cached(self, key: int) -> bool:
        """Whether a block holds ``key`` (from its store's start)."""
        return key in self._blocks

    # ---- request lifetimes -------------------------------------------------------------------

    def on_request_admitted(self, request_id: str, keys: np.ndarray,
                            positions: np.ndarray) -> None:
        if request_id in self._requests:
            return
        keys = np.asarray(keys, dtype=np.int64)
        positions = np.asarray(positions, dtype=np.int64)
        order = np.argsort(positions, kind="stable")
        keys, positions = keys[order], positions[order]
        _, first = np.unique(keys, return_index=True)  # a key repeated counts at its first place
        if len(first) < len(keys):
            first.sort()
            keys, positions = keys[first], positions[first]
        life = Lifetime(self._newest_number(), keys.tolist(), positions.tolist())
        self._requests[request_id] = life
        self._by_number[life.number] = life
        claims, number = self._claims, life.number
        for k, p in zip(life.keys, life.positions, strict=True):
            claims.setdefault(k, {})[number] = p
        self._admitted(life)

    def on_request_finished(self, request_id: str, num_tokens: int) -> None:
        life = self._requests.pop(request_id, None)
        if life is None:
            return
        used = sum(1 for p in life.positions if p <= num_tokens)  # positions ascend
        self._finished(life, life.keys[:used])
        del self._by_number[life.number]
        claims, number = self._claims, life.number
        for k in life.keys:
            mine = claims[k]
            del mine[number]
            if not mine:
                del claims[k]
