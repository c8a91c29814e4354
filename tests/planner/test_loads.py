"""The load lifecycle (``kvtriton.planner.loads``): the lookup and its last-block cap, pins held
from lookup to allocation, a hit accepted in part, loads into hybrid tables, a load abandoned by
a reset, and the refresh of the CPU copies on a GPU hit. A bad allocation or lookup is refused
before any pin moves, and leaves the planner, both pools and the selector as they were.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from helpers.planner_driver import (
    ALIAS_TINY,
    HYBRID_TINY,
    SCANS,
    PlannerDriver,
    cpu_blocks_of,
    evict_gpu_cache,
    lookup,
    store_prompt,
    stored_prompt,
    tokens_for,
)
from helpers.planner_state import (
    assert_unchanged,
    cpu_hit,
    finish_and_drain,
    raises_naming,
    run_hit,
    snapshot,
)
from kvtriton.eviction import ARCQueue, LRUQueue
from kvtriton.eviction.protected import PROTECTED, HintedQueue
from kvtriton.planner import PlannerConfig, ScanOutcomes, StepOutput
from kvtriton.pool import NULL_BLOCK, BlockPool

# ---- lookup, pins, a hit accepted in part --------------------------------------------------------


def test_last_block_is_never_hit():
    h = PlannerDriver()
    stored_prompt(h, "a", tokens_for(1, 160))  # exactly 10 blocks
    assert h.cpu_prefix_blocks(h.request("x", tokens_for(1, 160))) == 10
    assert lookup(h, "b", tokens_for(1, 160)) == 144  # the last token is recomputed
    assert lookup(h, "c", tokens_for(1, 161)) == 160
    assert lookup(h, "d", tokens_for(1, 160), computed=144) == 0
    assert lookup(h, "e", tokens_for(1, 160), computed=8) == 0  # not block aligned
    assert h.planner.stats.lookups_unaligned == 1
    assert h.cpu.num_used_blocks == 0


@pytest.mark.parametrize("fine_grained", [False, True])
def test_alias_keys_give_fine_grained_hits(fine_grained):
    h = PlannerDriver(ALIAS_TINY, config=PlannerConfig(fine_grained=fine_grained))
    stored_prompt(h, "a", tokens_for(1, 161))
    tokens = tokens_for(1, 48) + tokens_for(2, 52)  # shares three hash blocks with a
    assert lookup(h, "b", tokens) == (48 if fine_grained else 32)


def test_cpu_hit_pinned_between_lookup_and_allocation():
    """Touched (looked-up) CPU blocks survive eviction: a store that needs space takes only
    unpinned blocks and defers the rest; the later allocation loads the intact hit."""
    h = PlannerDriver(cpu=10)
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    evict_gpu_cache(h)
    keys = h.primary_keys(a)[:10].tolist()
    c = h.request("c", tokens_for(1, 64) + tokens_for(3, 36))
    assert h.planner.get_num_new_matched_tokens(c, 0) == (64, True)
    pinned = cpu_blocks_of(h, keys[:4])
    assert [h.cpu.ref_cnt[p] for p in pinned] == [1] * 4
    assert not any(h.cpu.evict_cached(p) for p in pinned)  # outside pressure cannot take them

    b = h.request("b", tokens_for(2, 161))
    h.admit(b)
    h.step({"b": 161})
    m = h.step({"b": 1})
    assert len(m.store) == 6 and not set(m.store.cpu_blocks) & set(pinned)
    assert h.planner.stats.scan == ScanOutcomes(stored=16, deferred=4)
    assert [k in h.cpu for k in keys] == [True] * 4 + [False] * 6
    h.complete(m)

    assert h.admit(c, ext=64) == (0, 64)
    m = h.step()
    assert m.load.cpu_blocks == pinned
    assert m.load.gpu_blocks == h.running["c"].tables[0][:4]
    h.complete(m)
    assert cpu_blocks_of(h, keys[:4]) == pinned
    h.check_invariants()


@pytest.mark.parametrize("scan", SCANS)
def test_partial_gpu_prefix_plus_cpu_load_accepting_fewer_blocks(scan):
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    keys = h.primary_keys(a)[:10].tolist()
    for k in keys[4:]:
        h.gpu.evict_cached(h.gpu.get_cached_block(k))
    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b, accept=32) == (64, 32)
    cpu = cpu_blocks_of(h, keys)
    assert [h.cpu.ref_cnt[c] for c in cpu] == [0] * 4 + [1, 1] + [0] * 4
    m = h.step()
    table = h.running["b"].tables[0]
    assert len(table) == 6 and b.num_computed_tokens == 96
    assert (m.load.gpu_blocks, m.load.cpu_blocks) == (table[4:6], cpu[4:6])
    assert h.planner.stats.cpu_hit_tokens == 32
    h.complete(m)
    m = h.step()
    assert m.store.event == -1
    assert h.planner.stats.scan == ScanOutcomes(stored=10, already_cached=6)
    h.check_invariants()


def test_multi_group_load_skips_null_blocks():
    h = PlannerDriver(HYBRID_TINY)
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    evict_gpu_cache(h)
    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b) == (0, 160)
    bt = h.running["b"].tables
    assert bt[1][:7] == [NULL_BLOCK] * 7  # out of the window at 160 tokens
    m = h.step()
    assert m.load.groups == [0] * 10 + [1] * 3
    assert m.load.gpu_blocks == bt[0][:10] + bt[1][7:10]
    assert m.load.cpu_blocks == (cpu_blocks_of(h, h.primary_keys(a, 0)[:10])
                                 + cpu_blocks_of(h, h.primary_keys(a, 1)[7:10]))
    h.complete(m)
    assert h.cpu.num_used_blocks == 0


def test_reset_releases_a_load_abandoned_before_the_same_request_loads_again():
    """A request looked up again after a reset gets a second load; the workers finish the
    abandoned one first, and its report must release the abandoned pins, not the new load's."""
    h = PlannerDriver(num_gpu_blocks=64)
    stored_prompt(h, "a", tokens_for(1, 65))
    h.finish("a")
    evict_gpu_cache(h)
    b = h.request("b", tokens_for(1, 65))
    h.admit(b)
    m0 = h.step()
    assert not h.planner.reset()
    h.abandon_tracking()
    b2 = h.request("b", tokens_for(1, 65))
    assert h.admit(b2) == (0, 64)
    cpu = m0.load.cpu_blocks
    assert [h.cpu.ref_cnt[c] for c in cpu] == [2] * 4
    h.planner.update_connector_output(finished_loads=["b"])  # the abandoned load (event 0)
    assert [h.cpu.ref_cnt[c] for c in cpu] == [1] * 4
    assert h.planner.load_pending("b") and h.planner.stats.stale_reports == 0
    m1 = h.step()
    assert m1.load.event == 1 and m1.load.cpu_blocks == cpu
    h.planner.update_connector_output(finished_loads=["b"])
    assert not h.planner.load_pending("b") and h.cpu.num_used_blocks == 0
    h.planner.update_connector_output(finished_loads=["b"])
    assert h.planner.stats.stale_reports == 1


