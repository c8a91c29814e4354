"""``NextUse`` (next use of every key in trace order) and ``NextUseQueue`` (the oracle eviction
queue built on it), each against a plain-loop reference, and the queue inside a ``BlockPool``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.pool import BlockPool
from kvtriton.sim.next_use import NextUse, NextUseQueue

EXAMPLES = max(100, settings.default.max_examples)


def ref_next(keys: list[list[int]], consumed: set[int], n_keys: int) -> list[int]:
    """The contract, as a loop: past the last consumed holder, the first holder (or never)."""
    never = len(keys)
    out = []
    for k in range(n_keys):
        c = max((i for i in consumed if k in keys[i]), default=-1)
        out.append(next((j for j in range(c + 1, len(keys)) if k in keys[j]), never))
    return out


@st.composite
def workloads(draw, max_requests: int = 8, max_keys: int = 6):
    n_keys = draw(st.integers(1, max_keys))
    n_req = draw(st.integers(0, max_requests))
    keys = [draw(st.lists(st.integers(0, n_keys - 1), max_size=6)) for _ in range(n_req)]
    return keys, n_keys


def as_arrays(keys: list[list[int]], shapes: list[bool]) -> list[np.ndarray]:
    """The requests' key arrays; ``NextUse`` takes any shape, so some are made 2-D."""
    out = []
    for ks, two_d in zip(keys, shapes, strict=True):
        a = np.array(ks, dtype=np.int64)
        if two_d and len(a) % 2 == 0 and len(a):
            a = a.reshape(2, -1)
        out.append(a)
    return out


# ---- NextUse -------------------------------------------------------------------------------


@settings(max_examples=EXAMPLES)
@given(data=st.data(), wl=workloads())
def test_next_use_matches_reference(data, wl):
    keys, n_keys = wl
    shapes = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
    nu = NextUse(as_arrays(keys, shapes), n_keys)
    calls: list[np.ndarray] = []
    nu.add_listener(calls.append)
    seen: list[np.ndarray] = []
    nu.add_listener(seen.append)  # every listener is called
    assert nu.never == len(keys)
    consumed: set[int] = set()
    assert nu.next.tolist() == ref_next(keys, consumed, n_keys)
    order = data.draw(st.lists(st.integers(0, len(keys) - 1), max_size=12)) if keys else []
    for i in order:  # out of order, with repeats (a repeat is a no-op)
        before = nu.next.tolist()
        consumed.add(i)
        nu.consume(i)
        want = ref_next(keys, consumed, n_keys)
        assert nu.next.tolist() == want, (keys, order, i)
        changed = {k for k in range(n_keys) if before[k] != want[k]}
        if changed:
            assert len(calls) == 1 and len(seen) == 1
            got = calls.pop().tolist()
            assert sorted(got) == sorted(changed)  # exactly the changed keys, each once
            assert seen.pop().tolist() == got
        else:
            assert not calls and not seen  # nothing moved: no call
        assert nu.next.dtype == np.int64


def test_next_use_small_example():
    nu = NextUse([np.array([0, 1]), np.array([1, 1]), np.array([], dtype=np.int64),
                  np.array([[0], [2]])], 4)
    assert nu.next.tolist() == [0, 0, 3, 4]  # key 3 is never held
    changes = []
    nu.add_listener(lambda ks: changes.append(sorted(ks.tolist())))
    nu.consume(3)  # out of order: past request 3, keys 0 and 2 are never held again
    assert nu.next.tolist() == [4, 0, 4, 4] and changes == [[0, 2]]
    nu.consume(0)  # key 0's last consumed holder is 3, still: unchanged; key 1 moves to 1
    assert nu.next.tolist() == [4, 1, 4, 4] and changes[-1] == [1]
    nu.consume(0)
    nu.consume(2)  # holds nothing
    assert len(changes) == 2
    nu.consume(1)
    assert nu.next.tolist() == [4, 4, 4, 4] and changes[-1] == [1]


def test_next_use_empty_workload():
    nu = NextUse([], 3)
    assert nu.never == 0 and nu.next.tolist() == [0, 0, 0]


