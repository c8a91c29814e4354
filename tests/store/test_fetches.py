"""The scheduler's part of the second tier (``StoreFetches``) over a store model, no engine: a
request waits for its fetch at most ``fetch_timeout_s`` (then runs without it, the fault
counted), a fetch lands in the CPU tier pinned until the request's next lookup, and a request
that finishes while waiting leaves nothing pinned."""

from __future__ import annotations

import numpy as np

from kvtriton.planner import OffloadPlanner
from kvtriton.pool import BlockPool
from kvtriton.records import Request
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.fetches import StoreFetches
from kvtriton.sim.second_tier import SimStore
from kvtriton.specs import FullAttentionSpec, KVLayout

LAYOUT = KVLayout([FullAttentionSpec(16, 1, 8, 1)])


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _setup(n_keys: int = 8):
    cpu = BlockPool(33)
    OffloadPlanner(LAYOUT, BlockPool(33), cpu)  # as in a server: the planner owns the pools
    store = SimStore(100)
    store.write(list(range(n_keys)))
    clock = _Clock()
    faults = FaultLog("test")
    return cpu, StoreFetches(LAYOUT, cpu, store.query, faults, 5.0, clock=clock), clock, faults


def _req(rid: str, n_keys: int = 8) -> Request:
    keys = np.arange(n_keys, dtype=np.int64)[None, :]
    return Request(rid, keys, num_prompt_tokens=16 * n_keys + 1, num_tokens=16 * n_keys + 1)


def test_a_request_waits_for_its_fetch_at_most_the_timeout():
    cpu, fetches, clock, faults = _setup()
    req = _req("a")
    assert fetches.extend(req, 0, 0)  # the store holds the prefix: a fetch, the request waits
    (f,) = fetches.issue()
    assert len(f.cpu) == 8 and cpu.num_used_blocks == 8
    clock.now = 4.9
    assert fetches.extend(req, 0, 0)
    clock.now = 5.1
    assert not fetches.extend(req, 0, 0) and faults.counts["timeout"] == 1
    fetches.apply({f.event: 1}, {}, world_size=1)  # it lands later: cached, pinned by nobody
    assert cpu.num_used_blocks == 0 and all(k in cpu for k in range(8))


def test_landed_blocks_stay_pinned_until_the_next_lookup():
    cpu, fetches, _, _ = _setup()
    req = _req("a")
    assert fetches.extend(req, 0, 0)
    (f,) = fetches.issue()
    fetches.apply({f.event: 1}, {}, world_size=1)
    assert cpu.num_used_blocks == 8  # cached, and still pinned for "a"
    assert not fetches.extend(req, 0, 8 * 16)  # its lookup now hits them: our pins go
    assert cpu.num_used_blocks == 0


def test_a_failed_block_is_not_cached_and_a_finished_request_leaves_nothing():
    cpu, fetches, _, _ = _setup()
    req = _req("a")
    assert fetches.extend(req, 0, 0)
    (f,) = fetches.issue()
    fetches.apply({f.event: 1}, {f.event: [2]}, world_size=1)
    assert [k in cpu for k in range(4)] == [True, True, False, True]
    fetches.forget("a")  # finished before its next lookup
    assert cpu.num_used_blocks == 0 and not fetches.has_pending()


def _gated(store: SimStore):
    """A query that answers only once its gate opens, and the record of what it was asked."""
    import threading

    gate, asked = threading.Event(), []

    def query(keys):
        asked.append(list(keys))
        gate.wait(10)
        return store.query(keys)

    return query, gate, asked


