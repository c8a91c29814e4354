"""``OffloadPlanner`` scenarios: vLLM's SimpleCPUOffload scheduler tests re-expressed for kvtriton,
seeds 000 and 003, the policy switches, the stats, and bad input.

Every test drives the planner through ``planner_harness.Harness`` (a tiny scheduler) and asserts
exact block ids, token counts and counters. A 161-token prompt with 16-token blocks has 10 full
blocks; the step that prefills it does not store it (``build_meta`` runs before the step's tokens
count), the next step does.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from planner_harness import ALIAS_TINY, HYBRID_TINY, LLAMA_TINY, Harness, tokens_for

from kvtriton.planner import PlannerConfig, ScanOutcomes, StepOutput
from kvtriton.pool import NULL_BLOCK

SCANS = ["fused", "loop"]


def cfg(**kw) -> PlannerConfig:
    return PlannerConfig(**kw)


def stored_prompt(h: Harness, rid: str, tokens: list[int], *, complete: bool = True):
    """Admit, prefill and decode one step (which stores the prompt's full blocks)."""
    req = h.request(rid, tokens)
    h.admit(req)
    h.step({rid: req.num_tokens - req.num_computed_tokens})
    meta = h.step({rid: 1})
    if complete:
        h.complete(meta)
    return req, meta


def evict_gpu_cache(h: Harness) -> None:
    """Drop every free cached GPU block (outside pressure on the GPU prefix cache)."""
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)


def cpu_blocks_of(h: Harness, keys) -> list[int]:
    return [h.cpu.get_cached_block(int(k)) for k in keys]


def lookup(h: Harness, rid: str, tokens: list[int], computed: int = 0) -> int:
    """CPU hit tokens of a fresh request; its pins are released again."""
    req = h.request(rid, tokens)
    hit, _ = h.planner.get_num_new_matched_tokens(req, computed)
    h.planner.request_finished(req)
    return hit


def pool_snapshot(h: Harness):
    return (list(h.cpu.ref_cnt), [h.cpu.block_keys(b) for b in range(h.cpu.num_blocks)],
            list(h.gpu.ref_cnt), [h.gpu.block_keys(b) for b in range(h.gpu.num_blocks)])


# ---- round trips, the last-block cap ---------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_eager_store_then_load_round_trip(scan):
    h = Harness(config=cfg(scan=scan))
    a = h.request("a", tokens_for(1, 161))
    assert h.admit(a) == (0, 0)
    prefill = h.step()
    assert prefill.store.event == -1 and prefill.load.event == -1
    m = h.step(decode=True)
    table = h.running["a"].tables[0]
    assert (m.store.event, m.store.gpu_blocks, m.store.cpu_blocks, m.store.groups) == (
        0, table[:10], list(range(1, 11)), [0] * 10)
    assert h.planner.cursor("a") == 10
    h.complete(m)
    assert cpu_blocks_of(h, h.primary_keys(a)[:10]) == list(range(1, 11))
    h.finish("a")
    assert not h.planner.has_pending_stores()
    evict_gpu_cache(h)

    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b) == (0, 160)
    m = h.step()  # b waits for its load: not scheduled
    btable = h.running["b"].tables[0]
    assert (m.load.event, m.load.gpu_blocks, m.load.cpu_blocks, m.load.groups) == (
        0, btable[:10], list(range(1, 11)), [0] * 10)
    assert m.load_event_to_reqs == {0: ["b"]} and m.store.event == -1
    assert h.planner.load_pending("b") and h.cpu.num_used_blocks == 10
    h.complete(m)
    assert not h.planner.load_pending("b") and h.cpu.num_used_blocks == 0
    m = h.step()  # the last prompt token
    assert m.store.event == -1 and h.planner.cursor("b") == 10
    s = h.planner.stats
    assert (s.cpu_hit_tokens, s.loads_issued, s.blocks_loaded, s.stores_completed,
            s.blocks_stored) == (160, 1, 10, 1, 10)
    assert s.scan == ScanOutcomes(stored=10, already_cached=10)
    h.check_invariants()


def test_lazy_store_then_load_round_trip():
    h = Harness(num_gpu_blocks=32, config=cfg(lazy=True, lazy_target_blocks=64))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    assert h.step().store.event == -1
    assert h.step(decode=True).store.event == -1  # a's blocks are referenced: nothing to offload
    table = h.running["a"].tables[0]
    h.finish("a")  # freed tail first: the free queue ends ..., table[9], ..., table[0]
    m = h.step()
    assert m.store.gpu_blocks == table[:10][::-1]
    assert m.store.cpu_blocks == list(range(1, 11))
    assert h.planner.stats.lazy_stored == 10
    assert h.step().store.event == -1  # in flight: not offloaded twice
    h.complete(m)
    assert h.step().store.event == -1  # now cached on the CPU
    assert h.cpu_prefix_blocks(a) == 10
    with pytest.raises(ValueError, match="no store cursor"):
        h.planner.cursor("a")

    evict_gpu_cache(h)
    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b) == (0, 160)
    m = h.step()
    assert m.load.gpu_blocks == h.running["b"].tables[0][:10]
    assert m.load.cpu_blocks == cpu_blocks_of(h, h.primary_keys(a)[:10])
    h.complete(m)
    assert h.planner.stats.blocks_loaded == 10 and h.cpu.num_used_blocks == 0
    h.check_invariants()


