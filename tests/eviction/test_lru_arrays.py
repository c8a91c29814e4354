"""The array LRU queue (a slot log with lazy deletion) against a plain list: every batch and
single call, across compactions, in the order a linked list would keep."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.eviction import LRUQueue

N = 12  # block ids 0..11; a small buffer compacts often


class ListLRU:
    """The model: a list, next victim first; unhashed blocks enter at the front."""

    def __init__(self):
        self.q = []

    def push(self, b, hashed):
        if hashed:
            self.q.append(b)
        else:
            self.q.insert(0, b)

    def remove(self, b):
        self.q.remove(b)

    def pop_many(self, n):
        out, self.q = self.q[:n], self.q[n:]
        return out


op = st.one_of(
    st.tuples(st.just("push"), st.integers(0, N - 1), st.booleans()),
    st.tuples(st.just("push_many"), st.lists(st.tuples(st.integers(0, N - 1), st.booleans()),
                                             max_size=N)),
    st.tuples(st.just("remove"), st.integers(0, N - 1)),
    st.tuples(st.just("remove_many"), st.lists(st.integers(0, N - 1), max_size=N)),
    st.tuples(st.just("pop_many"), st.integers(0, N)),
    st.tuples(st.just("iter_after"), st.integers(0, N - 1)),
)


@pytest.mark.parametrize("batch_min", [0, 32], ids=["arrays", "default"])
@settings(max_examples=300)
@given(ops=st.lists(op, max_size=80))
def test_array_lru_matches_a_list(batch_min, ops):
    q = LRUQueue()
    q.reset(N)
    q.batch_min = batch_min
    m = ListLRU()
    key_of = [7] * N
    for name, *args in ops:
        if name == "push":
            b, hashed = args
            if b in m.q:
                with pytest.raises(ValueError, match=f"block {b} is already queued"):
                    q.push(b, 7 if hashed else None)
                continue
            q.push(b, 7 if hashed else None)
            m.push(b, hashed)
        elif name == "push_many":
            pairs = list(dict(args[0]).items())  # distinct blocks, last flag wins
            pairs = [(b, h) for b, h in pairs if b not in m.q]
            ids = np.array([b for b, _ in pairs], dtype=np.int64)
            q.push_many(ids, np.array([h for _, h in pairs], dtype=bool), key_of)
            for b, h in pairs:
                m.push(b, h)
        elif name == "remove":
            (b,) = args
            if b not in m.q:
                with pytest.raises(KeyError):
                    q.remove(b)
                continue
            q.remove(b)
            m.remove(b)
        elif name == "remove_many":
            ids = list(dict.fromkeys(args[0]))
            if any(b not in m.q for b in ids):
                before = list(q.iter_blocks())
                with pytest.raises(KeyError):
                    q.remove_many(np.array(ids, dtype=np.int64))
                assert list(q.iter_blocks()) == before  # nothing removed
                continue
            q.remove_many(np.array(ids, dtype=np.int64))
            for b in ids:
                m.remove(b)
        elif name == "pop_many":
            n = min(args[0], len(m.q))
            got = q.pop_many(n)
            assert list(map(int, got)) == m.pop_many(n)
        else:
            (b,) = args
            want = m.q[m.q.index(b) + 1:] if b in m.q else m.q
            assert list(q.iter_blocks(b)) == want
        assert list(q.iter_blocks()) == m.q
        assert len(q) == len(m.q)
        assert all((b in q) == (b in m.q) for b in range(N))


def test_compaction_keeps_the_order_and_an_iteration_refuses_to_follow_it():
    q = LRUQueue()
    q.reset(4)
    q.batch_min = 0
    for b in (1, 2, 3):
        q.push(b, 1)
    epoch = q._epoch
    # Each round trip writes a slot at the tail: the buffer's end comes within 4 * 4 + 64.
    for _ in range(200):
        q.remove(1)
        q.push(1, 1)
        q.remove(2)
        q.push(2, 1)
    assert q._epoch > epoch, "the log never compacted"
    assert list(q.iter_blocks()) == [3, 1, 2]
    assert [int(b) for b in q.pop_many(2)] == [3, 1]
    q.push(3, None)  # unhashed: first out
    assert list(q.iter_blocks()) == [3, 2]
    it = q.iter_blocks()
    assert next(it) == 3
    q._compact()
    with pytest.raises(RuntimeError, match="compacted during an iteration"):
        next(it)


def test_pop_many_past_dead_slots():
    """A window of mostly dead slots: the pop continues past it to the live ones."""
    q = LRUQueue()
    q.reset(2000)
    q.batch_min = 0
    ids = np.arange(1, 2000, dtype=np.int64)
    q.push_many(ids, np.ones(len(ids), dtype=bool), [1] * 2000)
    q.remove_many(ids[:1500])  # the head's 1,500 slots are dead
    got = q.pop_many(400)
    assert got.tolist() == ids[1500:1900].tolist()
    assert len(q) == 99
    with pytest.raises(IndexError, match="pop of 100 from a queue of 99"):
        q.pop_many(100)
