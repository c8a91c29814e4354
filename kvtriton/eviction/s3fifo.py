"""S3-FIFO (Yang et al., SOSP'23) over the free blocks."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvtriton.eviction.base import FIRST, SECOND, GhostList, TwoListQueue

__all__ = ["S3FIFOQueue"]


class S3FIFOQueue(TwoListQueue):
    """S3-FIFO (Yang et al., SOSP'23) over the free blocks: a small FIFO S (``_first``), a main
    FIFO M (``_second``), and a ghost FIFO G of keys evicted from S.

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
        super().reset(num_blocks)
        self._small_target = max(1, int(self._cap * self.small_fraction))
        self._ghost = GhostList(self._cap)
        self._freq = bytearray(num_blocks)

    def _admit(self, block_id: int, key: int) -> None:
        self._freq[block_id] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._second.append(block_id)
        else:
            self._first.append(block_id)

    def _readmit(self, block_id: int) -> None:
        if self._left[block_id] == SECOND:
            self._freq[block_id] = min(self._freq[block_id] + 1, 3)
        else:
            self._freq[block_id] = 0
        self._second.append(block_id)

    def _evict(self) -> int:
        if len(self._first) > self._small_target or not len(self._second):
            b = self._first.popleft()  # IndexError when every queue is empty
            self._left[b] = FIRST
            return b
        main, freq = self._second, self._freq
        b = main.popleft()
        while freq[b]:
            freq[b] -= 1
            main.append(b)
            b = main.popleft()
        self._left[b] = SECOND
        return b

    def _ghost_of(self, left: int) -> GhostList | None:
        return self._ghost if left == FIRST else None

    def remembered_keys(self) -> Iterable[int]:
        return list(self._ghost)

    def _hashed_order(self) -> Iterator[int]:
        small = iter(self._first)
        for _ in range(len(self._first) - self._small_target):
            yield next(small)
        # Reinsertion keeps M's relative order, so M drains in passes by remaining frequency.
        freq = self._freq
        for level in range(4):
            yield from (b for b in self._second if freq[b] == level)
        yield from small