def test_lazy_walk_covers_target_blocks_per_step():
    """The walk counts every free block it passes (hashed or not) against the target and
    resumes after its cursor, or from the head when the cursor block left the free queue (as
    the seed's does; the cursor is the last block walked, so a stored one resets it)."""
    h = Harness(num_gpu_blocks=16, config=cfg(lazy=True, lazy_target_blocks=4))
    stored_prompt(h, "a", tokens_for(1, 161))  # the prefill step walked 12..15: cursor 15
    table = h.running["a"].tables[0]
    assert table == list(range(1, 12))
    h.finish("a")
    assert list(h.gpu.iter_free()) == [11, 12, 13, 14, 15, *table[:10][::-1]]
    stores = [h.step().store.gpu_blocks for _ in range(6)]
    assert stores == [[10, 9, 8, 7], [], [6, 5, 4], [], [3, 2, 1], []]
    assert h.planner.stats.lazy_stored == 10


def test_lazy_walk_restarts_after_a_stored_cursor_block_came_back():
    """The same walk with every store reported before the next step: a stored block rejoins
    the free queue at its tail, so a walk resuming after it (the stored cursor) would find
    nothing left and never reach 6..1; it starts from the head again instead."""
    h = Harness(num_gpu_blocks=16, config=cfg(lazy=True, lazy_target_blocks=4))
    stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    stores = []
    for _ in range(6):
        m = h.step()
        stores.append(m.store.gpu_blocks)
        h.complete(m)
    assert stores == [[10, 9, 8, 7], [], [6, 5, 4], [], [3, 2, 1], []]
    assert h.planner.stats.lazy_stored == 10 and h.cpu.num_cached_keys == 10


def test_lazy_hybrid_stores_name_each_blocks_group_and_serve_a_hit():
    """Lazy mode on full attention + a 40-token window: window pages that left the window while
    the request ran are offloaded as they near eviction, the rest once it finishes, each with
    the group it was cached for; the next request's hit loads both groups."""
    h = Harness(HYBRID_TINY, num_gpu_blocks=48, config=cfg(lazy=True, lazy_target_blocks=64),
                free_out_of_window=True)
    a = h.request("a", tokens_for(1, 97))
    h.admit(a)
    h.step()
    full, window = (list(t) for t in h.running["a"].tables)
    assert window[:3] == [NULL_BLOCK] * 3  # pages 0..2 left the window: freed, hashed
    m = h.step(decode=True)
    assert (m.store.gpu_blocks, m.store.groups) == ([10, 9, 8], [1, 1, 1])  # last page first
    h.complete(m)
    h.finish("a")
    m = h.step()
    assert m.store.gpu_blocks == full[:6][::-1] + window[3:6][::-1]
    assert m.store.groups == [0] * 6 + [1] * 3
    assert [h.gpu.block_group(b) for b in m.store.gpu_blocks] == m.store.groups
    h.complete(m)
    for g in (0, 1):
        for k in h.primary_keys(a, g)[:6].tolist():
            assert h.cpu.block_group(h.cpu.get_cached_block(k)) == g
    evict_gpu_cache(h)
    b = h.request("b", tokens_for(1, 97))
    assert h.admit(b) == (0, 96)
    m = h.step()
    assert m.load.groups == [0] * 6 + [1] * 3  # the window before token 96: pages 3..5
    tables = h.running["b"].tables
    assert m.load.gpu_blocks == tables[0][:6] + tables[1][3:6]
    assert m.load.cpu_blocks == cpu_blocks_of(h, h.primary_keys(b, 0)[:6]) + cpu_blocks_of(
        h, h.primary_keys(b, 1)[3:6])
    h.complete(m)
    assert h.planner.stats.lazy_stored == 12 and h.planner.stats.cpu_hit_tokens == 96
    h.check_invariants()


def test_lazy_never_guesses_a_blocks_group():
    """A hashed GPU block whose pool does not name its group is skipped on a layout of several
    groups (a wrong group would copy another group's bytes) and is group 0 on a single-group
    layout; a GPU pool that cannot name groups at all is refused for lazy hybrid layouts."""
    from kvtriton.planner import OffloadPlanner
    from kvtriton.pool import BlockPool

    def offload(layout, group_idx):
        gpu = BlockPool(8)
        planner = OffloadPlanner(layout, gpu, 4, cfg(lazy=True))
        b = gpu.get_new_blocks(1)
        gpu.cache_block(b[0], 7, group_idx=group_idx)
        gpu.free_blocks(b)
        store = planner.build_meta(StepOutput()).store
        return store.gpu_blocks, store.groups

    assert offload(HYBRID_TINY, None) == ([], [])
    assert offload(HYBRID_TINY, 1) == ([1], [1])
    assert offload(HYBRID_TINY, 2) == ([], [])  # a group the layout lacks
    assert offload(LLAMA_TINY, None) == ([1], [0])
    blind = BlockPool(8)
    blind.block_group = None
    with pytest.raises(ValueError, match="lazy mode on a layout of 2 groups needs a GPU pool "
                                         "that knows each block's group"):
        OffloadPlanner(HYBRID_TINY, blind, 4, cfg(lazy=True))
    OffloadPlanner(HYBRID_TINY, BlockPool(8), 4, cfg())  # eager mode does not ask


