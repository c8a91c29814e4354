"""The eviction-queue protocol and the building blocks its queues share.

A queue holds the pool's *free* blocks (ref count 0). The pool tells it when a block becomes
free (``push``, with the block's primary key or ``None`` if unhashed), when a free block is taken
back by a hit (``remove``; ``reuse=False`` when the taker is the one that took it last, such as a
waiting request whose lookup pins the same CPU hit every step), and when a victim's hashes are
dropped (``on_evicted``); ``pop`` picks the victim. Unhashed blocks hold nothing worth keeping,
so every queue hands them out first. Frequency-based queues (ARC, S3-FIFO) count only reuse: a
repeated touch puts the block back where it was, since one running request's touches would
otherwise count as many accesses (vLLM counts once per request for the same reason: the review
of vLLM PR #41727, and PR #51787). A queue that sets ``observes_requests`` is also told of every
request the planner admits (``on_request``, its distinct keys), demand the pool never sees. A
queue that sets ``observes_request_lifetimes`` orders blocks by the requests that use them, as
vLLM 0.33's offloading policies do: the planner tells it when a request is admitted (its keys and
their positions), when it finishes, and which keys a store is about to take blocks for
(``on_request_admitted``, ``on_request_finished``, ``on_store_started``), reaching it through any
wrapping queue with ``request_observer``.

Building blocks: ``LinkedQueue`` (O(1) linked list over block ids), ``skip_past`` (an order from
a given block on), ``GhostList`` (bounded keys of evicted blocks) and ``TwoListQueue`` (the
skeleton ARC and S3-FIFO share: two lists of hashed free blocks behind the unhashed ones).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

__all__ = ["FIRST", "SECOND", "EvictionQueue", "GhostList", "LinkedQueue", "TwoListQueue",
           "request_observer", "skip_past"]


class EvictionQueue(ABC):
    """Interface of a free-block queue; see the module docstring for the protocol."""

    name = "base"
    #: Whether the queue learns from the requests a server admits (``on_request``); the planner
    #: computes a request's distinct keys only for such queues.
    observes_requests = False
    #: Whether the queue orders blocks by the requests that use them (``on_request_admitted``,
    #: ``on_request_finished``, ``on_store_started``); the planner calls those only then.
    observes_request_lifetimes = False

    @abstractmethod
    def reset(self, num_blocks: int) -> None:
        ...

    def memory_bytes(self, num_blocks: int) -> int:
        """Host bytes ``reset(num_blocks)`` allocates beyond a few words per block (LFU's
        sketch; 0 here): what the host-memory checks at start-up count before building it."""
        return 0

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

    def pop_many(self, n: int) -> list[int] | np.ndarray:
        """The next ``n`` victims, in order (the caller checked that ``n`` are free); a list,
        or an int64 array from a queue that pops in arrays."""
        pop = self.pop
        return [pop() for _ in range(n)]

    def push_many(self, block_ids: np.ndarray, hashed: np.ndarray,
                  key_of: Sequence[int | None]) -> None:
        """``push(b, key_of[b])`` for each of ``block_ids`` in order (``hashed[i]``: whether
        ``key_of[block_ids[i]]`` is a key, for a queue that needs no more than that)."""
        push = self.push
        for b in block_ids.tolist():
            push(b, key_of[b])

    def remove_many(self, block_ids: np.ndarray, reuse: bool = True) -> None:
        """``remove(b, reuse)`` for each of ``block_ids`` (distinct, all queued)."""
        remove = self.remove
        for b in block_ids.tolist():
            remove(b, reuse)

    def on_evicted(self, block_id: int, key: int) -> None:  # noqa: B027 - optional hook
        """The hashes of ``block_id`` (primary ``key``) are being dropped. Ghost lists use it.
        Setups without ghost state need nothing here."""

    def forget_block(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """``block_id`` was handed out by a queue wrapping this one, not by ``pop``: drop any
        per-block state (as ``pop`` would), so that its next push counts as a fresh block."""

    def note_reuse(self, block_id: int) -> None:  # noqa: B027 - optional hook
        """``block_id``, held by a queue wrapping this one, was taken back by another user: when
        it returns here it counts as reused (frequency-based queues)."""

    def on_request(self, keys: np.ndarray) -> None:  # noqa: B027 - optional hook
        """A request holding ``keys`` (its distinct primary keys, an int64 array) was admitted:
        demand the pool's own hits do not show (a GPU prefix hit never touches the CPU tier).
        Called only when ``observes_requests`` is set."""

    def remembered_keys(self) -> Iterable[int]:
        """Keys of evicted blocks this queue still remembers (ghost lists): an owner of key ids
        must not hand these out to new hashes."""
        return ()

    def on_request_admitted(self, request_id: str, keys: np.ndarray,  # noqa: B027 - optional
                            positions: np.ndarray) -> None:
        """``request_id`` was admitted (once: not again when it resumes after a preemption).
        ``keys``: its primary keys, every positional group's, group after group and head to tail
        within one; ``positions``: the token each key's block ends at (int64 arrays of one
        length). Called only when ``observes_request_lifetimes`` is set."""

    def on_request_finished(self, request_id: str,  # noqa: B027 - optional hook
                            num_tokens: int) -> None:
        """``request_id`` finished or was aborted with ``num_tokens`` computed (its keys up to
        that position are those it used), after its finish flush took its CPU blocks."""

    def on_store_started(self, keys: Sequence[int]) -> None:  # noqa: B027 - optional hook
        """A store of ``keys`` is taking its CPU blocks: the next ``len(keys)`` blocks handed
        out (by ``pop``, or by a wrapping queue: ``forget_block``) will hold them in this order
        once it completes; a block pushed back unhashed instead means its store failed."""


def request_observer(queue: EvictionQueue) -> EvictionQueue | None:
    """The queue to tell of request lifetimes: ``queue``, or the queue a wrapping queue keeps as
    ``base`` (``HintedQueue``), whichever sets ``observes_request_lifetimes``; None if none."""
    while not queue.observes_request_lifetimes:
        queue = getattr(queue, "base", None)
        if not isinstance(queue, EvictionQueue):
            return None
    return queue


class LinkedQueue:
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



def skip_past(order: Iterator[int], after: int) -> Iterator[int]:
    """``order`` from the block following ``after`` on (O(position of ``after``) to find it)."""
    for b in order:
        if b == after:
            break
    return order


class GhostList(OrderedDict[int, None]):
    """Keys of evicted blocks, oldest first, at most ``limit`` of them: ``remember`` adds one
    (or renews it) and drops the oldest past the limit. Membership and ``del`` are a dict's."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, key: int) -> None:
        self[key] = None
        self.move_to_end(key)
        while len(self) > self.limit:
            self.popitem(last=False)

    def __reduce__(self):
        # Copies and pickles (a queue is deep-copied to look ahead) rebuild it with its limit.
        return type(self), (self.limit,), None, None, iter(self.items())


