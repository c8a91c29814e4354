"""``HintedQueue``: the closed and protected segments around a wrapped eviction queue (LRU, ARC,
S3-FIFO): pop order, the protection cap, ``hint`` moving free blocks, the queue inside a
``BlockPool`` under random operations, and blocks handed out by a segment counting as fresh."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.eviction import ARCQueue, LRUQueue, S3FIFOQueue
from kvtriton.eviction.protected import (
    _BASE,
    _CLOSED,
    _PROTECTED,
    _UNHASHED,
    CLOSED,
    NORMAL,
    PROTECTED,
    HintedQueue,
)
from kvtriton.pool import BlockPool
from kvtriton.sim.next_use import NextUse, NextUseQueue

BASES = {"lru": LRUQueue, "arc": ARCQueue, "s3fifo": S3FIFOQueue}
NONE = lambda k: None  # no free block holds the key


def hinted(base: str, share: float = 0.5) -> HintedQueue:
    return HintedQueue(BASES[base](), share)


def pool_with(base: str, num_blocks: int, share: float = 0.5) -> tuple[BlockPool, HintedQueue]:
    q = hinted(base, share)
    return BlockPool(num_blocks, eviction=q), q


def cache(pool: BlockPool, keys: list[int]) -> list[int]:
    """Fresh blocks cached under ``keys`` and freed in that order."""
    blocks = pool.get_new_blocks(len(keys))
    for b, k in zip(blocks, keys, strict=True):
        pool.cache_block(b, k)
    pool.free_blocks(blocks)
    return blocks


def segments(q: HintedQueue) -> tuple[list[int], list[int], list[int], list[int]]:
    return list(q._unhashed), list(q._closed), list(q.base.iter_blocks()), list(q._protected)


# ---- order and the cap ---------------------------------------------------------------------


@pytest.mark.parametrize("base", list(BASES))
def test_pop_order_unhashed_closed_base_protected(base):
    q = hinted(base)
    q.reset(12)
    assert q.name == f"{base}+hints"
    q.hint(np.array([10, 11]), CLOSED, NONE)
    q.hint(np.array([20, 21]), PROTECTED, NONE)
    assert [q.level(k) for k in (10, 20, 0, 999)] == [CLOSED, PROTECTED, NORMAL, NORMAL]
    for b, key in [(1, 20), (2, 0), (3, 10), (4, None), (5, 1), (6, 21), (7, 11), (8, None)]:
        q.push(b, key)
    assert segments(q) == ([8, 4], [3, 7], [2, 5], [1, 6])  # fresh blocks: base in push order
    order = [8, 4, 3, 7, 2, 5, 1, 6]
    assert list(q.iter_blocks()) == order
    assert list(q.iter_blocks(after=7)) == [2, 5, 1, 6]
    assert list(q.iter_blocks(after=9)) == order  # not free: from the start
    assert len(q) == 8 and q.protected_blocks == 2
    assert all(b in q for b in order) and 9 not in q and 0 not in q
    assert [q.pop() for _ in order] == order
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.pop()


@pytest.mark.parametrize("base", list(BASES))
def test_protect_cap_demotes_oldest(base):
    q = hinted(base, 0.3)
    q.reset(11)  # cap int(0.3 * 10) = 3
    q.hint(np.arange(5), PROTECTED, NONE)
    for b in range(1, 6):
        q.push(b, b - 1)
    assert q.protected_blocks == 3 and q.protect_overflow == 2
    assert segments(q) == ([], [], [1, 2], [3, 4, 5])
    q.push(6, 9)  # a normal block joins the base after the demoted ones
    q.push(7, 4)  # key 4 is protected: one more demotion (block 3)
    assert q.protect_overflow == 3
    assert segments(q) == ([], [], [1, 2, 6, 3], [4, 5, 7])
    assert list(q.iter_blocks()) == [q.pop() for _ in range(7)] == [1, 2, 6, 3, 4, 5, 7]


def test_protect_cap_demotes_the_deepest_block_first():
    """A hit needs a chain's head: a full protected segment lets the deepest block go."""
    q = hinted("lru", 0.3)
    q.reset(11)  # cap 3
    q.hint(np.arange(5), PROTECTED, NONE, np.array([0, 1, 2, 3, 4], dtype=np.int32))
    for b, key in [(1, 4), (2, 3), (3, 0), (4, 1), (5, 2)]:  # a tail-first free order
        q.push(b, key)
    assert segments(q) == ([], [], [1, 2], [3, 4, 5])  # keys 4 and 3 demoted, 0..2 kept
    q.hint(np.array([9]), PROTECTED, NONE, np.array([1], dtype=np.int32))
    q.push(6, 9)  # depth 1, as deep as key 1 (block 4) but newer: block 5 (depth 2) goes
    assert segments(q) == ([], [], [1, 2, 5], [3, 4, 6])