def test_pool_keeps_a_blocks_group_until_its_hashes_go():
    """``cache_block``'s ``group_idx`` is the block's group until the block is handed out again
    or the prefix cache is reset; a bad one is refused before anything changes."""
    from kvtriton.pool import BlockPool

    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 10, group_idx=1)
    pool.cache_block(b, 11)
    assert (pool.block_group(a), pool.block_group(b)) == (1, None)
    with pytest.raises(ValueError, match=f"group_idx -1 of block {c} is not a non-negative int"):
        pool.cache_block(c, 12, group_idx=-1)
    assert pool.block_hash(c) is None and 12 not in pool
    pool.free_blocks([a, b, c])
    assert pool.block_group(a) == 1  # free and still cached: still its group
    pool.get_new_blocks(3)  # evicts both
    assert (pool.block_group(a), pool.block_group(b)) == (None, None)
    pool.check_invariants()
    pool = BlockPool(4)
    c = pool.get_new_blocks(1)
    pool.cache_block(c[0], 10, group_idx=2)
    pool.free_blocks(c)
    assert pool.reset_prefix_cache() and pool.block_group(c[0]) is None


def test_last_block_is_never_hit():
    h = Harness()
    stored_prompt(h, "a", tokens_for(1, 160))  # exactly 10 blocks
    assert h.cpu_prefix_blocks(h.request("x", tokens_for(1, 160))) == 10
    assert lookup(h, "b", tokens_for(1, 160)) == 144  # the last token is recomputed
    assert lookup(h, "c", tokens_for(1, 161)) == 160
    assert lookup(h, "d", tokens_for(1, 160), computed=144) == 0
    assert lookup(h, "e", tokens_for(1, 160), computed=8) == 0  # not block aligned
    assert h.planner.stats.lookups_unaligned == 1
    assert h.cpu.num_used_blocks == 0


# ---- dedup ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_duplicate_stores_skipped(scan):
    """Two requests computed the same prompt in separate GPU blocks: one copy is stored."""
    h = Harness(config=cfg(scan=scan))
    a, b = h.request("a", tokens_for(1, 161)), h.request("b", tokens_for(1, 161))
    h.admit(a)
    h.admit(b)
    h.step()
    m = h.step(decode=True)
    assert m.store.gpu_blocks == h.running["a"].tables[0][:10]
    assert h.running["b"].tables[0][:10] != h.running["a"].tables[0][:10]
    assert h.planner.stats.scan == ScanOutcomes(stored=10, duplicate=10)
    assert h.planner.cursor("b") == 10  # the first copy was selected: b moves on
    h.complete(m)
    c = h.request("c", tokens_for(1, 161))
    h.admit(c)  # a GPU hit on a's blocks
    assert h.step().store.event == -1
    assert h.planner.stats.scan == ScanOutcomes(stored=10, duplicate=10, already_cached=10)
    assert h.cpu.num_cached_keys == 10


@pytest.mark.parametrize("scan", SCANS)
def test_in_flight_store_not_selected_again(scan):
    h = Harness(config=cfg(scan=scan))
    h.admit(h.request("a", tokens_for(1, 161)))
    h.admit(h.request("b", tokens_for(1, 161)))
    h.step()
    m0 = h.step({"a": 1, "b": 0})  # b is idle: not scanned
    assert len(m0.store) == 10 and h.planner.cursor("b") == 0
    m1 = h.step({"a": 1, "b": 1})  # a's store of the same keys is still in flight
    assert m1.store.event == -1
    assert h.planner.stats.scan == ScanOutcomes(stored=10, in_flight=10)
    assert h.planner.cursor("b") == 10
    h.complete(m0)
    assert h.step({"a": 1, "b": 1}).store.event == -1
    assert h.cpu.num_cached_keys == 10 and h.planner.stats.blocks_stored == 10


# ---- the CPU LRU --------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["tail_first", "head_first"])
def test_cpu_lru_eviction_order_follows_free_order(order):
    h = Harness(cpu=10, config=cfg(cpu_free_order=order))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    keys = h.primary_keys(a)[:10].tolist()
    queue = [h.cpu.block_hash(b) for b in h.cpu.iter_free()]
    assert queue == (keys[::-1] if order == "tail_first" else keys)
    stored_prompt(h, "b", tokens_for(2, 65))  # 4 blocks: the CPU evicts 4 of a's
    survivors = [k in h.cpu for k in keys]
    if order == "tail_first":  # the chain's tail goes first; its head stays hittable
        assert survivors == [True] * 6 + [False] * 4
        assert lookup(h, "x", tokens_for(1, 161)) == 96
        assert (h.planner.stats.chain_holes, h.planner.stats.lookups_with_holes) == (0, 0)
    else:  # the head goes first: the remaining 6 blocks are unreachable orphans
        assert survivors == [False] * 4 + [True] * 6
        assert lookup(h, "x", tokens_for(1, 161)) == 0
        assert (h.planner.stats.chain_holes, h.planner.stats.lookups_with_holes) == (6, 1)


