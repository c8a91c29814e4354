"""Repeated touches are not reuse: a free block taken again by the user that took it last goes
back where it was in ARC (T1 stays T1) and S3-FIFO (no promotion from S, no extra frequency in
M); a touch by another user, or by ``user=None``, counts as reuse. The property spans the pool
(which remembers each block's last user), the queues (which honour ``reuse=False``) and the
planner (whose lookups name the request), so it is checked through each: the queues directly,
``BlockPool.touch``, and the planner's lookup of a waiting request."""

from __future__ import annotations

import pytest

from helpers.planner_driver import PlannerDriver, tokens_for
from kvtriton.eviction import ARCQueue, S3FIFOQueue
from kvtriton.pool import BlockPool


def where_arc(q: ARCQueue, b: int) -> str:
    return "T1" if b in q._first else "T2" if b in q._second else "unhashed" \
        if b in q._unhashed else "-"


def where_s3(q: S3FIFOQueue, b: int) -> str:
    return "S" if b in q._first else "M" if b in q._second else "unhashed" if b in q._unhashed \
        else "-"


def cached_block(pool: BlockPool, key: int, taker: object = None) -> int:
    """A block cached under ``key`` and freed. With ``taker``, the block is first taken by it
    from the free queue (``touch`` of a bare free block), as a request holding a new block, so
    that ``taker`` is its last user."""
    if taker is None:
        [b] = pool.get_new_blocks(1)
    else:
        b = next(pool.iter_free())
        pool.touch([b], user=taker)
    pool.cache_block(b, key)
    pool.free_blocks([b])
    return b


def hit(pool: BlockPool, b: int, user: object) -> None:
    pool.touch([b], user=user)
    assert not pool.is_free(b)
    pool.free_blocks([b])


# ---- the queues directly -------------------------------------------------------------------


def test_arc_queue_remove_without_reuse_keeps_t1():
    q = ARCQueue()
    q.reset(6)
    q.push(1, 10)
    q.push(2, 20)
    for _ in range(3):
        q.remove(1, reuse=False)
        q.push(1, 10)
        assert where_arc(q, 1) == "T1"
    q.remove(2, reuse=True)
    q.push(2, 20)
    assert where_arc(q, 2) == "T2"
    q.remove(2, reuse=False)  # a repeat on a T2 block: back to T2
    q.push(2, 20)
    assert where_arc(q, 2) == "T2"
    assert [q.pop(), q.pop()] == [1, 2] and q.ghost_sizes == (0, 0) and q.p == 0


def test_s3fifo_queue_remove_without_reuse_keeps_place_and_frequency():
    q = S3FIFOQueue()
    q.reset(12)
    q.push(1, 10)
    for _ in range(3):
        q.remove(1, reuse=False)
        q.push(1, 10)
        assert where_s3(q, 1) == "S"
    q.remove(1)  # reuse: promoted to M with frequency 0
    q.push(1, 10)
    assert where_s3(q, 1) == "M" and q._freq[1] == 0
    for _ in range(3):
        q.remove(1, reuse=False)
        q.push(1, 10)
        assert where_s3(q, 1) == "M" and q._freq[1] == 0
    q.remove(1)
    q.push(1, 10)
    assert q._freq[1] == 1


# ---- through BlockPool.touch ---------------------------------------------------------------


@pytest.mark.parametrize("users", [["r"] * 4, ["r", "q", "r", "q"], [None] * 4])
def test_arc_pool_repeat_touches_stay_in_t1(users):
    """Block 1's last user is ``r``. Touches by ``r`` alone keep it in T1, evicted before a
    really reused block; another user (or ``None``) promotes it to T2 on its first touch."""
    pool = BlockPool(8, eviction=ARCQueue())
    q = pool.eviction
    a = cached_block(pool, 100, taker="r")
    assert where_arc(q, a) == "T1"
    b = cached_block(pool, 200)
    hit(pool, b, "s")  # really reused: T2
    assert where_arc(q, b) == "T2"
    for u in users:
        hit(pool, a, u)
    repeated = users == ["r"] * 4
    assert where_arc(q, a) == ("T1" if repeated else "T2")
    tail = list(pool.iter_free())[-2:]
    assert tail == ([a, b] if repeated else [b, a])
    order = list(pool.iter_free())
    assert pool.get_new_blocks(len(order)) == order  # the pops agree
    assert q.ghost_sizes == ((1, 1) if repeated else (0, 2))
    pool.check_invariants()


def test_arc_pool_first_touch_by_a_user_is_reuse():
    """A block cached by a store (no user) and hit by ``r``: a genuine second use (T2); more
    touches by ``r`` keep it there and leave ``p`` and the ghosts alone."""
    pool = BlockPool(8, eviction=ARCQueue())
    q = pool.eviction
    a = cached_block(pool, 100)
    assert where_arc(q, a) == "T1"
    for _ in range(4):
        hit(pool, a, "r")
        assert where_arc(q, a) == "T2"
    assert q.p == 0 and q.ghost_sizes == (0, 0)