# ---- a bad GPU table at allocation ---------------------------------------------------------------


# name -> (a bad block_ids from the table of 11 allocated blocks, a free block and the pool
# size, the text the message must show)
BAD_TABLES = {
    "null-first": (lambda t, free, n: ([NULL_BLOCK, *t[1:]],), "block id 0 (the null block)"),
    "null-last-loaded": (lambda t, free, n: ([*t[:9], NULL_BLOCK, t[10]],), "position 9"),
    "out-of-range": (lambda t, free, n: ([*t[:3], n, *t[4:]],), "block id 256 out of range"),
    "negative": (lambda t, free, n: ([-1, *t[1:]],), "block id -1 out of range"),
    "float-id": (lambda t, free, n: ([float(t[0]), *t[1:]],), ".0 is not an int"),
    "bool-id": (lambda t, free, n: ([True, *t[1:]],), "block id True is not an int"),
    "float-array": (lambda t, free, n: (np.asarray(t, dtype=np.float64),), "dtype float64"),
    "no-groups": (lambda t, free, n: (), "one GPU table per group (1), got 0 tables"),
    "two-groups": (lambda t, free, n: (t, t), "one GPU table per group (1), got 2 tables"),
    "flat-list": (lambda t, free, n: t, "one GPU table per group (1), got 11 tables"),
    "not-a-sequence": (lambda t, free, n: 7, "one GPU table per group (1), got 7"),
    "table-not-a-list": (lambda t, free, n: ("abc",), "expected a list of block ids, got str"),
    "too-short": (lambda t, free, n: (t[:5],), "table has 5 blocks, the load needs 10"),
    "duplicate": (lambda t, free, n: ([t[0], *t[:10]],), "is named twice where the load"),
    "free-block": (lambda t, free, n: ([free, *t[1:]],), "is free; a load writes only"),
}


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("bad", list(BAD_TABLES), ids=list(BAD_TABLES))
def test_bad_gpu_table_is_refused_before_any_pin(bad, scan):
    """The allocation's GPU table is checked before any pin is taken or released and before
    the request is admitted: a bad table (``block_ids=()`` too) is a ``ValueError`` and the hit
    stays pending, whole."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    req = cpu_hit(h)
    table = h.gpu.get_new_blocks(11)
    free = next(iter(h.gpu.iter_free()))
    make, text = BAD_TABLES[bad]
    block_ids = make(table, free, h.gpu.num_blocks)
    before = snapshot(h)
    with pytest.raises(ValueError, match=re.escape(text)):
        h.planner.update_state_after_alloc(req, block_ids, 160)
    assert_unchanged(h, before)
    assert h.planner.pending_hits() == ["b"]
    h.gpu.free_blocks(table)
    run_hit(h, req)  # the hit is still pinned and loads whole
    assert h.planner.stats.blocks_loaded == 10
    finish_and_drain(h)


@pytest.mark.parametrize("bad", [-16, 16.0, True, np.float64(160.0), "160", None, 17, 176])
def test_bad_num_external_tokens_is_refused_before_any_pin(bad):
    h = PlannerDriver()
    req = cpu_hit(h)
    table = h.gpu.get_new_blocks(11)
    before = snapshot(h)
    with raises_naming(bad):
        h.planner.update_state_after_alloc(req, (table,), bad)
    assert_unchanged(h, before)
    h.gpu.free_blocks(table)
    run_hit(h, req)
    finish_and_drain(h)


def test_hybrid_table_needs_real_blocks_only_where_the_load_writes():
    """A sliding-window group loads only the blocks of its window: null pages before it are
    fine, a null page inside it is refused (and changes nothing)."""
    h = PlannerDriver(HYBRID_TINY)
    req = cpu_hit(h)
    full, window = h.gpu.get_new_blocks(11), h.gpu.get_new_blocks(4)
    good = (full, [NULL_BLOCK] * 7 + window)  # the window of 160 tokens: positions 7 to 9
    bad = (full, [NULL_BLOCK] * 8 + window[1:])
    before = snapshot(h)
    with pytest.raises(ValueError, match=r"group 1 table holds block id 0 .* at position 7"):
        h.planner.update_state_after_alloc(req, bad, 160)
    with pytest.raises(ValueError, match=re.escape("one GPU table per group (2), got 1 tables")):
        h.planner.update_state_after_alloc(req, (full,), 160)
    assert_unchanged(h, before)
    h.planner.update_state_after_alloc(req, good, 160)
    load = h.planner.queued_loads()["b"]
    assert load.gpu_blocks == full[:10] + window[:3] and load.groups == [0] * 10 + [1] * 3
    m = h.planner.build_meta(StepOutput())
    h.planner.update_connector_output(finished_loads=["b"])
    assert m.load.event == 0 and not h.planner.load_pending("b")
    h.planner.request_finished(req)
    h.gpu.free_blocks(full + window)
    finish_and_drain(h)


# ---- a lookup outside the request, a second load for one request ---------------------------------


@pytest.mark.parametrize("bad", [-16, -1, 16.0, True, np.float64(0.0), "0", None, 162,
                                 np.int64(-16)], ids=repr)
def test_lookup_refuses_num_computed_tokens_outside_the_request(bad):
    """``num_computed_tokens`` outside ``[0, num_tokens]`` is refused before anything changes (a
    negative one would hit on the request's last key and load into the table's last block)."""
    h = PlannerDriver()
    req = cpu_hit(h)
    h.planner.request_finished(req)  # release that lookup's pins: start from no pending hit
    before = snapshot(h)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be an int in \[0, 161\].*"
                                         + re.escape(repr(bad))):
        h.planner.get_num_new_matched_tokens(req, bad)
    assert_unchanged(h, before)
    assert not h.planner.has_request("b")
    assert h.planner.get_num_new_matched_tokens(req, np.int64(0)) == (160, True)
    run_hit(h, req)
    finish_and_drain(h)


@pytest.mark.parametrize("scan", SCANS)
def test_second_load_for_one_request_is_refused(scan):
    """A request takes one load at a time (a second one would replace the first, leaking its
    pins, and the first load's report would complete the second): while its load is queued or
    in flight, another lookup or an allocation with external tokens is refused and changes
    nothing; an allocation with none (what vLLM sends once the load landed) is accepted and
    changes nothing."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    req = cpu_hit(h)
    assert h.admit(req, ext=160) == (0, 160)
    tables = tuple(h.running["b"].tables)

    def refused() -> None:
        before = snapshot(h)
        with pytest.raises(ValueError, match="not reported yet; a request takes one load"):
            h.planner.update_state_after_alloc(req, tables, 160)  # the same hit, twice
        with pytest.raises(ValueError, match="'b' waits for its CPU load"):
            h.planner.get_num_new_matched_tokens(req, 0)
        h.planner.update_state_after_alloc(req, tables, 0)
        assert_unchanged(h, before)

    refused()  # queued
    assert list(h.planner.queued_loads()) == ["b"]
    m = h.step()
    assert m.load_event_to_reqs == {0: ["b"]}
    refused()  # in flight
    h.complete(m)  # the one report completes the one load: nothing is left to complete early
    assert not h.planner.load_pending("b") and not h.planner.loads_in_flight()
    assert not h.planner.queued_loads() and h.cpu.num_used_blocks == 0
    assert h.planner.stats.blocks_loaded == 10
    h.step()
    h.check_invariants()
    finish_and_drain(h)


# ---- refresh of the CPU copies on a GPU hit ------------------------------------------------------


def _cpu_order_after_gpu_hit(refresh: bool) -> tuple[list[int], list[int], list[int]]:
    """a and c stored in that order (a's CPU blocks the next LRU victims); then b hits a's
    prefix in the GPU. Returns the CPU free order and a's and c's CPU blocks."""
    h = PlannerDriver(num_gpu_blocks=64, cpu=64, config=PlannerConfig(refresh_on_gpu_hit=refresh))
    a, _ = store_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    c, _ = store_prompt(h, "c", tokens_for(3, 161))
    h.finish("c")
    h.step()
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)  # GPU prefix hit on a's blocks
    a_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(a)[:10]]
    c_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(c)[:10]]
    order = [x for x in h.cpu.iter_free() if h.cpu.block_hash(x) is not None]
    h.check_invariants()
    return order, a_cpu, c_cpu