def test_cpu_hit_pinned_between_lookup_and_allocation():
    """Touched (looked-up) CPU blocks survive eviction: a store that needs space takes only
    unpinned blocks and defers the rest; the later allocation loads the intact hit."""
    h = Harness(cpu=10)
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


# ---- preemption, finish, chunked prefill -------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_preemption_leaks_no_cpu_block(scan):
    h = Harness(cpu=16, config=cfg(scan=scan))
    a, m0 = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    h.preempt("a")
    m = h.step()
    assert m.need_flush and m.store.event == -1
    with pytest.raises(ValueError, match="no store cursor"):
        h.planner.cursor("a")  # table and cursors dropped until it resumes
    h.complete(m0)  # the store in flight still lands
    assert h.cpu_prefix_blocks(a) == 10
    evict_gpu_cache(h)
    assert h.resume("a") == (0, 160)
    m = h.step()
    assert len(m.load) == 10
    h.complete(m)
    m = h.step()  # resumed: the whole new table is sent, the scan starts from 0
    assert m.store.event == -1 and h.planner.cursor("a") == 10
    assert h.planner.stats.scan == ScanOutcomes(stored=10, already_cached=10)
    h.finish("a")
    h.step()
    h.complete_all()
    assert h.cpu.num_used_blocks == 0 and h.gpu.num_used_blocks == 0
    assert not h.planner.has_request("a") and not h.planner.has_pending_work()


def test_finish_while_store_in_flight_defers_cleanup():
    h = Harness()
    a, m = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    sources = m.store.gpu_blocks
    h.finish("a")
    assert h.planner.has_request("a")
    assert [h.gpu.ref_cnt[b] for b in sources] == [1] * 10  # the store's pins outlive the table
    assert h.cpu_prefix_blocks(a) == 0
    h.complete(m)
    assert not h.planner.has_request("a")
    assert h.cpu_prefix_blocks(a) == 10
    assert h.gpu.num_used_blocks == 0 and h.cpu.num_used_blocks == 0


def test_chunked_prefill_stores_blocks_allocated_in_later_steps():
    h = Harness()
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    stores = [h.step({"a": n}).store.gpu_blocks for n in (64, 64, 33, 1)]
    table = h.running["a"].tables[0]
    assert table == list(range(1, 12))
    assert stores == [[], table[0:4], table[4:8], table[8:10]]
    assert [h.planner.cursor("a")] == [10]


@pytest.mark.parametrize("scan", SCANS)
def test_partial_gpu_prefix_plus_cpu_load_accepting_fewer_blocks(scan):
    h = Harness(config=cfg(scan=scan))
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


# ---- multi-group layouts -------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_multi_group_null_blocks_skipped_and_recovered(scan):
    """A sliding-window table starts with null pages after a prefix hit. A null page whose key
    a free GPU block still caches is recovered and stored from it; the others are skipped."""
    h = Harness(HYBRID_TINY, config=cfg(scan=scan))
    a, m = stored_prompt(h, "a", tokens_for(1, 161))
    assert m.store.groups == [0] * 10 + [1] * 10
    a_sw = h.running["a"].tables[1]
    h.finish("a")
    sw_keys = h.primary_keys(a, 1)[:10].tolist()
    for i in (0, 1, 2, 3, 4, 6):
        assert h.gpu.evict_cached(a_sw[i])
    h.evict_cpu_key(sw_keys[5])

    b = h.request("b", tokens_for(1, 160) + tokens_for(2, 40))
    assert h.admit(b) == (160, 0)
    assert h.running["b"].tables[1] == [NULL_BLOCK] * 7 + a_sw[7:10]
    m = h.step()
    assert (m.store.gpu_blocks, m.store.groups) == ([a_sw[5]], [1])
    assert h.planner.stats.scan == ScanOutcomes(stored=21, null=6, already_cached=13)
    m2 = h.step(decode=True)
    bt = h.running["b"].tables
    assert (m2.store.gpu_blocks, m2.store.groups) == (bt[0][10:12] + bt[1][10:12], [0, 0, 1, 1])
    assert NULL_BLOCK not in m2.store.gpu_blocks
    h.complete(m)
    h.complete(m2)
    h.check_invariants()


def test_multi_group_load_skips_null_blocks():
    h = Harness(HYBRID_TINY)
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


@pytest.mark.parametrize("scan", SCANS)
def test_gpu_prefix_reset_then_recovery_finds_the_new_block(scan):
    """After the GPU prefix cache is reset, a key cached again by another block is the one a
    null sliding-window page is recovered from (the fused scan once kept the reset block)."""
    h = Harness(HYBRID_TINY, config=cfg(scan=scan))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    assert h.gpu.reset_prefix_cache()
    h.gpu.get_new_blocks(3)  # held elsewhere: b's blocks are not a's old ids
    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b, accept=0) == (0, 0)
    h.step()  # b recomputes the prompt: new GPU blocks cache the same keys
    sw_keys = h.primary_keys(a, 1)[:10].tolist()
    h.evict_cpu_key(sw_keys[3])
    c = h.request("c", tokens_for(1, 160) + tokens_for(2, 40))
    assert h.admit(c) == (160, 0)
    m = h.step({"c": 40})
    b_sw = h.running["b"].tables[1]
    assert (m.store.gpu_blocks, m.store.groups) == ([b_sw[3]], [1])


