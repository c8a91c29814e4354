"""ARC (Megiddo & Modha, FAST'03) over the free blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtriton.eviction.base import FIRST, SECOND, GhostList, TwoListQueue

__all__ = ["ARCQueue"]


class ARCQueue(TwoListQueue):
    """Adaptive replacement (Megiddo & Modha, FAST'03) over the free blocks.

    T1 (``_first``) holds free blocks whose content has been used by one holder since it was
    cached; T2 (``_second``) those taken back by a hit (``remove``) at least once, which return
    to T2's MRU end when freed again. B1 and B2 are ghost lists of the keys of blocks evicted from
    T1 and T2, each bounded by the pool size. A freshly cached block whose key is in B1 raises the
    target size ``p`` of T1 by ``max(1, |B2| // |B1|)``; one in B2 lowers it by
    ``max(1, |B1| // |B2|)``; either way it enters T2, as in ARC (vLLM's ``ARCOffloadingManager``
    enters it in T1 and adapts on touch). ``pop`` takes T1's LRU block while ``|T1| > p`` (or T2
    is empty), else T2's LRU block.

    Only free blocks live here, so ``p`` steers the free part of the pool; referenced blocks are
    outside any list. Every operation is O(1); ``iter_blocks(after)`` finds ``after`` by walking.
    """

    name = "arc"

    def reset(self, num_blocks: int) -> None:
        super().reset(num_blocks)
        self._b1 = GhostList(self._cap)
        self._b2 = GhostList(self._cap)
        self.p = 0

    def _admit(self, block_id: int, key: int) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(self.p + max(1, len(b2) // len(b1)), self._cap)
            del b1[key]
            self._second.append(block_id)
        elif key in b2:
            self.p = max(self.p - max(1, len(b1) // len(b2)), 0)
            del b2[key]
            self._second.append(block_id)
        else:
            self._first.append(block_id)

    def _readmit(self, block_id: int) -> None:
        self._second.append(block_id)  # back from a hit by another request: used twice

    def _take_t1(self, n1: int, n2: int) -> bool:
        return n1 > 0 and (n1 > self.p or n2 == 0)

    def _evict(self) -> int:
        if self._take_t1(len(self._first), len(self._second)):
            b = self._first.popleft()
            self._left[b] = FIRST
        else:
            b = self._second.popleft()  # IndexError when every list is empty
            self._left[b] = SECOND
        return b

    def _ghost_of(self, left: int) -> GhostList:
        return self._b1 if left == FIRST else self._b2

    def _hashed_order(self) -> Iterator[int]:
        i1, i2 = iter(self._first), iter(self._second)
        n1, n2 = len(self._first), len(self._second)
        while n1 or n2:
            if self._take_t1(n1, n2):
                n1 -= 1
                yield next(i1)
            else:
                n2 -= 1
                yield next(i2)

    @property
    def ghost_sizes(self) -> tuple[int, int]:
        """``(|B1|, |B2|)``."""
        return len(self._b1), len(self._b2)

    def remembered_keys(self) -> Iterable[int]:
        return [*self._b1, *self._b2]
