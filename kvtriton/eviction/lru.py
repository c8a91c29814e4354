"""LRU: vLLM's free queue, least recently freed first."""

from __future__ import annotations

from collections.abc import Iterator

from kvtriton.eviction.base import EvictionQueue, LinkedQueue

__all__ = ["LRUQueue"]


class LRUQueue(EvictionQueue):
    """Least recently freed first: vLLM's free queue. Unhashed blocks go to the head."""

    name = "lru"

    def reset(self, num_blocks: int) -> None:
        self._q = LinkedQueue(num_blocks)

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