@pytest.mark.parametrize(("demote", "kept"), [("oldest", [4, 5, 6]), ("newest", [1, 2, 3])])
def test_a_full_segment_lets_the_oldest_or_newest_hint_go(demote, kept):
    """Two hints of three chain blocks each, a segment of three: the other hint's blocks go,
    deepest first, whatever their depth against the kept hint's."""
    q = HintedQueue(LRUQueue(), 0.3, demote=demote)
    q.reset(11)  # cap 3
    q.hint(np.array([0, 1, 2]), PROTECTED, NONE, np.array([0, 1, 2], dtype=np.int32))
    q.hint(np.array([3, 4, 5]), PROTECTED, NONE, np.array([5, 6, 7], dtype=np.int32))
    for b, key in [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4), (6, 5)]:
        q.push(b, key)
    assert list(q._protected) == kept and q.protect_overflow == 3
    # Oldest: each push of the new hint demotes the old hint's deepest block. Newest: each
    # new block is the newest hint's only one present, and goes at once.
    assert list(q.base.iter_blocks()) == ([3, 2, 1] if demote == "oldest" else [4, 5, 6])


def test_bad_demote():
    with pytest.raises(ValueError, match="'middle'"):
        HintedQueue(LRUQueue(), 0.5, demote="middle")


@settings(max_examples=max(100, settings.default.max_examples))
@given(data=st.data(), num_blocks=st.integers(2, 12), share=st.sampled_from([0.2, 0.5, 1.0]))
def test_demotion_matches_a_loop_reference(data, num_blocks, share):
    """Against a list: each overflow removes the deepest protected block, the oldest among
    equals. Blocks leave in between (a real use, or a request's own repeated touch) and come
    back: a block keeps its age unless it comes back fresh (after a real use, or cached under
    another key)."""
    q = hinted("lru", share)
    q.reset(num_blocks)
    cap = int(share * (num_blocks - 1))
    depths = data.draw(st.lists(st.integers(0, 4), min_size=N_KEYS, max_size=N_KEYS))
    q.hint(np.arange(N_KEYS), PROTECTED, NONE, np.array(depths, dtype=np.int32))
    ref: list[tuple[int, int, int]] = []  # (block, age, depth) in segment order
    outside = list(range(1, num_blocks))
    key_of: dict[int, int] = {}
    age_of: dict[int, int] = {}
    fresh = set(outside)
    clock = 0
    for _ in range(data.draw(st.integers(1, 40))):
        if outside and data.draw(st.integers(0, 2)):
            b = outside.pop(data.draw(st.integers(0, len(outside) - 1)))
            key = data.draw(st.sampled_from([key_of[b]] * 2 + list(range(N_KEYS)))
                            if b in key_of else st.integers(0, N_KEYS - 1))
            if key_of.get(b) != key:
                fresh.add(b)
            key_of[b] = key
            q.push(b, key)
            if b in fresh:
                clock += 1
                age_of[b] = clock
                fresh.discard(b)
            ref.append((b, age_of[b], depths[key]))
            if len(ref) > cap:
                gone = max(ref, key=lambda e: (e[2], -e[1]))
                ref.remove(gone)
        else:
            inside = [b for b, _, _ in ref] + [b for b in q.base.iter_blocks()]
            if not inside:
                continue
            b = data.draw(st.sampled_from(inside))
            reuse = data.draw(st.booleans())
            q.remove(b, reuse=reuse)
            if reuse:
                fresh.add(b)
            ref = [e for e in ref if e[0] != b]
            outside.append(b)
        assert list(q._protected) == [b for b, _, _ in ref]


@pytest.mark.parametrize(("share", "num_blocks"), [(0.25, 9), (0.5, 10), (1.0, 5), (0.1, 5)])
def test_protect_cap_is_share_of_usable_blocks(share, num_blocks):
    q = hinted("lru", share)
    q.reset(num_blocks)
    cap = int(share * (num_blocks - 1))
    q.hint(np.arange(num_blocks), PROTECTED, NONE)
    for b in range(1, num_blocks):
        q.push(b, b)
    assert q.protected_blocks == cap
    assert q.protect_overflow == (num_blocks - 1 - cap if cap else 0)
    assert len(q) == num_blocks - 1


