"""Request-scoped ARC: the eviction order of vLLM 0.33's offloading connector with its ARC policy
(``ARCCachePolicy``), over the free blocks.

It differs from ``arc`` (kvtriton's ARC over the free queue) in what counts as a second use and
when it counts, which a study sees:

- A use is a request's, counted once, at its finish: every key a request found cached and ready
  when it was admitted (a CPU hit, and a GPU prefix hit the CPU also holds) moves from T1 to T2's
  MRU end, or to T2's MRU end, tail first, so the head ends newest. ``arc`` counts only a CPU
  hit by another request, when its block is freed again, and never a GPU prefix hit.
- A key stored for a request stays in T1; at that request's finish it moves to the MRU end of
  its list, tail first.
- A key comes back from a ghost list into T1 (adapting the target first, before the store's
  evictions, by ``max(1, |B2| / |B1|)`` or ``max(1, |B1| / |B2|)`` as a float); ``arc`` puts it
  in T2 and adapts after.
- T1 and T2 hold every cached key, held or free, in flight or not; taking a block back and
  freeing it moves nothing. The victim comes from T1 while ``|T1| >= int(target)`` (``arc``:
  free T1 blocks ``> p``), its first evictable key from the LRU end; else from T2; else T1.
- An evicted key joins B1 or B2, each bounded by the pool's size. A key dropped otherwise (a
  failed store, a block a wrapping queue handed out) joins neither.

Keys are cached from their store's start and attributed to the newest live request that holds
them, as in ``request_lru``, whose docstring lists what the planner's calls leave out of vLLM's
connector; ``bench/conformance/native_policies.py`` drives this queue and vLLM's class with one
event sequence and compares their evictions. Finding a T1 or T2 victim walks past held keys at the
LRU end; a key cached in two blocks (the CPU tier never does) leaves its list with its last block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kvtriton.eviction.base import GhostList
from kvtriton.eviction.request_scoped import Lifetime, RequestScopedQueue

__all__ = ["RequestARCQueue"]


class RequestARCQueue(RequestScopedQueue):
    """vLLM 0.33's request-scoped ARC over the free blocks (see the module docstring)."""

    name = "reqarc"

    def reset(self, num_blocks: int) -> None:
        super().reset(num_blocks)
        self._cap = max(1, num_blocks - 1)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1 = GhostList(self._cap)
        self._b2 = GhostList(self._cap)
        #: The target size of T1 (a float, as vLLM's).
        self.target = 0.0

    @property
    def ghost_sizes(self) -> tuple[int, int]:
        """``(|B1|, |B2|)``."""
        return len(self._b1), len(self._b2)

    def lists(self) -> tuple[list[int], list[int]]:
        """T1's and T2's keys, LRU end first."""
        return list(self._t1), list(self._t2)

    def _adapt(self, key: int) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.target = min(self.target + max(1, len(b2) / len(b1)), self._cap)
            b1.move_to_end(key)
        elif key in b2:
            self.target = max(self.target - max(1, len(b1) / len(b2)), 0)
            b2.move_to_end(key)

    def _store_started(self, keys: list[int]) -> None:
        for key in reversed(keys):
            self._adapt(key)

    def _cached(self, key: int, storer: Lifetime | None, position: int, announced: bool) -> None:
        if not announced:
            self._adapt(key)
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def _uncached(self, key: int, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1.remember(key)
        else:
            del self._t2[key]
            if evicted:
                self._b2.remember(key)

    def _free_block(self, key: int) -> int | None:
        free = self._free
        for b in self._blocks[key]:
            if free[b]:
                return b
        return None

    def _first_free(self, keys: Iterable[int]) -> int | None:
        for key in keys:
            b = self._free_block(key)
            if b is not None:
                return b
        return None

    def _victim(self) -> int:
        b = None
        if len(self._t1) >= int(self.target):
            b = self._first_free(self._t1)
        if b is None:
            b = self._first_free(self._t2)
        if b is None:
            b = self._first_free(self._t1)
        if b is None:
            raise IndexError("pop from an empty queue")
        return b

    def _admitted(self, life: Lifetime) -> None:
        storing = self._storing
        life.reused = {k for k in life.keys if k in self._blocks and k not in storing}

    def _finished(self, life: Lifetime, used: list[int]) -> None:
        t1, t2 = self._t1, self._t2
        for k in reversed(used):
            if k in life.reused:
                if k in t1:
                    del t1[k]
                    t2[k] = None
                elif k in t2:
                    t2.move_to_end(k)
            elif k in life.inserted:
                if k in t1:
                    t1.move_to_end(k)
                elif k in t2:
                    t2.move_to_end(k)

    def _hashed_order(self) -> Iterator[int]:
        """The pops to come: the victim rule replayed on T1's size and both lists' free blocks
        (a key leaves its list, and T1's size, with its last block)."""
        free = self._free

        def flat(keys: Iterable[int]) -> list[tuple[int, bool]]:
            out = []
            for k in keys:
                blocks = self._blocks[k]
                mine = [b for b in blocks if free[b]]
                out += [(b, len(mine) == len(blocks) and i == len(mine) - 1)
                        for i, b in enumerate(mine)]
            return out

        t1, t2 = flat(self._t1), flat(self._t2)
        n1, target = len(self._t1), int(self.target)
        i1 = i2 = 0
        while i1 < len(t1) or i2 < len(t2):
            if (n1 >= target and i1 < len(t1)) or i2 == len(t2):
                b, last = t1[i1]
                i1 += 1
                n1 -= last
            else:
                b, _ = t2[i2]
                i2 += 1
            yield b

    def remembered_keys(self) -> Iterable[int]:
        return [*super().remembered_keys(), *self._b1, *self._b2]
