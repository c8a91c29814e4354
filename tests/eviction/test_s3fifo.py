"""S3-FIFO (``kvtriton.eviction.s3fifo``): its own rules, and a differential check against a
plain-list reference of the same rules.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.queue_ops import OPS, assert_matches_reference, drain_order, hit, store
from kvtriton.eviction import EvictionQueue, S3FIFOQueue
from kvtriton.pool import BlockPool


def test_s3fifo_hit_block_survives_a_scan():
    pool = BlockPool(11, eviction="s3fifo")  # 10 usable, S target 1
    store(pool, 1)
    hit(pool, 1)  # promoted to M
    for k in range(100, 140):  # one-time blocks stream through S
        store(pool, k)
    assert 1 in pool
    lru = BlockPool(11, eviction="lru")
    store(lru, 1)
    hit(lru, 1)
    for k in range(100, 140):
        store(lru, k)
    assert 1 not in lru


def test_s3fifo_ghost_key_returns_to_main():
    pool = BlockPool(4, eviction="s3fifo")  # 3 usable, S target 1
    for k in (1, 2, 3, 4):
        store(pool, k)  # key 1 evicted from S into the ghost
    assert 1 not in pool
    b = store(pool, 1)
    assert b in pool.eviction._second  # M


def test_s3fifo_main_reinsertion_gives_a_second_chance():
    pool = BlockPool(5, eviction="s3fifo")  # 4 usable, S target 1
    for k in (1, 2, 3):
        store(pool, k)
        hit(pool, k)  # all in M, freq 0
    hit(pool, 1)  # key 1: freq 1, at M's tail
    order = list(pool.iter_free())
    keys = [pool.block_hash(b) for b in order]
    assert keys == [None, 2, 3, 1]
    assert order == drain_order(pool.eviction)


def test_s3fifo_rejects_bad_fraction():
    with pytest.raises(ValueError, match="small_fraction"):
        S3FIFOQueue(small_fraction=1.5)


# ---- differential check against a plain-list reference -------------------------------------------


class RefS3FIFO(EvictionQueue):
    """S3FIFOQueue's rules on plain lists, O(n) per operation."""

    name = "ref-s3fifo"

    def reset(self, num_blocks):
        self.cap = max(1, num_blocks - 1)
        self.target = max(1, int(self.cap * 0.1))
        self.u, self.s, self.m, self.g = [], [], [], []
        self.fresh: dict[int, bool] = {}
        self.freq: dict[int, int] = {}
        self.left: dict[int, int] = {}

    def push(self, b, key):
        if key is None:
            self.fresh[b] = True
            self.u.insert(0, b)
        elif not self.fresh.get(b, True):
            came_from_main = self.left.get(b) == 2
            self.freq[b] = min(self.freq.get(b, 0) + 1, 3) if came_from_main else 0
            self.m.append(b)
        else:
            self.fresh[b] = False
            self.freq[b] = 0
            if key in self.g:
                self.g.remove(key)
                self.m.append(b)
            else:
                self.s.append(b)

    def remove(self, b, reuse=True):
        assert reuse, "run_ops touches without a user: every touch is a reuse"
        for lst, tag in ((self.s, 1), (self.m, 2)):
            if b in lst:
                lst.remove(b)
                self.left[b] = tag
                return
        self.u.remove(b)

    def pop(self):
        if self.u:
            b = self.u.pop(0)
        elif len(self.s) > self.target or not self.m:
            b = self.s.pop(0)
            self.left[b] = 1
        else:
            while True:
                b = self.m.pop(0)
                if not self.freq.get(b, 0):
                    break
                self.freq[b] -= 1
                self.m.append(b)
            self.left[b] = 2
        self.fresh[b] = True
        return b

    def on_evicted(self, b, key):
        if self.left.get(b) == 1:
            if key in self.g:
                self.g.remove(key)
            self.g.append(key)
            del self.g[: max(0, len(self.g) - self.cap)]
        self.fresh[b] = True

    def __len__(self):
        return len(self.u) + len(self.s) + len(self.m)

    def __contains__(self, b):
        return b in self.u or b in self.s or b in self.m

    def iter_blocks(self, after=None):
        order = drain_order(self)
        return iter(order[order.index(after) + 1:] if after in order else order)


@pytest.mark.parametrize(("name", "ref"), [("s3fifo", RefS3FIFO)])
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_matches_plain_list_reference(name, ref, ops, num_blocks):
    assert_matches_reference(name, ref(), ops, num_blocks)
