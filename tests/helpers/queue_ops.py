"""Operations on a ``BlockPool`` and its eviction queue, shared by the eviction tests: a pool with
cached blocks, a prefix-cache hit, a store, the queue's order drained from a copy, and random
operation lists that any queue must survive.
"""

from __future__ import annotations

import copy

from hypothesis import strategies as st

from kvtriton.eviction import EvictionQueue
from kvtriton.pool import BlockPool


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


def assert_matches_reference(name: str, reference: EvictionQueue, ops, num_blocks: int) -> None:
    """The registry's queue ``name`` and ``reference`` (a plain-list model of the same rule)
    give the same results under ``ops``, and the pool's free order is the queue's drain order."""
    pool = BlockPool(num_blocks, eviction=name)
    ref_pool = BlockPool(num_blocks, eviction=reference)
    assert run_ops(pool, ops) == run_ops(ref_pool, ops)
    pool.check_invariants()
    assert list(pool.iter_free()) == drain_order(pool.eviction)