def test_zero_share_protects_nothing():
    q = hinted("lru", 0.0)
    q.reset(6)
    q.hint(np.array([1, 2]), PROTECTED, NONE)
    q.push(1, 1)
    q.push(2, 5)
    q.push(3, 2)
    assert segments(q) == ([], [], [1, 2, 3], []) and q.protect_overflow == 0


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_bad_share(share):
    with pytest.raises(ValueError, match="protect_share"):
        HintedQueue(LRUQueue(), share)


# ---- hint() --------------------------------------------------------------------------------


@pytest.mark.parametrize("base", list(BASES))
def test_hint_moves_free_blocks_and_skips_referenced(base):
    pool, q = pool_with(base, 10)  # cap int(0.5 * 9) = 4
    fbo = pool.get_cached_block  # may name a referenced block: the queue must skip it
    assert cache(pool, [100, 101, 102, 103, 104, 105]) == [1, 2, 3, 4, 5, 6]
    assert segments(q) == ([7, 8, 9], [], [1, 2, 3, 4, 5, 6], [])

    q.hint(np.array([101, 103]), PROTECTED, fbo)
    assert segments(q) == ([7, 8, 9], [], [1, 3, 5, 6], [2, 4])
    q.hint(np.array([105, 100]), CLOSED, fbo)  # moved in the order given
    assert segments(q) == ([7, 8, 9], [6, 1], [3, 5], [2, 4])
    q.hint(np.array([103]), CLOSED, fbo)  # protected -> closed
    assert segments(q) == ([7, 8, 9], [6, 1, 4], [3, 5], [2])
    q.hint(np.array([100]), NORMAL, fbo)  # closed -> the base's tail
    assert segments(q) == ([7, 8, 9], [6, 4], [3, 5, 1], [2])
    q.hint(np.array([104, 101]), PROTECTED, fbo)  # 101 again: renewed, the newest now
    assert segments(q) == ([7, 8, 9], [6, 4], [3, 1], [5, 2])
    q.hint(np.array([104]), PROTECTED, fbo)
    assert segments(q) == ([7, 8, 9], [6, 4], [3, 1], [2, 5])
    q.hint(np.array([101]), PROTECTED, fbo)
    assert segments(q) == ([7, 8, 9], [6, 4], [3, 1], [5, 2])
    q.hint(np.array([], dtype=np.int64), CLOSED, fbo)
    q.hint(np.array([555]), CLOSED, fbo)  # no block holds it
    assert segments(q) == ([7, 8, 9], [6, 4], [3, 1], [5, 2])
    assert q.level(555) == CLOSED
    pool.check_invariants()

    pool.touch([3])  # referenced: a hint sets the level, the block moves when freed
    q.hint(np.array([102]), CLOSED, fbo)
    assert segments(q) == ([7, 8, 9], [6, 4], [1], [5, 2])
    assert 3 not in q and pool.ref_cnt[3] == 1
    pool.check_invariants()
    pool.free_blocks([3])  # the level is read at push time
    assert segments(q) == ([7, 8, 9], [6, 4, 3], [1], [5, 2])
    pool.touch([2])
    q.hint(np.array([101]), NORMAL, fbo)
    pool.free_blocks([2])
    # The touch of 2 while protected was a hit (reuse): S3-FIFO promotes it to M, ahead of S.
    base_order = [2, 1] if base == "s3fifo" else [1, 2]
    assert segments(q) == ([7, 8, 9], [6, 4, 3], base_order, [5])
    pool.check_invariants()
    order = list(pool.iter_free())
    assert pool.get_new_blocks(len(order)) == order == [7, 8, 9, 6, 4, 3, *base_order, 5]
    pool.check_invariants()


def test_hint_skips_a_block_holding_another_key():
    """``free_block_of`` naming a block whose primary key is another one moves nothing."""
    pool, q = pool_with("lru", 6)
    cache(pool, [1, 2])
    q.hint(np.array([2]), CLOSED, lambda k: 1)  # block 1 is cached under key 1
    assert segments(q) == ([3, 4, 5], [], [1, 2], [])


# ---- random operations through a BlockPool -------------------------------------------------

N_KEYS = 10


def make_queue(base: str, share: float, nu: NextUse | None):
    return HintedQueue(NextUseQueue(nu) if base == "nextuse" else BASES[base](), share)