# ---- reset -----------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_reset_with_pending_eager_stores_and_loads(scan):
    h = Harness(config=cfg(scan=scan))
    stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    evict_gpu_cache(h)
    b = h.request("b", tokens_for(1, 161))
    assert h.admit(b) == (0, 160)
    c = h.request("c", tokens_for(2, 161))
    h.admit(c)
    m_load = h.step()
    m_store = h.step({"c": 1})
    assert (m_load.load.event, m_store.store.event, len(m_store.store)) == (0, 1, 10)
    assert not h.planner.reset()
    assert h.planner.stats.abandoned_stores == 1
    assert h.planner.has_pending_stores() and h.planner.has_pending_work()
    assert not h.planner.has_request("b") and not h.planner.has_request("c")
    h.abandon_tracking()
    h.complete_stores([1])  # lands, but nothing is cached
    assert h.cpu_prefix_blocks(c) == 0 and h.cpu.num_used_blocks == 10
    assert not h.planner.reset()  # the load is still in flight
    h.complete_loads([0])
    assert h.cpu.num_used_blocks == 0 and h.gpu.num_used_blocks == 0
    assert h.planner.reset()
    assert h.cpu.num_cached_keys == 0 and h.planner.stats.stale_reports == 0
    assert h.planner.selector.running_present == 0
    h.planner.update_connector_output(completed_stores=[1])
    assert h.planner.stats.stale_reports == 1

    # The cleared CPU tier takes the same prompt again (the fused scan once kept stale presence
    # bits after a reset and called every old key cached).
    d, m = stored_prompt(h, "d", tokens_for(1, 161))
    assert len(m.store) == 10 and h.cpu_prefix_blocks(d) == 10


def test_reset_with_pending_lazy_stores():
    h = Harness(num_gpu_blocks=32, config=cfg(lazy=True, lazy_target_blocks=64))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step()
    h.step(decode=True)
    h.finish("a")
    m = h.step()
    assert len(m.store) == 10 and h.gpu.num_used_blocks == 10
    assert not h.planner.reset()
    h.complete(m)
    assert h.cpu.num_cached_keys == 0
    assert h.gpu.num_used_blocks == 0 and h.cpu.num_used_blocks == 0
    assert h.planner.reset()


def test_reset_releases_a_load_abandoned_before_the_same_request_loads_again():
    """A request looked up again after a reset gets a second load; the workers finish the
    abandoned one first, and its report must release the abandoned pins, not the new load's."""
    h = Harness(num_gpu_blocks=64)
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


# ---- hashes --------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_alias_hashes_preserved(scan):
    h = Harness(ALIAS_TINY, config=cfg(scan=scan))
    a, m = stored_prompt(h, "a", tokens_for(1, 161))  # five 32-token blocks, ten hash boundaries
    assert len(m.store) == 5
    keys = a.keys[0].tolist()
    for i, c in enumerate(m.store.cpu_blocks):
        assert h.cpu.block_keys(c) == (keys[2 * i + 1], keys[2 * i])
    assert all(k in h.cpu for k in keys[:10])


@pytest.mark.parametrize("fine_grained", [False, True])
def test_alias_keys_give_fine_grained_hits(fine_grained):
    h = Harness(ALIAS_TINY, config=cfg(fine_grained=fine_grained))
    stored_prompt(h, "a", tokens_for(1, 161))
    tokens = tokens_for(1, 48) + tokens_for(2, 52)  # shares three hash blocks with a
    assert lookup(h, "b", tokens) == (48 if fine_grained else 32)


# ---- finish flush (PR #53532) ----------------------------------------------------------------


@pytest.mark.parametrize("tail_cached", [False, True])
def test_finish_flush_stores_the_fine_grained_prompt_tail(tail_cached):
    """An 81-token prompt ends 16 tokens into its third 32-token block. When the scheduler
    cached that partial block under the prompt's last hash boundary (vLLM's partial-tail
    caching), the finish flush stores it too, and a fine-grained lookup reaches the boundary."""
    h = Harness(ALIAS_TINY, config=cfg(fine_grained=True))
    a = h.request("a", tokens_for(1, 81))
    h.admit(a)
    h.step()
    table = h.running["a"].tables[0]
    if tail_cached:
        h.gpu.cache_block(table[2], int(a.keys[0, 4]))
    h.finish("a")
    m = h.step()
    assert m.store.gpu_blocks == (table if tail_cached else table[:2])
    h.complete(m)
    assert lookup(h, "b", tokens_for(1, 81)) == (80 if tail_cached else 64)