def test_a_gpu_hit_refreshes_the_cpu_copies_tail_first():
    order, a_cpu, c_cpu = _cpu_order_after_gpu_hit(refresh=True)
    # b's GPU hit covers a's 10 blocks: their copies are now newer than c's, chain head last.
    hit = a_cpu[:10]
    assert order[-len(hit):] == hit[::-1]
    assert max(order.index(x) for x in c_cpu) < min(order.index(x) for x in hit)


def test_without_refresh_the_cpu_order_is_store_time():
    order, a_cpu, c_cpu = _cpu_order_after_gpu_hit(refresh=False)
    assert order.index(a_cpu[0]) < order.index(c_cpu[0])  # negative control: a still first


def test_refresh_is_reuse_for_arc_once_per_request():
    h = PlannerDriver(num_gpu_blocks=64, cpu=BlockPool(64, eviction="arc", medium="CPU"),
                      config=PlannerConfig(refresh_on_gpu_hit=True))
    a, _ = store_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    q = h.cpu.eviction
    assert isinstance(q, ARCQueue)
    a_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(a)[:10]]
    assert all(x in q._first for x in a_cpu)  # T1
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)
    assert all(x in q._second for x in a_cpu)  # another request used them: reuse
    assert h.planner.stats.gpu_hit_refreshed == 10


