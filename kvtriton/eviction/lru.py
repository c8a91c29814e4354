"""LRU: vLLM's free queue, least recently freed first, kept in arrays.

The queue is a log of slots with lazy deletion: ``_slots[head:tail]`` holds block ids in
eviction order (next victim first), and a slot is live when its block's ``_pos`` points back
at it. Pushing a hashed block appends a slot at the tail, an unhashed one prepends a slot at the
head (vLLM puts bare blocks first), and removing a block only clears its ``_pos``: the dead slot
is skipped by the pops that reach it and dropped when the log is compacted. So a batch of n
pops, pushes or removes is a few array operations (``pop_many``, ``push_many``,
``remove_many``), where a linked list walks n nodes in Python.

Both arrays are ``array.array`` buffers with NumPy views over the same memory: one block's
push, pop or remove (the eviction wrappers' and the simulator's small calls) indexes the buffer
at Python-list speed, a batch goes through the views. Compaction rewrites the live slots into
the middle of the buffer (4 slots per block) when either end runs out of room, at most once per
``num_blocks`` slot writes, so it costs O(1) amortized per operation.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import numpy as np

from kvtriton.eviction.base import EvictionQueue

__all__ = ["LRUQueue"]


def _int_buffer(n: int, fill: int) -> tuple[array, np.ndarray]:
    """An ``array('i')`` of ``n`` copies of ``fill`` and a NumPy view of its memory."""
    buf = array("i", [fill]) * n
    return buf, np.frombuffer(buf, dtype=np.intc)


class LRUQueue(EvictionQueue):
    """Least recently freed first: vLLM's free queue. Unhashed blocks go to the head."""

    name = "lru"
    #: Up to this many pops, one at a time cost less than a window of array calls (tests set 0
    #: on an instance to pop every batch through the arrays).
    batch_min = 32

    def reset(self, num_blocks: int) -> None:
        self._n = num_blocks
        self._cap = 4 * num_blocks + 64
        self._slots, self._slots_np = _int_buffer(self._cap, 0)
        self._pos, self._pos_np = _int_buffer(num_blocks, -1)
        self._head = self._tail = self._cap // 2
        self._len = 0
        # Compactions so far: an iteration in progress cannot follow one.
        self._epoch = 0

    # ---- one block ---------------------------------------------------------------------------

    def push(self, block_id: int, key: int | None) -> None:
        if self._pos[block_id] >= 0:
            raise ValueError(f"LRUQueue.push: block {block_id} is already queued")
        if key is None:
            if self._head == 0:
                self._compact()
            h = self._head - 1
            self._head = h
        else:
            if self._tail == self._cap:
                self._compact()
            h = self._tail
            self._tail = h + 1
        self._slots[h] = block_id
        self._pos[block_id] = h
        self._len += 1

    def remove(self, block_id: int, reuse: bool = True) -> None:
        if self._pos[block_id] < 0:
            raise KeyError(block_id)
        self._pos[block_id] = -1
        self._len -= 1

    def pop(self) -> int:
        if not self._len:
            raise IndexError("pop from an empty queue")
        slots, pos = self._slots, self._pos
        h = self._head
        b = slots[h]
        while pos[b] != h:
            h += 1
            b = slots[h]
        pos[b] = -1
        self._head = h + 1
        self._len -= 1
        return b

    # ---- batches -----------------------------------------------------------------------------

    def pop_many(self, n: int) -> list[int] | np.ndarray:
        """The next ``n`` victims in order: an int64 array, or a list for a few (one pop each
        costs less than the array calls then)."""
        if n > self._len:
            raise IndexError(f"pop of {n} from a queue of {self._len}")
        if n <= self.batch_min:
            pop = self.pop
            return [pop() for _ in range(n)]
        slots, pos = self._slots_np, self._pos_np
        h, chunks, need = self._head, [], n
        while need:
            # Dead slots are few where pops keep pace with removes: a window a little wider
            # than what is needed usually holds it, else the next window continues.
            w = min(self._tail - h, need + (need >> 2) + 16)
            win = slots[h:h + w]
            live = np.flatnonzero(pos[win] == np.arange(h, h + w))
            if len(live) >= need:
                last = int(live[need - 1])
                chunks.append(win[live[:need]])
                h += last + 1
                need = 0
            else:
                chunks.append(win[live])
                h += w
                need -= len(live)
        out = (chunks[0] if len(chunks) == 1 else np.concatenate(chunks)).astype(np.int64)
        pos[out] = -1
        self._head = h
        self._len -= n
        return out

    def push_many(self, block_ids: np.ndarray, hashed: np.ndarray,
                  key_of: Sequence[int | None]) -> None:
        """``push`` of each block in order: the hashed ones appended at the tail in order, the
        unhashed ones put at the head one after the other (the last one first out)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if not len(ids):
            return
        if (self._pos_np[ids] >= 0).any():
            b = int(ids[self._pos_np[ids] >= 0][0])
            raise ValueError(f"LRUQueue.push_many: block {b} is already queued")
        hashed = np.asarray(hashed, dtype=bool)
        tail_ids = ids[hashed] if not hashed.all() else ids
        head_ids = ids[~hashed][::-1] if not hashed.all() else ids[:0]
        if self._tail + len(tail_ids) > self._cap or self._head < len(head_ids):
            self._compact()
        slots, pos = self._slots_np, self._pos_np
        if len(tail_ids):
            t = self._tail
            slots[t:t + len(tail_ids)] = tail_ids
            pos[tail_ids] = np.arange(t, t + len(tail_ids))
            self._tail = t + len(tail_ids)
        if len(head_ids):
            h = self._head - len(head_ids)
            slots[h:self._head] = head_ids
            pos[head_ids] = np.arange(h, self._head)
            self._head = h
        self._len += len(ids)

    def remove_many(self, block_ids: np.ndarray, reuse: bool = True) -> None:
        """``remove`` of each block (distinct, all queued; ``KeyError`` naming one that is not,
        and nothing removed)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if not len(ids):
            return
        at = self._pos_np[ids]
        if (at < 0).any():
            raise KeyError(int(ids[at < 0][0]))
        self._pos_np[ids] = -1
        self._len -= len(ids)

    def _compact(self) -> None:
        """Move the live slots, in order, to the middle of the buffer."""
        slots, pos = self._slots_np, self._pos_np
        h, t = self._head, self._tail
        seg = slots[h:t]
        live = seg[pos[seg] == np.arange(h, t)]
        k = len(live)
        start = (self._cap - k) // 2
        slots[start:start + k] = live
        pos[live] = np.arange(start, start + k)
        self._head, self._tail = start, start + k
        self._epoch += 1

    # ---- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return 0 <= block_id < self._n and self._pos[block_id] >= 0

    def iter_blocks(self, after: int | None = None) -> Iterator[int]:
        """Free blocks from the next victim on (past ``after`` when it is queued). Pops,
        pushes and removes may happen between the blocks yielded; a compaction may not
        (``RuntimeError``)."""
        start = self._head
        if after is not None and after in self:
            start = self._pos[after] + 1
        return self._iter_from(start)

    def _iter_from(self, i: int) -> Iterator[int]:
        slots, pos, epoch = self._slots, self._pos, self._epoch
        while True:
            if self._epoch != epoch:
                raise RuntimeError("LRUQueue: the queue was compacted during an iteration")
            if i >= self._tail:
                return
            b = slots[i]
            if pos[b] == i:
                yield b
            i += 1