def test_finish_flush_batches_finishing_requests_into_one_store():
    h = Harness()
    a, b = h.request("a", tokens_for(1, 161)), h.request("b", tokens_for(2, 161))
    h.admit(a)
    h.admit(b)
    h.step()  # prefilled, never stored: the requests finish before their next step
    ta, tb = h.running["a"].tables[0][:10], h.running["b"].tables[0][:10]
    h.finish("a")
    h.finish("b")
    assert h.planner.has_pending_stores() and h.planner.pending_store_blocks() == 20
    assert h.planner.has_request("a")
    m = h.step()
    assert (m.store.event, m.store.gpu_blocks, m.store.cpu_blocks) == (
        0, ta + tb, list(range(1, 21)))
    assert h.planner.stats.flush_stored == 20 and h.planner.stats.scan == ScanOutcomes()
    h.complete(m)
    assert not h.planner.has_request("a") and not h.planner.has_pending_stores()
    assert lookup(h, "x", tokens_for(1, 161)) == 160
    assert lookup(h, "y", tokens_for(2, 161)) == 160


def test_finish_flush_skips_hashes_already_cached():
    h = Harness()
    a = h.request("a", tokens_for(1, 161))
    b = h.request("b", tokens_for(1, 160) + tokens_for(2, 40))
    h.admit(a)
    h.admit(b)
    h.step()
    h.complete(h.step({"a": 1, "b": 0}))  # a's ten blocks; b was not scanned
    assert h.planner.cursor("b") == 0
    btable = h.running["b"].tables[0]
    h.finish("b")  # b's first ten blocks hold keys a stored: only its two own are queued
    assert h.planner.pending_store_blocks() == 2
    m = h.step({"a": 1})
    assert m.store.gpu_blocks == btable[10:12]
    assert h.planner.stats.flush_stored == 2


def test_finish_flush_multi_group():
    h = Harness(HYBRID_TINY)
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    tables = [t[:10] for t in h.running["a"].tables]
    h.finish("a")
    m = h.step()
    assert m.store.gpu_blocks == tables[0] + tables[1]
    assert m.store.groups == [0] * 10 + [1] * 10


def test_finish_flush_stops_at_free_cpu_blocks():
    h = Harness(cpu=6)
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    table = h.running["a"].tables[0]
    h.finish("a")
    assert h.planner.stats.flush_stored == 6
    m = h.step()
    assert m.store.gpu_blocks == table[:6]
    h.complete(m)
    assert lookup(h, "x", tokens_for(1, 161)) == 96


def test_reset_releases_the_finish_flush_queue():
    h = Harness()
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    h.finish("a")
    assert h.cpu.num_used_blocks == 10 and h.gpu.num_used_blocks == 10
    assert h.planner.reset()
    assert h.cpu.num_used_blocks == 0 and h.gpu.num_used_blocks == 0
    assert not h.planner.has_pending_stores()
    assert h.step().store.event == -1


# ---- seed 003: in-flight protection, evictable running requests -----------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_in_flight_store_is_protected(scan):
    """With the CPU full of blocks still being written, the scan defers (cursor stays) instead
    of evicting them."""
    h = Harness(cpu=10, config=cfg(scan=scan))
    a, m0 = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    b = h.request("b", tokens_for(2, 161))
    h.admit(b)
    h.step({"b": 161})
    m = h.step({"b": 1})
    assert m.store.event == -1 and h.planner.cursor("b") == 0
    assert h.planner.stats.scan == ScanOutcomes(stored=10, deferred=10)
    assert [h.cpu.ref_cnt[c] for c in m0.store.cpu_blocks] == [1] * 10
    h.complete(m0)
    assert h.cpu_prefix_blocks(a) == 10
    m = h.step({"b": 1})
    assert len(m.store) == 10 and h.planner.cursor("b") == 10


@pytest.mark.parametrize("restore", [False, True])
def test_running_request_blocks_can_be_evicted(restore):
    h = Harness(cpu=12, config=cfg(restore=restore))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    stored_prompt(h, "b", tokens_for(2, 65))  # 2 unhashed free blocks, then a's tail
    assert [k in h.cpu for k in h.primary_keys(a)[:10].tolist()] == [True] * 8 + [False] * 2
    assert h.planner.stats.running_evictions == 2
    m = h.step({"a": 1, "b": 0})
    table = h.running["a"].tables[0]
    if restore:
        assert m.store.gpu_blocks == table[8:10]
        assert h.planner.stats.scan.restored == 2
    else:
        assert m.store.event == -1 and h.planner.stats.scan.restored == 0


# ---- seed 000: re-store of a running request's evicted block ---------------------------------


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("restore", [True, False])
def test_seed000_evicted_block_of_running_request(scan, restore):
    h = Harness(config=cfg(scan=scan, restore=restore))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    keys = h.primary_keys(a)[:10].tolist()
    h.evict_cpu_key(keys[2])
    m = h.step(decode=True)
    s = h.planner.stats
    assert s.running_evictions == 1
    if restore:
        assert m.store.gpu_blocks == [h.running["a"].tables[0][2]]
        assert (s.scan.restored, s.scan.stored) == (1, 10)
    else:
        assert m.store.event == -1
    h.complete(m)
    assert lookup(h, "b", tokens_for(1, 161)) == (160 if restore else 32)
    assert (s.chain_holes, s.lookups_with_holes) == ((0, 0) if restore else (7, 1))