def test_a_lookup_waits_for_the_query_asked_ahead_and_never_asks_in_the_step():
    """With an executor the query runs when the request arrives; a lookup before its answer is
    back waits (counted) instead of asking the master in the step, then reads it; a request
    nobody asked about ahead has its lookup put the question to the executor and wait."""
    from concurrent.futures import ThreadPoolExecutor

    cpu = BlockPool(33)
    OffloadPlanner(LAYOUT, BlockPool(33), cpu)
    store = SimStore(100)
    store.write(list(range(8)))
    query, gate, asked = _gated(store)
    with ThreadPoolExecutor(1) as pool:
        fetches = StoreFetches(LAYOUT, cpu, query, FaultLog("test"), 5.0, executor=pool)
        fetches.prefetch("a", range(8))
        assert fetches.extend(_req("a"), 0, 0) and not fetches.issue()  # not back: it waits
        assert fetches.stats["second_tier_query_waits"] == 1
        gate.set()
        fetches._ahead["a"].answer.result()
        assert fetches.extend(_req("a"), 0, 0)  # back: the fetch is planned, the request waits
        (f,) = fetches.issue()
        assert sorted(f.keys) == list(range(8)) and len(asked) == 1
        assert fetches.stats["second_tier_queries_ahead"] == 1
        assert fetches.extend(_req("b"), 0, 0) and not fetches.issue()  # asked by its lookup
        fetches._ahead["b"].answer.result()
        assert len(asked) == 2 and fetches.stats["second_tier_queries_ahead"] == 1
        assert set(fetches.referenced_keys()) == set(range(8))
        fetches.forget("a")
        fetches.forget("b")


def test_a_query_not_back_by_the_timeout_lets_the_request_run_without_the_store():
    from concurrent.futures import ThreadPoolExecutor

    cpu = BlockPool(33)
    OffloadPlanner(LAYOUT, BlockPool(33), cpu)
    store = SimStore(100)
    store.write(list(range(8)))
    query, gate, _ = _gated(store)
    clock, faults = _Clock(), FaultLog("test")
    with ThreadPoolExecutor(1) as pool:
        fetches = StoreFetches(LAYOUT, cpu, query, faults, 5.0, clock=clock, executor=pool)
        fetches.prefetch("a", range(8))
        clock.now = 4.9
        assert fetches.extend(_req("a"), 0, 0)
        clock.now = 5.1
        assert not fetches.extend(_req("a"), 0, 0) and faults.counts["timeout"] == 1
        assert not fetches.extend(_req("a"), 0, 0)  # asked once: it does not ask again
        gate.set()
        assert cpu.num_used_blocks == 0 and not fetches.has_pending()


def test_a_request_waiting_for_its_fetch_or_answer_is_still_waiting_until_it_lands():
    """``still_waiting`` lets a lookup skip the CPU tier while nothing can have changed: true
    from the fetch's issue to its landing, and from a query's first "not back" to its answer;
    false for a request that never waited, and once the timeout passed."""
    from concurrent.futures import ThreadPoolExecutor

    _, fetches, clock, _ = _setup()
    assert not fetches.still_waiting("a")
    assert fetches.extend(_req("a"), 0, 0)
    (f,) = fetches.issue()
    assert fetches.still_waiting("a")
    clock.now = 5.1
    assert not fetches.still_waiting("a")  # past its deadline: the lookup runs, times out
    clock.now = 0.0
    fetches.apply({f.event: 1}, {}, world_size=1)
    assert not fetches.still_waiting("a")

    store = SimStore(100)
    store.write(list(range(8)))
    query, gate, _ = _gated(store)
    with ThreadPoolExecutor(1) as pool:
        waits = StoreFetches(LAYOUT, BlockPool(33), query, FaultLog("test"), 5.0, executor=pool)
        waits.prefetch("b", range(8))
        assert not waits.still_waiting("b")  # asked, but its lookup did not need it yet
        assert waits.extend(_req("b"), 0, 0) and waits.still_waiting("b")
        gate.set()
        waits._ahead["b"].answer.result()
        assert not waits.still_waiting("b")
        waits.forget("b")