#: The list a block last left (``TwoListQueue._left``); 0: neither since it was created.
FIRST, SECOND = 1, 2


class TwoListQueue(EvictionQueue):
    """The skeleton of ARC and S3-FIFO: unhashed blocks first, then two lists of hashed free
    blocks. ``_first`` holds blocks cached once (ARC's T1, S3-FIFO's small FIFO S); ``_second``
    blocks used again or recalled by a ghost list (ARC's T2, S3-FIFO's main FIFO M).

    Per block it keeps whether its content is fresh (not yet seen by a hashed push since it was
    handed out or evicted), the list it last left (``FIRST`` or ``SECOND``) and whether its last
    taker took it back without reuse. A block taken back by its last taker returns to the list
    it left; a fresh one enters where ``_admit`` says, a reused one where ``_readmit`` says.
    Subclasses also choose the next hashed victim (``_evict``, which records the list it left),
    the ghost list an evicted key joins (``_ghost_of``) and the hashed order (``_hashed_order``).
    """

    def reset(self, num_blocks: int) -> None:
        self._cap = max(1, num_blocks - 1)
        self._unhashed = LinkedQueue(num_blocks)
        self._first = LinkedQueue(num_blocks)
        self._second = LinkedQueue(num_blocks)
        self._fresh = bytearray(b"\x01") * num_blocks
        self._left = bytearray(num_blocks)
        self._repeat = bytearray(num_blocks)  # taken back by its last taker: not reuse

    @abstractmethod
    def _admit(self, block_id: int, key: int) -> None:
        """Append a block whose content is new to one of the lists."""

    @abstractmethod
    def _readmit(self, block_id: int) -> None:
        """Append a block taken back by another user (a reuse) to one of the lists."""

    @abstractmethod
    def _evict(self) -> int:
        """Unlink the next hashed victim, recording the list it left (``IndexError`` if none)."""

    @abstractmethod
    def _ghost_of(self, left: int) -> GhostList | None:
        """The ghost list the key of a block evicted from list ``left`` joins (None: none)."""

    @abstractmethod
    def _hashed_order(self) -> Iterator[int]:
        """The hashed free blocks in the order ``pop`` would take them."""

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._fresh[block_id] = 1
            self._unhashed.appendleft(block_id)
        elif self._fresh[block_id]:
            self._fresh[block_id] = 0
            self._admit(block_id, key)
        elif self._repeat[block_id]:
            self._repeat[block_id] = 0
            (self._first if self._left[block_id] == FIRST else self._second).append(block_id)
        else:
            self._readmit(block_id)

    def remove(self, block_id: int, reuse: bool = True) -> None:
        if block_id in self._first:
            self._first.remove(block_id)
            self._left[block_id] = FIRST
        elif block_id in self._second:
            self._second.remove(block_id)
            self._left[block_id] = SECOND
        else:
            self._unhashed.remove(block_id)
        self._repeat[block_id] = not reuse

    def pop(self) -> int:
        b = self._unhashed.popleft() if len(self._unhashed) else self._evict()
        self._fresh[b] = 1
        return b

    def on_evicted(self, block_id: int, key: int) -> None:
        ghost = self._ghost_of(self._left[block_id])
        if ghost is not None:
            ghost.remember(key)
        self._fresh[block_id] = 1

    def forget_block(self, block_id: int) -> None:
        self._fresh[block_id] = 1
        self._repeat[block_id] = 0

    def note_reuse(self, block_id: int) -> None:
        self._repeat[block_id] = 0

    def __len__(self) -> int:
        return len(self._unhashed) + len(self._first) + len(self._second)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._unhashed or block_id in self._first or block_id in self._second

    def _order(self) -> Iterator[int]:
        yield from self._unhashed
        yield from self._hashed_order()

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        if after is not None and after in self:
            return skip_past(self._order(), after)
        return self._order()