@pytest.mark.parametrize("scan", SCANS)
def test_restore_below_cursor_when_confirmed_tokens_shrink(scan):
    """Re-store candidates are every position below the cursor, also past the confirmed ones
    (the loop reference once stopped at ``ready``)."""
    h = Harness(config=cfg(scan=scan))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.evict_cpu_key(h.primary_keys(a)[8])
    a.num_output_placeholders = 32  # confirmed drops to 130 tokens: 8 blocks
    m = h.step(decode=True)
    assert m.store.gpu_blocks == [h.running["a"].tables[0][8]]
    assert h.planner.cursor("a") == 10


# ---- policy switches --------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_max_restores_per_step(scan):
    h = Harness(config=cfg(scan=scan, max_restores_per_step=1))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    keys = h.primary_keys(a)[:10].tolist()
    table = h.running["a"].tables[0]
    for i in (2, 5, 7):
        h.evict_cpu_key(keys[i])
    stores = []
    for _ in range(4):
        m = h.step(decode=True)
        stores.append(m.store.gpu_blocks)
        h.complete(m)
    assert stores == [[table[2]], [table[5]], [table[7]], []]
    s = h.planner.stats
    assert (s.scan.restored, s.scan.restore_capped, s.restore_thrash) == (3, 3, 0)


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("per_key, restored, capped, thrash, evictions",
                         [(None, 3, 0, 2, 3), (2, 2, 1, 1, 3), (1, 1, 2, 0, 2)])
def test_max_restores_per_key_bounds_thrash(scan, per_key, restored, capped, thrash, evictions):
    """Evict one key of a running request before each of three steps (when it is cached)."""
    h = Harness(config=cfg(scan=scan, max_restores_per_key=per_key))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    key = int(h.primary_keys(a)[3])
    for _ in range(3):
        if key in h.cpu:
            h.evict_cpu_key(key)
        h.complete(h.step(decode=True))
    s = h.planner.stats
    assert (s.scan.restored, s.scan.restore_capped, s.restore_thrash) == (restored, capped, thrash)
    assert s.running_evictions == evictions


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("share, restored, capped",
                         [(None, 2, 0), (0.5, 2, 0), (0.45, 1, 1), (0.4, 0, 2)])
def test_restore_share_bounds_running_blocks_on_the_cpu(scan, share, restored, capped):
    """20 CPU blocks; a running request has 10 stored, 2 of them evicted. Re-stores fit only
    while its present blocks stay within ``share`` of the pool."""
    h = Harness(cpu=20, config=cfg(scan=scan, restore_share=share))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    assert h.planner.selector.running_present == 10
    keys = h.primary_keys(a)
    h.evict_cpu_key(keys[3])
    h.evict_cpu_key(keys[6])
    assert h.planner.selector.running_present == 8
    m = h.step(decode=True)
    table = h.running["a"].tables[0]
    assert m.store.gpu_blocks == [table[3], table[6]][:restored]
    assert (h.planner.stats.scan.restored, h.planner.stats.scan.restore_capped) == (
        restored, capped)


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("scan_idle", [False, True])
def test_scan_idle_restores_requests_without_scheduled_tokens(scan, scan_idle):
    h = Harness(config=cfg(scan=scan, scan_idle=scan_idle))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.evict_cpu_key(h.primary_keys(a)[4])
    m = h.step({"a": 0})
    table = h.running["a"].tables[0]
    assert m.store.gpu_blocks == ([table[4]] if scan_idle else [])
    h.complete(m)
    m = h.step({"a": 1})  # scheduled again: the seed's behaviour catches up
    assert m.store.gpu_blocks == ([] if scan_idle else [table[4]])


# ---- bad input ------------------------------------------------------------------------------


def test_unknown_request_ids_raise():
    h = Harness()
    a = h.request("a", tokens_for(1, 65))
    with pytest.raises(ValueError, match="unknown request id 'a'"):
        h.planner.request_finished(a)
    with pytest.raises(ValueError, match="no store cursor"):
        h.planner.cursor("a")
    with pytest.raises(ValueError, match="no CPU hit is pending"):
        h.planner.update_state_after_alloc(a, ([1, 2, 3, 4, 5],), 16)
    with pytest.raises(ValueError, match="unknown request id 'a'"):  # the refusal changed nothing
        h.planner.request_finished(a)
    h.planner.update_state_after_alloc(a, ([1, 2, 3, 4, 5],), 0)
    h.planner.request_finished(a)  # now known: finish is fine
    with pytest.raises(ValueError, match="unknown request id"):
        h.planner.request_finished(a)  # twice


def test_never_issued_store_events_raise_before_anything_is_applied():
    h = Harness()
    a, m = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    before = pool_snapshot(h)
    for bad in ({5: 1}, {-1: 1}, {0: 0}):
        with pytest.raises(ValueError):
            h.planner.update_connector_output(completed_stores=bad)
    with pytest.raises(ValueError, match="never issued"):
        h.planner.update_connector_output(failed_stores=[3])
    with pytest.raises(ValueError, match="never issued"):  # the valid report is not applied
        h.planner.update_connector_output(completed_stores={0: 1}, failed_stores=[7])
    assert pool_snapshot(h) == before and h.planner.has_pending_stores()
    h.complete(m)
    assert h.cpu_prefix_blocks(a) == 10