@pytest.mark.parametrize(("users", "place", "freq"), [
    (["r"] * 4, "S", 0),
    (["r", "q", "r", "q"], "M", 2),  # r: a repeat; q: promoted; r, q: two more reuses
    ([None] * 4, "M", 3),  # promoted, then three reuses (the cap)
])
def test_s3fifo_pool_repeat_touches_stay_in_small(users, place, freq):
    pool = BlockPool(12, eviction=S3FIFOQueue())
    q = pool.eviction
    a = cached_block(pool, 100, taker="r")
    assert where_s3(q, a) == "S"
    for u in users:
        hit(pool, a, u)
    assert where_s3(q, a) == place and q._freq[a] == freq
    pool.check_invariants()


@pytest.mark.parametrize("users", [["r"] * 4, ["r", "s", "t", "u"], [None] * 4])
def test_s3fifo_pool_repeat_touches_add_no_frequency(users):
    """A store's block hit by ``r`` is promoted to M (a real reuse) with frequency 0; more
    touches by ``r`` add nothing, so it goes before a block that entered M after it. Touches by
    other users raise its frequency and it outlives that block."""
    pool = BlockPool(12, eviction=S3FIFOQueue())
    q = pool.eviction
    a = cached_block(pool, 100)
    c = cached_block(pool, 300)
    for u in users:
        hit(pool, a, u)
    hit(pool, c, "z")  # in M after a, frequency 0
    repeated = users == ["r"] * 4
    assert where_s3(q, a) == where_s3(q, c) == "M"
    assert q._freq[a] == (0 if repeated else 3) and q._freq[c] == 0
    hashed = [b for b in pool.iter_free() if pool.block_hash(b) is not None]
    assert hashed == ([a, c] if repeated else [c, a])
    order = list(pool.iter_free())
    assert pool.get_new_blocks(len(order)) == order
    pool.check_invariants()


@pytest.mark.parametrize("queue", [ARCQueue, S3FIFOQueue])
def test_last_user_is_forgotten_on_eviction(queue):
    """A block whose hashes were evicted holds new content: the first touch by its old user is
    a reuse again."""
    pool = BlockPool(3, eviction=queue())
    q = pool.eviction
    a = cached_block(pool, 100, taker="r")
    assert pool.evict_cached(a)
    b = cached_block(pool, 200)  # a again: the unhashed block comes first
    assert b == a
    hit(pool, a, "r")
    assert (where_arc(q, a) if queue is ARCQueue else where_s3(q, a)) in ("T2", "M")


@pytest.mark.parametrize("queue", [ARCQueue, S3FIFOQueue])
def test_last_user_is_forgotten_on_reset(queue):
    pool = BlockPool(3, eviction=queue())
    q = pool.eviction
    a = cached_block(pool, 100, taker="r")
    assert pool.reset_prefix_cache()
    b = cached_block(pool, 200)
    assert b == a
    hit(pool, a, "r")  # new content, first touched by r
    assert (where_arc(q, a) if queue is ARCQueue else where_s3(q, a)) in ("T2", "M")


# ---- the planner: a waiting request looked up every step -----------------------------------


def stored_then_evicted_from_gpu(queue) -> tuple[PlannerDriver, list[int]]:
    """A planner driver whose CPU tier (``queue``) holds the 10 blocks of a finished request,
    none left on the GPU; returns the CPU blocks in chain order."""
    h = PlannerDriver(cpu=BlockPool(17, medium="CPU", eviction=queue()))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step({"a": a.num_tokens - a.num_computed_tokens})
    h.complete(h.step({"a": 1}))
    h.finish("a")
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)
    blocks = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(a)[:10]]
    assert None not in blocks
    return h, blocks


@pytest.mark.parametrize("queue", [ARCQueue, S3FIFOQueue])
@pytest.mark.parametrize("same_request", [True, False])
def test_waiting_request_lookups_do_not_promote(queue, same_request):
    """A waiting request's lookup pins its CPU hit, the next step's lookup unpins and pins it
    again: only the first pin is reuse. Lookups by different requests are each a reuse."""
    h, blocks = stored_then_evicted_from_gpu(queue)
    q = h.cpu.eviction
    where = where_arc if queue is ARCQueue else where_s3
    assert {where(q, b) for b in blocks} == {"T1" if queue is ARCQueue else "S"}
    reqs = ([h.request("c", tokens_for(1, 161))] * 4 if same_request
            else [h.request(f"c{i}", tokens_for(1, 161)) for i in range(4)])
    for i, req in enumerate(reqs):
        assert h.planner.get_num_new_matched_tokens(req, 0) == (160, True)
        assert all(h.cpu.ref_cnt[b] == 1 for b in blocks)  # pinned once, never twice
        if not same_request or i == len(reqs) - 1:
            h.planner.request_finished(req)
    assert all(h.cpu.is_free(b) for b in blocks)
    if queue is ARCQueue:  # the first lookup is a real hit either way: T2 (ARC has no more)
        assert {where(q, b) for b in blocks} == {"T2"}
        assert q.p == 0 and q.ghost_sizes == (0, 0)
    else:
        assert {where(q, b) for b in blocks} == {"M"}
        assert {int(q._freq[b]) for b in blocks} == {0 if same_request else 3}
    h.check_invariants()
