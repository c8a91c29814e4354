"""ARC and S3-FIFO free-block queues: the pool protocol, their own rules, and a differential
check against plain-list references of the same rules."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtriton.eviction import (
    EVICTION_QUEUES,
    ARCQueue,
    EvictionQueue,
    S3FIFOQueue,
    make_eviction_queue,
)
from kvtriton.pool import BlockPool

NEW_POLICIES = ["arc", "s3fifo"]
ALL_POLICIES = ["lru", "arc", "s3fifo"]


def cached_pool(eviction, num_blocks: int, keys: list[int]) -> tuple[BlockPool, list[int]]:
    """A pool whose first ``len(keys)`` blocks are cached under ``keys`` and freed in order."""
    pool = BlockPool(num_blocks, eviction=eviction)
    blocks = pool.get_new_blocks(len(keys))
    for b, k in zip(blocks, keys, strict=True):
        pool.cache_block(b, k)
    pool.free_blocks(blocks)
    return pool, blocks


def hit(pool: BlockPool, key: int) -> int:
    """Touch and free the block cached under ``key`` (a prefix-cache hit)."""
    b = pool.get_cached_block(key)
    assert b is not None, f"key {key} not cached"
    pool.touch([b])
    pool.free_blocks([b])
    return b


def store(pool: BlockPool, key: int) -> int:
    """Cache ``key`` in a new block and free it."""
    (b,) = pool.get_new_blocks(1)
    pool.cache_block(b, key)
    pool.free_blocks([b])
    return b


def drain_order(queue: EvictionQueue) -> list[int]:
    p = copy.deepcopy(queue)
    return [p.pop() for _ in range(len(p))]


# ---- protocol, every queue ---------------------------------------------------------------


def test_registered():
    assert EVICTION_QUEUES["arc"] is ARCQueue and EVICTION_QUEUES["s3fifo"] is S3FIFOQueue
    assert isinstance(make_eviction_queue("arc"), ARCQueue)


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_fresh_pool_hands_out_blocks_in_order(name):
    pool = BlockPool(6, eviction=name)
    assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_unhashed_blocks_go_before_any_cached_one(name):
    pool = BlockPool(5, eviction=name)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], 100)
    pool.cache_block(blocks[2], 102)
    pool.free_blocks(blocks)
    assert sorted(pool.get_new_blocks(2)) == [blocks[1], blocks[3]]
    assert 100 in pool and 102 in pool
    pool.check_invariants()


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_remove_is_a_hit_and_keeps_the_key(name):
    pool, blocks = cached_pool(name, 4, [10, 11, 12])
    assert hit(pool, 10) == blocks[0]
    assert pool.get_cached_block(10) == blocks[0]
    assert pool.num_free_blocks == 3
    pool.check_invariants()


@pytest.mark.parametrize("name", ALL_POLICIES)
def test_pop_on_empty_raises(name):
    p = make_eviction_queue(name)
    p.reset(3)
    assert len(p) == 0
    with pytest.raises(IndexError):
        p.pop()


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_iter_blocks_is_the_eviction_order(name):
    pool, _ = cached_pool(name, 12, list(range(100, 111)))
    for k in (103, 100, 105, 103, 103, 109):
        hit(pool, k)
    store(pool, 200)  # evicts one block, whose key enters a ghost list
    order = list(pool.iter_free())
    assert order == drain_order(pool.eviction)
    assert sorted(order) == list(range(1, 12))
    assert list(pool.iter_free(order[4])) == order[5:]
    held = pool.get_new_blocks(1)  # a block that is not free: iteration starts at the head
    assert list(pool.iter_free(held[0])) == list(pool.iter_free())


@pytest.mark.parametrize("name", NEW_POLICIES)
def test_evict_cached_makes_the_block_first(name):
    pool, blocks = cached_pool(name, 5, [1, 2, 3, 4])
    assert pool.evict_cached(blocks[2])
    assert 3 not in pool
    assert pool.get_new_blocks(1) == [blocks[2]]
    pool.check_invariants()


# ---- ARC ------------------------------------------------------------------------------------


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


# ---- S3-FIFO --------------------------------------------------------------------------------


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


# ---- differential check against plain-list references ---------------------------------------


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

    def remove(self, b):
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

    def remove(self, b):
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


# An operation: (kind, a, b), interpreted against the pool's state so any list is valid.
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "hit", "free", "evict", "check"]),
                         st.integers(0, 10), st.integers(0, 30)), max_size=60)


def run_ops(pool: BlockPool, ops) -> list:
    """Apply ``ops``; returns everything observable, step by step."""
    held: list[int] = []
    trace = []
    for kind, a, c in ops:
        if kind == "alloc":
            n = min(a % 4 + 1, pool.num_free_blocks)
            blocks = pool.get_new_blocks(n)
            for i, b in enumerate(blocks):
                if (c + i) % 3:  # most new blocks get a key from a small set (ghost hits)
                    pool.cache_block(b, (c + 7 * i) % 24)
            held.extend(blocks)
            trace.append(("alloc", blocks))
        elif kind == "hit":
            b = pool.get_cached_block(c % 24)
            if b is not None:
                pool.touch([b])
                held.append(b)
            trace.append(("hit", b))
        elif kind == "free" and held:
            k = a % len(held) + 1
            chunk, held[:] = held[-k:], held[:-k]
            pool.free_blocks(chunk[::-1] if c % 2 else chunk)
            trace.append(("free", chunk))
        elif kind == "evict":
            b = 1 + a % (pool.num_blocks - 1)
            trace.append(("evict", b, pool.evict_cached(b)))
        trace.append(("free_order", list(pool.iter_free())))
    return trace


@pytest.mark.parametrize(("name", "ref"), [("arc", RefARC), ("s3fifo", RefS3FIFO)])
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_matches_plain_list_reference(name, ref, ops, num_blocks):
    pool = BlockPool(num_blocks, eviction=name)
    ref_pool = BlockPool(num_blocks, eviction=ref())
    assert run_ops(pool, ops) == run_ops(ref_pool, ops)
    pool.check_invariants()
    assert list(pool.iter_free()) == drain_order(pool.eviction)


@pytest.mark.parametrize("name", NEW_POLICIES)
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_pool_invariants_hold(name, ops, num_blocks):
    pool = BlockPool(num_blocks, eviction=name)
    run_ops(pool, ops)
    pool.check_invariants()
    free = list(pool.iter_free())
    assert len(free) == len(set(free)) == pool.num_free_blocks