def test_stale_and_excess_reports_are_ignored_and_counted(caplog):
    h = Harness(config=cfg(world_size=2))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    p = h.planner
    h.complete_stores([0], reports=1)  # one worker of two
    assert h.cpu_prefix_blocks(a) == 0 and p.has_pending_stores()
    h.complete_stores([0], reports=2)  # the other, plus one too many
    assert h.cpu_prefix_blocks(a) == 10 and p.stats.stale_reports == 1
    before = pool_snapshot(h)
    with caplog.at_level(logging.INFO, logger="kvtriton.planner.planner"):
        p.update_connector_output(completed_stores=[0])  # already completed
        p.update_connector_output(failed_stores=[0])
        p.update_connector_output(finished_loads=["nobody"], failed_loads=["a"])
    assert p.stats.stale_reports == 5
    assert "already completed" in caplog.text and "no load in flight" in caplog.text
    assert pool_snapshot(h) == before
    h.check_invariants()


def test_step_output_for_unknown_requests_is_ignored():
    """A scheduler step may name requests the planner does not track (as the reference
    connector skips them); nothing is planned for them."""
    h = Harness()
    m = h.planner.build_meta(StepOutput(num_scheduled_tokens={"ghost": 16},
                                        new_block_ids={"ghost": ([1],)}))
    assert m.store.event == -1 and m.load.event == -1


@pytest.mark.parametrize("scan", SCANS)
def test_cursor_stays_where_the_budget_ran_out_before_the_scan_reached_it(scan):
    """vLLM's scan stops once its CPU budget is spent, leaving later requests' cursors where they
    were; kvtriton's moved them over cached positions, and a position passed as cached was never
    looked at again if its block was evicted later (found by the differential test). Row 0
    spends the budget; row 1's cursor stays at 0 although its blocks are all cached; with
    budget left, it moves over them."""
    from kvtriton.planner.reference import LoopSelector
    from kvtriton.planner.scan import FusedSelector
    from kvtriton.pool import BlockPool

    def setup():
        gpu, cpu = BlockPool(16), BlockPool(8, medium="CPU")
        blocks = gpu.get_new_blocks(6)
        for b, key in zip(blocks, range(100, 106), strict=True):
            gpu.cache_block(b, key, ())
        cpu_blocks = cpu.get_new_blocks(3)
        for b, key in zip(cpu_blocks, range(103, 106), strict=True):
            cpu.cache_block(b, key, ())
        cls = FusedSelector if scan == "fused" else LoopSelector
        sel = cls(LLAMA_TINY, gpu, cpu, restore=False)
        for pool in (gpu, cpu):
            for b in range(1, pool.num_blocks):
                for k in pool.block_keys(b):
                    (sel.on_gpu_insert if pool is gpu else sel.on_cpu_insert)(k, b)
        sel.admit(0, [np.arange(100, 103)])
        sel.append_blocks(0, 0, blocks[:3])
        sel.admit(1, [np.arange(103, 106)])
        sel.append_blocks(1, 0, blocks[3:])
        return sel

    ready = np.array([[3], [3]])
    sel = setup()
    got = sel.select([0, 1], ready, budget=2, restore_budget=None)
    assert got.keys == [100, 101]
    assert (sel.cursor(0, 0), sel.cursor(1, 0)) == (2, 0)
    assert got.outcomes.already_cached == 3 and got.outcomes.deferred == 1
    sel = setup()
    got = sel.select([0, 1], ready, budget=3, restore_budget=None)
    assert got.keys == [100, 101, 102]
    assert (sel.cursor(0, 0), sel.cursor(1, 0)) == (3, 0)  # spent exactly before row 1
    sel = setup()
    sel.select([0, 1], ready, budget=4, restore_budget=None)
    assert (sel.cursor(0, 0), sel.cursor(1, 0)) == (3, 3)


def test_finish_after_preemption_and_reallocation_flushes_the_final_table():
    """A request preempted (its row released), allocated again on a GPU prefix hit, and
    aborted before any step carried its new table: its flush must store the hit blocks the CPU
    lacks from the table the scheduler hands over at the end, as vLLM's manager does (found by
    the differential test at seed 580 of 1,000); it stored nothing."""
    h = Harness()
    req = h.request("a", tokens_for(5, 4 * 16 + 1))
    h.admit(req)
    h.step({"a": req.num_tokens})  # prefilled; its blocks would be stored by the next step
    h.preempt("a")
    h.step({})  # reports the preemption: the row goes
    assert h.cpu.num_cached_keys == 0
    assert h.resume("a") == (4 * 16, 0)  # the GPU prefix cache still holds its 4 blocks
    tables = tuple(list(t) for t in h.running["a"].tables)
    h.planner.request_finished(req, tables)
    flush = h.planner.queued_flush()
    assert flush.gpu_blocks == tables[0][:4]
    m = h.step({})  # the flush goes out with the next batch
    assert m.store.gpu_blocks == tables[0][:4]