def test_a_second_request_waits_for_the_fetch_of_the_blocks_it_shares_not_a_second_read():
    """Two waiting requests with one prefix: the second rides the first's fetch (one read of
    each block), both stay pinned on it until their own next lookup, and both then hit."""
    cpu, fetches, _, _ = _setup()
    a, b = _req("a"), _req("b")
    assert fetches.extend(a, 0, 0) and fetches.extend(b, 0, 0)
    (f,) = fetches.issue()  # one fetch: b reads nothing itself
    assert f.rid == "a" and f.riders == ["b"] and len(f.cpu) == 8
    assert fetches.still_waiting("b")
    fetches.apply({f.event: 1}, {}, world_size=1)
    assert all(cpu.ref_cnt[blk] == 2 for blk in f.cpu)  # a's pin and b's
    assert not fetches.extend(a, 0, 8 * 16)
    assert all(cpu.ref_cnt[blk] == 1 for blk in f.cpu)
    assert not fetches.extend(b, 0, 8 * 16)
    assert cpu.num_used_blocks == 0 and all(k in cpu for k in range(8))
    assert fetches.stats["second_tier_blocks_fetched"] == 8


def test_a_rider_whose_owner_finished_still_gets_the_blocks():
    cpu, fetches, _, _ = _setup()
    assert fetches.extend(_req("a"), 0, 0) and fetches.extend(_req("b"), 0, 0)
    fetches.forget("a")  # finished before its fetch went out: kept, b waits for it
    (f,) = fetches.issue()
    fetches.apply({f.event: 1}, {}, world_size=1)
    assert all(cpu.ref_cnt[blk] == 1 for blk in f.cpu)  # b's pin alone
    assert not fetches.extend(_req("b"), 0, 8 * 16)
    assert cpu.num_used_blocks == 0
    fetches.reset()
    assert not fetches.has_pending()


def test_a_later_round_asks_the_store_again_not_the_answer_from_arrival():
    """The answer asked on arrival serves the first fetch; a run asked again from earlier (the
    request's GPU prefix was evicted while it waited) gets a fresh query, since the replica may
    have written those blocks through after the request arrived."""
    from concurrent.futures import ThreadPoolExecutor

    cpu = BlockPool(33)
    OffloadPlanner(LAYOUT, BlockPool(33), cpu)
    store = SimStore(100)
    store.write(list(range(4, 8)))  # blocks 0-3 are on the GPU, not yet written through
    query, gate, asked = _gated(store)
    gate.set()
    with ThreadPoolExecutor(1) as pool:
        fetches = StoreFetches(LAYOUT, cpu, query, FaultLog("test"), 5.0, executor=pool)
        fetches.prefetch("a", range(8))
        fetches._ahead["a"].answer.result()
        req = _req("a")
        assert fetches.extend(req, 4 * 16, 0)  # GPU hit of 4 blocks: fetch blocks 4-7
        (f,) = fetches.issue()
        fetches.apply({f.event: 1}, {}, world_size=1)
        assert not fetches.extend(req, 4 * 16, 4 * 16) and len(asked) == 1
        store.write(list(range(4)))  # written through since
        assert fetches.extend(req, 0, 0)  # its GPU prefix went: asked again, not yet back
        fetches._ahead["a"].answer.result()
        assert len(asked) == 2 and fetches.extend(req, 0, 0)
        (g,) = fetches.issue()
        assert sorted(g.keys) == [0, 1, 2, 3]
        fetches.apply({g.event: 1}, {}, world_size=1)
        fetches.forget("a")
        assert cpu.num_used_blocks == 0


def test_queries_asked_while_the_helper_is_busy_go_to_the_store_in_one_call():
    import threading
    from concurrent.futures import ThreadPoolExecutor

    store = SimStore(100)
    store.write([1, 3, 5])
    calls = []

    def query(keys):
        calls.append(list(keys))
        return store.query(keys)

    busy = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fetches = StoreFetches(LAYOUT, BlockPool(33), query, FaultLog("test"), 5.0,
                               executor=pool)
        pool.submit(busy.wait, 10)  # the helper is in another call
        for rid, keys in (("a", [1, 2]), ("b", [2, 3]), ("c", [5])):
            fetches.prefetch(rid, keys)
        busy.set()
        answers = {rid: fetches._ahead[rid].answer.result(5).tolist() for rid in "abc"}
    assert calls == [[1, 2, 3, 5]]
    assert answers == {"a": [True, False], "b": [False, True], "c": [True]}
