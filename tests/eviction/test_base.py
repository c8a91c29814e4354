"""The eviction-queue protocol (``kvtriton.eviction.base``) and the registry of queues
(``kvtriton.eviction``), for every registered queue (LRU, ARC, S3-FIFO) inside a ``BlockPool``:
the order of a fresh pool, unhashed blocks first, a hit keeps the key, ``iter_blocks`` is the
eviction order, and the pool's invariants under random operations. ARC's and S3-FIFO's own rules
are in ``test_arc.py`` and ``test_s3fifo.py``; LRU (vLLM's free queue) has none beyond these.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.queue_ops import OPS, cached_pool, drain_order, hit, run_ops, store
from kvtriton.eviction import EVICTION_QUEUES, ARCQueue, S3FIFOQueue, make_eviction_queue
from kvtriton.pool import BlockPool

NEW_SETUPS = ["arc", "s3fifo"]
ALL_SETUPS = ["lru", "arc", "s3fifo"]


# ---- protocol, every queue -----------------------------------------------------------------------


def test_registered():
    assert EVICTION_QUEUES["arc"] is ARCQueue and EVICTION_QUEUES["s3fifo"] is S3FIFOQueue
    assert isinstance(make_eviction_queue("arc"), ARCQueue)


@pytest.mark.parametrize("name", ALL_SETUPS)
def test_fresh_pool_hands_out_blocks_in_order(name):
    pool = BlockPool(6, eviction=name)
    assert pool.get_new_blocks(5) == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


@pytest.mark.parametrize("name", ALL_SETUPS)
def test_unhashed_blocks_go_before_any_cached_one(name):
    pool = BlockPool(5, eviction=name)
    blocks = pool.get_new_blocks(4)
    pool.cache_block(blocks[0], 100)
    pool.cache_block(blocks[2], 102)
    pool.free_blocks(blocks)
    assert sorted(pool.get_new_blocks(2)) == [blocks[1], blocks[3]]
    assert 100 in pool and 102 in pool
    pool.check_invariants()


@pytest.mark.parametrize("name", ALL_SETUPS)
def test_remove_is_a_hit_and_keeps_the_key(name):
    pool, blocks = cached_pool(name, 4, [10, 11, 12])
    assert hit(pool, 10) == blocks[0]
    assert pool.get_cached_block(10) == blocks[0]
    assert pool.num_free_blocks == 3
    pool.check_invariants()


@pytest.mark.parametrize("name", ALL_SETUPS)
def test_pop_on_empty_raises(name):
    p = make_eviction_queue(name)
    p.reset(3)
    assert len(p) == 0
    with pytest.raises(IndexError):
        p.pop()


@pytest.mark.parametrize("name", NEW_SETUPS)
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


@pytest.mark.parametrize("name", NEW_SETUPS)
def test_evict_cached_makes_the_block_first(name):
    pool, blocks = cached_pool(name, 5, [1, 2, 3, 4])
    assert pool.evict_cached(blocks[2])
    assert 3 not in pool
    assert pool.get_new_blocks(1) == [blocks[2]]
    pool.check_invariants()


# ---- random operations ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NEW_SETUPS)
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_pool_invariants_hold(name, ops, num_blocks):
    pool = BlockPool(num_blocks, eviction=name)
    run_ops(pool, ops)
    pool.check_invariants()
    free = list(pool.iter_free())
    assert len(free) == len(set(free)) == pool.num_free_blocks