# ---- a waiting request looked up again -----------------------------------------------------------


def _free_block_of(pool: BlockPool):
    def free_block(key: int) -> int | None:
        b = pool.get_cached_block(int(key))
        return b if b is not None and pool.is_free(b) else None
    return free_block


def _queue_state(h: PlannerDriver) -> tuple:
    q = h.cpu.eviction
    segments = (list(q._unhashed), list(q._closed), list(q.base.iter_blocks()),
                list(q._protected)) if isinstance(q, HintedQueue) else list(h.cpu.iter_free())
    return list(h.cpu.ref_cnt), segments, getattr(q, "protect_overflow", 0)


@pytest.mark.parametrize("hinted", [False, True], ids=["lru", "lru+hints"])
def test_a_waiting_request_looked_up_again_keeps_its_pins_in_place(hinted):
    """A waiting request is looked up every step with the same hit: its pins stay where they
    are. Releasing the hit and pinning it again would push each block through the free queue,
    and a full protected segment would demote another block for each protected one."""
    cpu = BlockPool(48, medium="CPU",
                    eviction=HintedQueue(LRUQueue(), 0.25) if hinted else "lru")
    h = PlannerDriver(cpu=cpu)
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    evict_gpu_cache(h)
    if hinted:  # a's blocks fill the protected segment past its cap of 11
        q = h.cpu.eviction
        q.hint(h.primary_keys(a)[:10], PROTECTED, _free_block_of(h.cpu))
        stored_prompt(h, "b", tokens_for(2, 65))
        h.finish("b")
        q.hint(h.primary_keys(h.request("b2", tokens_for(2, 65)))[:4], PROTECTED,
               _free_block_of(h.cpu))
        assert q.protected_blocks == 11 and q.protect_overflow == 3
    w = h.request("w", tokens_for(1, 161))
    assert h.planner.get_num_new_matched_tokens(w, 0) == (160, True)
    first = _queue_state(h)
    for _ in range(3):
        assert h.planner.get_num_new_matched_tokens(w, 0) == (160, True)
        assert _queue_state(h) == first
    # Negative control: the hit released and pinned anew does move the queue when it is hinted.
    pinned = cpu_blocks_of(h, h.primary_keys(a)[:10])
    h.cpu.free_blocks(pinned)
    h.cpu.touch(pinned, user="w")
    assert (_queue_state(h) != first) == hinted
    h.planner.request_finished(w)
    h.check_invariants()