def check(pool: BlockPool, q: HintedQueue) -> None:
    pool.check_invariants()
    order = list(q.iter_blocks())
    free = [b for b in range(1, pool.num_blocks) if pool.ref_cnt[b] == 0]
    assert len(order) == len(set(order)) == len(q) == len(free)  # none twice, none lost
    assert set(order) == set(free)
    assert len(q._protected) <= q._cap
    for b in free:
        key = pool.block_hash(b)
        if key is None:
            assert b in q._unhashed
        elif q.level(key) == CLOSED:
            assert b in q._closed
        elif q.level(key) == PROTECTED:
            assert b in q._protected or b in q.base  # demoted past the cap
        else:
            assert b in q.base
    segs = {_UNHASHED: q._unhashed, _CLOSED: q._closed, _PROTECTED: q._protected, _BASE: q.base}
    for b in range(1, pool.num_blocks):  # each free block in exactly one segment, as recorded
        inside = [w for w, seg in segs.items() if b in seg]
        assert len(inside) == (pool.ref_cnt[b] == 0), b
        if inside:
            assert q._where[b] == inside[0], b


OPS = ["store"] * 4 + ["free"] * 3 + ["hint"] * 3 + ["touch"] * 2 + [
    "alloc", "cache", "evict", "consume", "reset"]


@settings(max_examples=max(120, settings.default.max_examples))
@given(data=st.data(), base=st.sampled_from(["lru", "arc", "s3fifo", "nextuse"]),
       share=st.sampled_from([0.0, 0.15, 0.3, 1.0]), num_blocks=st.integers(2, 10))
def test_random_operations_keep_the_pool_consistent(data, base, share, num_blocks):
    trace = [np.array(data.draw(st.lists(st.integers(0, N_KEYS - 1), max_size=4)),
                      dtype=np.int64) for _ in range(5)]
    nu = NextUse(trace, N_KEYS) if base == "nextuse" else None
    q = make_queue(base, share, nu)
    pool = BlockPool(num_blocks, eviction=q)
    if data.draw(st.booleans()):  # as the simulator passes it: free blocks only
        fbo = lambda k: (b if (b := pool.get_cached_block(k)) is not None
                         and pool.is_free(b) else None)
    else:  # any cached block: the queue skips referenced ones itself
        fbo = pool.get_cached_block
    check(pool, q)
    for op in data.draw(st.lists(st.sampled_from(OPS), min_size=20, max_size=40)):
        held = [b for b in range(1, num_blocks) if pool.ref_cnt[b]]
        hashed = [b for b in range(1, num_blocks) if pool.block_hash(b) is not None]
        keys = [k for k in range(N_KEYS) if k not in pool]
        if op == "store" and pool.num_free_blocks and keys:  # a new block cached, maybe freed
            [b] = pool.get_new_blocks(1)
            pool.cache_block(b, data.draw(st.sampled_from(keys)))
            if data.draw(st.integers(0, 3)):  # mostly freed at once, as a completed store
                pool.free_blocks([b])
        elif op == "alloc" and pool.num_free_blocks:
            pool.get_new_blocks(data.draw(st.integers(1, min(3, pool.num_free_blocks))))
        elif op == "cache":
            bare = [b for b in held if pool.block_hash(b) is None]
            if bare and keys:
                pool.cache_block(data.draw(st.sampled_from(bare)), data.draw(st.sampled_from(keys)))
        elif op == "free" and held:
            pool.free_blocks([data.draw(st.sampled_from(held))])
        elif op == "touch" and hashed:  # mostly a hit on a free cached block
            free_hashed = [b for b in hashed if not pool.ref_cnt[b]]
            pool.touch([data.draw(st.sampled_from(free_hashed or hashed))],
                       user=data.draw(st.sampled_from([None, "u", "v"])))
        elif op == "hint":
            cached = [pool.block_hash(b) for b in hashed]
            keys = data.draw(st.lists(st.sampled_from(cached) if cached and data.draw(
                st.booleans()) else st.integers(0, N_KEYS - 1), min_size=1, max_size=4))
            level = data.draw(st.sampled_from([NORMAL, PROTECTED, PROTECTED, PROTECTED, CLOSED]))
            depths = data.draw(st.none() | st.lists(st.integers(0, 5), min_size=len(keys),
                                                    max_size=len(keys)))
            q.hint(np.array(keys, dtype=np.int64), level, fbo,
                   None if depths is None else np.array(depths, dtype=np.int32))
        elif op == "evict":
            pool.evict_cached(data.draw(st.integers(1, num_blocks - 1)))
        elif op == "consume" and nu is not None:
            nu.consume(data.draw(st.integers(0, len(trace) - 1)))
        elif op == "reset" and not held:
            assert pool.reset_prefix_cache()
        check(pool, q)
    order = list(pool.iter_free())
    assert pool.get_new_blocks(len(order)) == order  # pops follow iter_blocks
    check(pool, q)
    assert pool.num_free_blocks == 0