# ---- NextUseQueue against a reference ------------------------------------------------------


class RefQueue:
    """Free blocks as a plain list: unhashed first (most recently pushed first), then the
    largest next use, ties to the earliest push."""

    def __init__(self, nu: NextUse) -> None:
        self.nu = nu
        self.items: list[tuple[int, int | None, int]] = []  # (block, key, push order)
        self.clock = 0

    def push(self, b: int, key: int | None) -> None:
        self.clock += 1
        self.items.append((b, key, self.clock))

    def remove(self, b: int) -> None:
        self.items = [e for e in self.items if e[0] != b]

    def order(self) -> list[int]:
        unhashed = sorted((e for e in self.items if e[1] is None), key=lambda e: -e[2])
        hashed = sorted((e for e in self.items if e[1] is not None),
                        key=lambda e: (-int(self.nu.next[e[1]]), e[2]))
        return [e[0] for e in unhashed + hashed]

    def pop(self) -> int:
        b = self.order()[0]
        self.remove(b)
        return b


def check_same(q: NextUseQueue, ref: RefQueue, num_blocks: int, after: int) -> None:
    order = ref.order()
    assert list(q.iter_blocks()) == order
    assert len(q) == len(order)
    for b in range(num_blocks):
        assert (b in q) == (b in order), b
    want_after = order[order.index(after) + 1:] if after in order else order
    assert list(q.iter_blocks(after)) == want_after


@settings(max_examples=EXAMPLES)
@given(data=st.data(), wl=workloads(max_requests=6, max_keys=5),
       num_blocks=st.integers(1, 7))
def test_next_use_queue_matches_reference(data, wl, num_blocks):
    keys, n_keys = wl
    nu = NextUse([np.array(k, dtype=np.int64) for k in keys], n_keys)
    q = NextUseQueue(nu)
    q.reset(num_blocks)
    ref = RefQueue(nu)
    ops = data.draw(st.lists(st.sampled_from(["push", "push", "remove", "pop", "consume"]),
                             max_size=40))
    for op in ops:
        free = ref.order()
        out = [b for b in range(num_blocks) if b not in free]
        if op == "push" and out:
            b = data.draw(st.sampled_from(out))
            key = data.draw(st.none() | st.integers(0, n_keys - 1))
            q.push(b, key)
            ref.push(b, key)
        elif op == "remove" and free:
            b = data.draw(st.sampled_from(free))
            q.remove(b, reuse=data.draw(st.booleans()))
            ref.remove(b)
        elif op == "pop":
            if free:
                assert q.pop() == ref.pop()
            else:
                with pytest.raises(IndexError):
                    q.pop()
        elif op == "consume" and keys:
            i = data.draw(st.integers(0, len(keys) - 1))
            nu.consume(i)
        check_same(q, ref, num_blocks, data.draw(st.integers(0, num_blocks - 1)))
    # Successive pops (and pop_many) follow iter_blocks.
    order = list(q.iter_blocks())
    k = data.draw(st.integers(0, len(order)))
    assert q.pop_many(k) + [q.pop() for _ in order[k:]] == order
    assert len(q) == 0 and list(q.iter_blocks()) == []
    with pytest.raises(IndexError):
        q.pop()
    assert list(q.remembered_keys()) == []


def test_next_use_queue_tie_keeps_push_order_after_rerank():
    """Ties go to the block pushed first, also when a re-rank made them tie."""
    # Key 0 is held by requests 0, 1 and 3; key 1 by 1, 2 and 3.
    nu = NextUse([np.array([0]), np.array([0, 1]), np.array([1]), np.array([0, 1])], 2)
    q = NextUseQueue(nu)
    q.reset(4)
    q.push(1, 0)  # next use 0
    q.push(2, 1)  # next use 1: evicted first
    assert list(q.iter_blocks()) == [2, 1]
    nu.consume(0)  # key 0 moves to 1: a tie, and block 1 was pushed first
    assert nu.next.tolist() == [1, 1]
    assert list(q.iter_blocks()) == [1, 2]
    assert q.pop() == 1
    nu.consume(1)
    q.push(1, 0)  # key 0 -> 3, key 1 -> 2
    assert list(q.iter_blocks()) == [1, 2]
    nu.consume(2)  # key 1 -> 3: a tie, and block 1 was pushed after block 2
    assert nu.next.tolist() == [3, 3]
    assert list(q.iter_blocks()) == [2, 1]
    assert q.pop() == 2 and q.pop() == 1


