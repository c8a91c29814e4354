"""vLLM 0.33's offloading eviction as kvtriton queues: ``reqlru`` and ``reqarc``'s own rules, the
planner's calls that reach them, and the differential against vLLM 0.33's policy classes
(``bench.conformance.native_policies``; it skips without a vLLM 0.33 tree at
``KVTRITON_VLLM033_PATH``).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.conformance.native_policies import (
    BLOCK_TOKENS,
    KvtritonSide,
    compare,
    first_difference,
    random_events,
    replay_kvtriton,
    vllm033_problem,
)
from helpers.planner_driver import PlannerDriver, stored_prompt, tokens_for
from helpers.queue_ops import OPS, drain_order, run_ops
from kvtriton.eviction import (
    HintedQueue,
    RequestARCQueue,
    RequestLRUQueue,
    make_eviction_queue,
)
from kvtriton.eviction.base import request_observer
from kvtriton.planner import PlannerConfig
from kvtriton.pool import BlockPool
from kvtriton.setups import parse_setup

QUEUES = ["reqlru", "reqarc"]


# ---- helpers -------------------------------------------------------------------------------------


def tier(name: str, blocks: int) -> tuple[BlockPool, RequestLRUQueue | RequestARCQueue]:
    pool = BlockPool(blocks + 1, eviction=name, medium="CPU")
    return pool, pool.eviction


def admit(queue, rid: str, keys: list[int]) -> None:
    """``rid`` holds ``keys``, head to tail, one 16-token block each."""
    queue.on_request_admitted(rid, np.array(keys), BLOCK_TOKENS * np.arange(1, len(keys) + 1))


def start_store(pool: BlockPool, keys: list[int]) -> list[int]:
    pool.eviction.on_store_started(keys)
    return pool.get_new_blocks(len(keys))


def land(pool: BlockPool, blocks: list[int], keys: list[int], ok: bool = True) -> None:
    if ok:
        pool.cache_blocks(blocks, [(k,) for k in keys])
    pool.free_blocks(blocks)  # head first: the order must not matter


def store(pool: BlockPool, keys: list[int]) -> None:
    land(pool, start_store(pool, keys), keys)


def order(pool: BlockPool) -> list[int]:
    """Cached free keys, next victim first (and the queue pops them so)."""
    keys = [pool.block_hash(b) for b in pool.iter_free()]
    assert [pool.block_hash(b) for b in drain_order(pool.eviction)] == keys
    return [k for k in keys if k is not None]


def hit(pool: BlockPool, key: int, user: str) -> None:
    b = pool.get_cached_block(key)
    pool.touch([b], user=user)
    pool.free_blocks([b])


# ---- reqlru --------------------------------------------------------------------------------------


def test_a_request_s_tail_goes_before_its_head():
    pool, q = tier("reqlru", 8)
    admit(q, "r1", [1, 2, 3, 4])
    store(pool, [1, 2, 3, 4])
    assert order(pool) == [4, 3, 2, 1]
    assert q.rank_of(4) == (1, -4 * BLOCK_TOKENS)  # vLLM's (request rank, -position)


def test_requests_rank_by_admission_until_a_finish_commits_tail_first():
    pool, q = tier("reqlru", 8)
    admit(q, "r1", [1, 2])
    admit(q, "r2", [3, 4])
    store(pool, [3, 4])
    store(pool, [1, 2])
    assert order(pool) == [2, 1, 4, 3]  # store order does not matter, admission does
    q.on_request_finished("r1", 2 * BLOCK_TOKENS)
    assert order(pool) == [4, 3, 2, 1]  # committed: newer than r2's provisional rank
    q.on_request_finished("r2", 2 * BLOCK_TOKENS)
    assert order(pool) == [2, 1, 4, 3]


def test_a_hit_changes_nothing_where_lru_refreshes():
    for name, want in (("reqlru", [4, 3, 2, 1]), ("lru", [3, 2, 1, 4])):
        pool, q = tier(name, 8)
        keys = [1, 2, 3, 4]
        if name == "reqlru":
            admit(q, "r1", keys)
        blocks = pool.get_new_blocks(4)
        land(pool, blocks[::-1], keys[::-1])  # lru: freed tail first
        hit(pool, 4, "r2")
        assert order(pool) == want, name


def test_a_newer_request_holding_a_cached_key_re_ranks_it():
    pool, q = tier("reqlru", 8)
    admit(q, "r1", [1, 2])
    store(pool, [1, 2])
    q.on_request_finished("r1", 99)
    admit(q, "r0", [5])
    store(pool, [5])
    q.on_request_finished("r0", 99)
    assert order(pool) == [2, 1, 5]
    admit(q, "r2", [1, 9])  # holds key 1 (its prefix) and key 9 (not cached)
    assert order(pool) == [2, 5, 1]
    assert q.rank_of(1) == (6, -BLOCK_TOKENS)  # r1 1, its commit 2-3, r0 4, its commit 5


def test_a_finish_commits_only_the_computed_keys():
    pool, q = tier("reqlru", 8)
    admit(q, "r1", [1, 2, 3, 4])
    admit(q, "r2", [5])
    store(pool, [1, 2, 3, 4])
    store(pool, [5])
    q.on_request_finished("r1", 2 * BLOCK_TOKENS)
    assert order(pool) == [4, 3, 5, 2, 1]


def test_a_store_is_ranked_for_the_newest_live_holder_or_newest_of_all():
    pool, q = tier("reqlru", 8)
    admit(q, "r1", [1, 2])
    admit(q, "r2", [3, 1])
    store(pool, [1])
    assert q.rank_of(1) == (2, -2 * BLOCK_TOKENS)  # r2's claim, at r2's position of key 1
    store(pool, [7])  # nobody holds it: a new rank, the newest
    assert q.rank_of(7) == (3, 0)
    assert order(pool) == [1, 7]


def test_a_key_in_flight_at_its_request_s_finish_takes_the_commit():
    for finish_first, want in ((False, [2, 1, 3]), (True, [3, 2, 1])):
        pool, q = tier("reqlru", 8)
        admit(q, "r1", [1, 2])
        admit(q, "r2", [3])
        store(pool, [3])
        blocks = start_store(pool, [1, 2])  # the finish flush, in flight
        if finish_first:
            q.on_request_finished("r1", 99)
        land(pool, blocks, [1, 2])
        assert order(pool) == want, finish_first


def test_a_failed_store_drops_its_keys_and_its_blocks_go_first():
    pool, q = tier("reqlru", 3)
    admit(q, "r1", [1, 2, 3])
    store(pool, [1])
    blocks = start_store(pool, [2, 3])
    assert q.is_cached(2) and q.rank_of(2) is not None  # cached from the store's start
    land(pool, blocks, [2, 3], ok=False)
    assert not q.is_cached(2) and q.rank_of(2) is None
    assert sorted(pool.get_new_blocks(2)) == sorted(blocks)
    assert 1 in pool


# ---- reqarc --------------------------------------------------------------------------------------


def test_reqarc_counts_a_request_s_use_at_its_finish():
    pool, q = tier("reqarc", 8)
    admit(q, "r0", [1, 2])
    store(pool, [1, 2])
    q.on_request_finished("r0", 99)
    assert q.lists() == ([2, 1], [])  # stored for r0: T1, moved to MRU tail first
    admit(q, "r1", [1, 5])  # key 1 cached and ready: a reuse (a GPU prefix hit counts too)
    hit(pool, 1, "r1")
    store(pool, [5])
    assert q.lists() == ([2, 1, 5], [])  # nothing moves before the finish
    q.on_request_finished("r1", 99)
    assert q.lists() == ([2, 5], [1])


def test_reqarc_ghost_hit_adapts_before_the_store_evicts_and_enters_t1():
    pool, q = tier("reqarc", 2)
    for rid, key in (("r1", 1), ("r2", 2), ("r3", 3)):
        admit(q, rid, [key])
        store(pool, [key])
        q.on_request_finished(rid, 99)
    assert q.lists() == ([2, 3], []) and q.ghost_sizes == (1, 0)  # key 1 went to B1
    q.on_store_started([1])
    assert q.target == 1.0  # adapted before any eviction for this store
    land(pool, pool.get_new_blocks(1), [1])
    assert q.lists() == ([3, 1], [])  # back in T1 (kvtriton's arc: T2)


def test_reqarc_takes_t1_while_it_holds_at_least_the_target():
    pool, q = tier("reqarc", 4)
    admit(q, "r1", [1, 2, 3, 4])
    store(pool, [1, 2, 3, 4])
    q.on_request_finished("r1", 99)
    assert q.lists() == ([4, 3, 2, 1], [])
    admit(q, "r2", [1, 2])
    q.on_request_finished("r2", 99)  # both reused: to T2, tail first
    q.target = 2.0
    assert q.lists() == ([4, 3], [2, 1])
    assert order(pool) == [4, 2, 1, 3]  # |T1| 2 >= 2: T1; then 1 < 2: T2, T2; then T1


# ---- the protocol, both queues -------------------------------------------------------------------


@pytest.mark.parametrize("name", QUEUES)
@given(ops=OPS, num_blocks=st.integers(2, 12))
def test_pool_invariants_hold_without_any_request(name, ops, num_blocks):
    pool = BlockPool(num_blocks, eviction=name)
    run_ops(pool, ops)
    pool.check_invariants()
    assert list(pool.iter_free()) == drain_order(pool.eviction)


@pytest.mark.parametrize("name", QUEUES)
def test_iter_free_is_the_pop_order_along_random_sequences(name):
    for seed in range(4):
        capacity, events = random_events(seed, name, num_events=120)
        side = KvtritonSide(name, capacity)
        for i, ev in enumerate(events):
            side.apply(ev)
            if i % 7 == 0:
                side.pool.check_invariants()
                assert list(side.pool.iter_free()) == drain_order(side.queue)


def test_a_wrapping_queue_passes_the_lifetimes_to_the_queue_it_wraps():
    base = make_eviction_queue("reqlru")
    assert request_observer(HintedQueue(base, 0.5)) is base
    assert request_observer(make_eviction_queue("lru")) is None
    assert request_observer(HintedQueue(make_eviction_queue("arc"), 0.5)) is None


class _Spy(RequestLRUQueue):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_request_admitted(self, request_id, keys, positions):
        self.calls.append(("admitted", request_id, keys.tolist(), positions.tolist()))
        super().on_request_admitted(request_id, keys, positions)

    def on_store_started(self, keys):
        self.calls.append(("store", [int(k) for k in keys]))
        super().on_store_started(keys)

    def on_request_finished(self, request_id, num_tokens):
        self.calls.append(("finished", request_id, num_tokens))
        super().on_request_finished(request_id, num_tokens)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_the_planner_tells_the_queue_of_admission_stores_and_finish(lazy):
    spy = _Spy()
    cpu = BlockPool(17, eviction=HintedQueue(spy, 0.5) if not lazy else spy, medium="CPU")
    h = PlannerDriver(cpu=cpu, config=PlannerConfig(lazy=lazy, cpu_free_order="head_first"))
    req, _ = stored_prompt(h, "a", tokens_for(1, 64))
    keys = h.primary_keys(req).tolist()
    h.finish("a")
    h.complete_all()
    assert spy.calls[0] == ("admitted", "a", keys, [16, 32, 48, 64])
    assert spy.calls[-1] == ("finished", "a", req.num_computed_tokens)
    if not lazy:
        # The stores name their keys first: the prompt's four blocks, tail first in the tier.
        assert [k for c in spy.calls if c[0] == "store" for k in c[1]] == keys
        assert order(cpu) == keys[::-1]


def test_a_planner_reset_forgets_the_queue_s_requests_uncommitted():
    spy = _Spy()
    h = PlannerDriver(cpu=BlockPool(17, eviction=spy, medium="CPU"))
    req = h.request("a", tokens_for(1, 64))
    h.admit(req)
    h.step()
    meta = h.step({"a": 1})  # stores the prompt
    assert meta.store.event >= 0 and spy.is_cached(int(h.primary_keys(req)[0]))
    assert not h.planner.reset()  # a store in flight: the CPU cache stays, the requests go
    assert spy.calls[-1] == ("finished", "a", 0) and not spy._requests and not spy._claims
    h.complete(meta)  # abandoned: nothing cached
    h.abandon_tracking()
    h.cpu.check_invariants()
    assert not any(spy.is_cached(k) for k in h.primary_keys(req).tolist())


def test_parse_setup_names_the_queues():
    for name, words in (("reqlru", "request-scoped LRU"), ("reqarc", "request-scoped ARC")):
        p = parse_setup(f"eager+{name}")
        assert (p.cpu_eviction, p.composition) == (name, f"eager+{name}")
        assert parse_setup(p.composition) == p and words in p.description
        with pytest.raises(ValueError, match="never evicts"):
            parse_setup(f"eager+{name}+inf")


# ---- the differential ----------------------------------------------------------------------------


def test_random_events_are_seeded():
    assert random_events(3, "reqlru") == random_events(3, "reqlru")
    assert random_events(3, "reqlru") != random_events(4, "reqlru")


def test_a_perturbed_eviction_order_is_found():
    capacity, events = random_events(0, "reqlru", num_events=200)
    trace = replay_kvtriton("reqlru", capacity, events)
    assert first_difference(events, trace, trace) is None
    i = next(i for i, evicted in enumerate(trace[:-1]) if len(evicted) >= 2)
    bad = [list(t) for t in trace]
    bad[i][0], bad[i][1] = bad[i][1], bad[i][0]
    where = first_difference(events, bad, trace)
    assert where is not None and where.startswith("store ")
    bad = [list(t) for t in trace]
    bad[-1] = bad[-1][::-1]
    assert first_difference(events, bad, trace).startswith("drain")


class _HeadFirstCommit(RequestLRUQueue):
    """Negative control: a finish commits head first (the head would be evicted first)."""

    def _finished(self, life, used):
        super()._finished(life, used[::-1])


class _GhostIntoT2(RequestARCQueue):
    """Negative control: a ghost hit enters T2, as kvtriton's ``arc`` does."""

    def _cached(self, key, storer, position, announced):
        ghost = key in self._b1 or key in self._b2
        super()._cached(key, storer, position, announced)
        if ghost:
            del self._t1[key]
            self._t2[key] = None


SEEDS = range(24)
CONFIGS = [("lru", "reqlru", None), ("arc", "reqarc", None),
           ("lru", "reqlru", _HeadFirstCommit), ("arc", "reqarc", _GhostIntoT2),
           ("lru", "lru", None), ("arc", "arc", None)]


@pytest.fixture(scope="module")
def rows():
    problem = vllm033_problem()
    if problem is not None:
        pytest.skip(problem)
    return compare(CONFIGS, SEEDS, num_events=200)


@pytest.mark.parametrize("i", [0, 1], ids=["lru", "arc"])
def test_kvtriton_evicts_as_vllm_033_does(rows, i):
    row = rows[i]
    assert row["evictions"] > 1000  # the tier was under pressure
    assert row["differences"] == {}, row["differences"]


@pytest.mark.parametrize("i", [2, 3, 4, 5], ids=["head-first-commit", "ghost-into-t2",
                                                 "kvtriton-lru", "kvtriton-arc"])
def test_another_order_is_caught(rows, i):
    assert len(rows[i]["differences"]) >= len(SEEDS) // 2, rows[i]