# ---- blocks handed out by a segment are fresh to the wrapped queue -------------------------


def reused_block(pool: BlockPool, key: int) -> int:
    """A block cached under ``key`` and hit once by another request: in ARC's T2 / S3-FIFO's M."""
    [b] = cache(pool, [key])
    pool.touch([b])
    pool.free_blocks([b])
    return b


def main_list(q: HintedQueue):
    """ARC's T2 or S3-FIFO's M: where a block used twice lives."""
    return q.base._second


def first_list(q: HintedQueue):
    """ARC's T1 or S3-FIFO's S: where a fresh block enters."""
    return q.base._first


@pytest.mark.parametrize("base", ["arc", "s3fifo"])
@pytest.mark.parametrize("level", [CLOSED, PROTECTED])
def test_block_from_a_segment_is_fresh_when_pushed_again(base, level):
    pool, q = pool_with(base, 3)  # blocks 1 and 2; cap int(0.5 * 2) = 1
    b = reused_block(pool, 10)
    assert b in main_list(q)
    q.hint(np.array([10]), level, pool.get_cached_block)
    assert b not in q.base and b in (q._closed if level == CLOSED else q._protected)
    taken = pool.get_new_blocks(2)  # the unhashed block, then b from its segment
    assert taken[-1] == b and 10 not in pool
    assert list(q.base.remembered_keys()) == []  # not evicted from the base: no ghost
    pool.cache_block(b, 20)  # new content, a normal key
    pool.free_blocks(taken)
    assert b in first_list(q) and b not in main_list(q)  # fresh, not "back from a hit"
    pool.check_invariants()


@pytest.mark.parametrize("base", ["arc", "s3fifo"])
def test_block_from_a_segment_with_a_ghost_key_goes_to_main(base):
    pool, q = pool_with(base, 3)
    assert cache(pool, [30]) == [1]  # T1 / S
    assert pool.get_new_blocks(2) == [2, 1]  # block 1 leaves the base: key 30 is a ghost
    assert 30 in q.base.remembered_keys()
    pool.free_blocks([1, 2])  # both unhashed now
    b = reused_block(pool, 10)
    q.hint(np.array([10]), CLOSED, pool.get_cached_block)
    taken = pool.get_new_blocks(2)
    assert taken[-1] == b
    pool.cache_block(b, 30)
    pool.free_blocks([b])
    assert b in main_list(q)  # a ghost hit: ARC's B1 -> T2 (p grows), S3-FIFO's G -> M
    if base == "arc":
        assert q.base.p == 1
    pool.check_invariants()


@pytest.mark.parametrize("base", ["arc", "s3fifo"])
def test_demoted_and_unhinted_blocks_return_where_they_were(base):
    """A block the hints took out of the base and gave back keeps its place class."""
    pool, q = pool_with(base, 4)  # cap int(0.5 * 3) = 1
    fbo = pool.get_cached_block
    [fresh] = cache(pool, [1])
    hit = reused_block(pool, 2)
    assert fresh in first_list(q) and hit in main_list(q)
    q.hint(np.array([1, 2]), PROTECTED, fbo)  # the second demotes the first (cap 1)
    assert q.protect_overflow == 1 and list(q._protected) == [hit]
    assert fresh in first_list(q)
    q.hint(np.array([2]), NORMAL, fbo)
    assert hit in main_list(q)
    pool.check_invariants()


@pytest.mark.parametrize("base", ["arc", "s3fifo"])
def test_hit_while_protected_counts_as_reuse(base):
    pool, q = pool_with(base, 4)
    [b] = cache(pool, [1])  # T1 / S: used once
    q.hint(np.array([1]), PROTECTED, pool.get_cached_block)
    pool.touch([b], user="other")  # a real hit by another request
    pool.free_blocks([b])
    q.hint(np.array([1]), NORMAL, pool.get_cached_block)
    assert b in main_list(q)  # as without hints: used twice