def test_a_hit_that_grew_between_lookups_pins_each_block_once():
    """The hit of a waiting request grows as more of its prefix is stored: the new blocks are
    pinned, the kept ones are not pinned twice, and finishing releases every pin."""
    h = PlannerDriver(cpu=48)
    stored_prompt(h, "a", tokens_for(1, 81))
    h.finish("a")
    w = h.request("w", tokens_for(1, 161))
    assert h.planner.get_num_new_matched_tokens(w, 0) == (80, True)
    store_prompt(h, "b", tokens_for(1, 161))  # a GPU hit on a's 5 blocks, 5 more stored
    h.finish("b")
    evict_gpu_cache(h)
    assert h.planner.get_num_new_matched_tokens(w, 0) == (160, True)
    hit = cpu_blocks_of(h, h.primary_keys(w)[:10])
    assert [h.cpu.ref_cnt[b] for b in hit] == [1] * 10
    assert sum(h.cpu.ref_cnt) == 10
    h.planner.request_finished(w)
    assert sum(h.cpu.ref_cnt) == 0
    h.check_invariants()


def test_a_lookup_that_raises_leaves_no_pin_of_the_stale_hit(monkeypatch):
    """A waiting request's pins are kept across its lookups; a lookup that fails releases the
    stale hit as a lookup always did, so no pin outlives the hit it belonged to."""
    import kvtriton.planner.loads as loads_module

    h = PlannerDriver(cpu=48)
    stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    evict_gpu_cache(h)
    w = h.request("w", tokens_for(1, 161))
    assert h.planner.get_num_new_matched_tokens(w, 0) == (160, True)
    assert sum(h.cpu.ref_cnt) == 10

    def broken(*args, **kwargs):
        raise ValueError("lookup failed")

    monkeypatch.setattr(loads_module, "find_longest_hit", broken)
    with pytest.raises(ValueError, match="lookup failed"):
        h.planner.get_num_new_matched_tokens(w, 0)
    assert sum(h.cpu.ref_cnt) == 0 and "w" not in h.planner.pending_hits()
    monkeypatch.undo()
    assert h.planner.get_num_new_matched_tokens(w, 0) == (160, True)
    h.planner.request_finished(w)
    h.check_invariants()
