"""ARC (``kvtriton.eviction.arc``): its own rules, and a differential check against a plain-list
reference of the same rules.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.queue_ops import (
    OPS,
    assert_matches_reference,
    cached_pool,
    drain_order,
    hit,
    store,
)
from kvtriton.eviction import ARCQueue, EvictionQueue
from kvtriton.pool import BlockPool


def test_arc_keeps_a_block_used_twice_over_newer_one_timers():
    # LRU would evict key 1 first (freed earliest); ARC keeps it in T2 while T1 is over p = 0.
    for name, first_victim_key in (("lru", 1), ("arc", 2)):
        pool = BlockPool(4, eviction=name)
        store(pool, 1)
        hit(pool, 1)
        store(pool, 2)
        store(pool, 3)
        pool.get_new_blocks(1)
        assert first_victim_key not in pool, name
        assert all(k in pool for k in {1, 2, 3} - {first_victim_key}), name


def test_arc_ghost_hit_in_b1_grows_p_and_enters_t2():
    pool, _ = cached_pool("arc", 3, [1, 2])
    arc: ARCQueue = pool.eviction
    store(pool, 3)  # evicts key 1 from T1 into B1
    assert 1 not in pool and arc.ghost_sizes == (1, 0)
    assert arc.p == 0
    b = store(pool, 1)  # key 1 again: a B1 ghost hit
    assert arc.p == 1
    assert arc.ghost_sizes[0] == 1  # key 1 left B1, the victim of this store entered it
    assert b in arc._second  # T2


def test_arc_ghost_hit_in_b2_shrinks_p():
    pool, _ = cached_pool("arc", 3, [1, 2])
    arc: ARCQueue = pool.eviction
    arc.p = 2
    hit(pool, 1)
    hit(pool, 2)  # both in T2
    store(pool, 3)  # T1 empty -> evict from T2 (key 1): B2
    assert 1 not in pool and arc.ghost_sizes == (0, 1)
    store(pool, 1)
    assert arc.p == 1


def test_arc_ghost_lists_are_bounded_by_the_pool_size():
    pool = BlockPool(4, eviction="arc")  # 3 usable blocks
    for k in range(50):
        store(pool, k)
    b1, b2 = pool.eviction.ghost_sizes
    assert b1 <= 3 and b2 <= 3


# ---- differential check against a plain-list reference -------------------------------------------


class RefARC(EvictionQueue):
    """ARCQueue's rules on plain lists, O(n) per operation."""

    name = "ref-arc"

    def reset(self, num_blocks):
        self.cap = max(1, num_blocks - 1)
        self.u, self.t1, self.t2, self.b1, self.b2 = [], [], [], [], []
        self.p = 0
        self.fresh: dict[int, bool] = {}
        self.left: dict[int, int] = {}

    def push(self, b, key):
        if key is None:
            self.fresh[b] = True
            self.u.insert(0, b)
        elif not self.fresh.get(b, True):
            self.t2.append(b)
        else:
            self.fresh[b] = False
            if key in self.b1:
                self.p = min(self.p + max(1, len(self.b2) // len(self.b1)), self.cap)
                self.b1.remove(key)
                self.t2.append(b)
            elif key in self.b2:
                self.p = max(self.p - max(1, len(self.b1) // len(self.b2)), 0)
                self.b2.remove(key)
                self.t2.append(b)
            else:
                self.t1.append(b)

    def remove(self, b, reuse=True):
        assert reuse, "run_ops touches without a user: every touch is a reuse"
        for lst, tag in ((self.t1, 1), (self.t2, 2)):
            if b in lst:
                lst.remove(b)
                self.left[b] = tag
                return
        self.u.remove(b)

    def pop(self):
        if self.u:
            b = self.u.pop(0)
        elif self.t1 and (len(self.t1) > self.p or not self.t2):
            b = self.t1.pop(0)
            self.left[b] = 1
        else:
            b = self.t2.pop(0)
            self.left[b] = 2
        self.fresh[b] = True
        return b

    def on_evicted(self, b, key):
        ghost = self.b1 if self.left.get(b) == 1 else self.b2
        if key in ghost:
            ghost.remove(key)
        ghost.append(key)
        del ghost[: max(0, len(ghost) - self.cap)]
        self.fresh[b] = True

    def __len__(self):
        return len(self.u) + len(self.t1) + len(self.t2)

    def __contains__(self, b):
        return b in self.u or b in self.t1 or b in self.t2

    def iter_blocks(self, after=None):
        order = drain_order(self)
        return iter(order[order.index(after) + 1:] if after in order else order)


@pytest.mark.parametrize(("name", "ref"), [("arc", RefARC)])
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_matches_plain_list_reference(name, ref, ops, num_blocks):
    assert_matches_reference(name, ref(), ops, num_blocks)