def test_next_use_queue_unhashed_first_and_errors():
    nu = NextUse([np.array([0]), np.array([1])], 2)
    q = NextUseQueue(nu)
    q.reset(5)
    q.push(1, 1)
    q.push(2, None)
    q.push(3, 0)
    q.push(4, None)
    assert list(q.iter_blocks()) == [4, 2, 1, 3]  # unhashed, the last pushed first
    assert list(q.iter_blocks(after=2)) == [1, 3]
    assert list(q.iter_blocks(after=0)) == [4, 2, 1, 3]  # not free: from the start
    assert 0 not in q and -1 not in q and 99 not in q
    with pytest.raises(KeyError):
        q.remove(0)
    q.remove(2)
    assert q.pop() == 4 and q.pop() == 1 and len(q) == 1


def test_next_use_queue_heap_stays_compact():
    """Many push/remove cycles leave dead heap entries; compaction bounds them."""
    nu = NextUse([np.array([0]), np.array([1]), np.array([0])], 2)
    q = NextUseQueue(nu)
    q.reset(3)
    q.push(2, 1)
    for _ in range(3000):
        q.push(1, 0)
        q.remove(1)
    assert len(q._heap) < 1100  # without compaction: 3001 entries
    q.push(1, 0)
    assert list(q.iter_blocks()) == [2, 1]  # key 1 is next used by request 1, key 0 by 0
    nu.consume(0)  # key 0 -> 2
    assert list(q.iter_blocks()) == [1, 2]
    nu.consume(2)  # key 0 is never used again
    assert list(q.iter_blocks()) == [1, 2] and q.pop() == 1 and q.pop() == 2


# ---- inside a BlockPool --------------------------------------------------------------------


def test_next_use_queue_in_block_pool():
    # Keys 0..3; request i holds the keys listed (trace order).
    keys = [[0, 1, 2, 3], [2], [1], [0], [2]]
    nu = NextUse([np.array(k) for k in keys], 4)
    pool = BlockPool(6, eviction=NextUseQueue(nu))
    nu.consume(0)  # next: key 0 -> 3, key 1 -> 2, key 2 -> 1, key 3 -> never (5)
    blocks = pool.get_new_blocks(4)
    assert blocks == [1, 2, 3, 4]  # unhashed blocks in id order
    for b, k in zip(blocks, range(4), strict=True):
        pool.cache_block(b, k)
    pool.free_blocks(blocks)
    pool.check_invariants()
    assert [pool.block_hash(b) for b in pool.iter_free()] == [None, 3, 0, 1, 2]
    assert pool.get_new_blocks(2) == [5, 4]  # the unhashed block, then key 3 (never used)
    assert 3 not in pool and pool.num_cached_keys == 3
    pool.check_invariants()

    nu.consume(1)  # key 2 -> 4: now the furthest
    assert [pool.block_hash(b) for b in pool.iter_free()] == [2, 0, 1]
    pool.touch([1])  # a hit on key 0 takes its block out
    assert [pool.block_hash(b) for b in pool.iter_free()] == [2, 1]
    [victim] = pool.get_new_blocks(1)
    assert victim == 3 and 2 not in pool
    pool.free_blocks([1])  # back in the queue under key 0 (next use 3)
    assert [pool.block_hash(b) for b in pool.iter_free()] == [0, 1]
    pool.check_invariants()
    nu.consume(3)  # key 0 is never used again: ties with nothing, still first
    nu.consume(2)  # key 1 is never used again: ties with key 0; key 0's block was freed later
    assert [pool.block_hash(b) for b in pool.iter_free()] == [1, 0]
    assert pool.get_new_blocks(2) == [2, 1]
    pool.check_invariants()
