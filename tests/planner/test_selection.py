"""The store selection contract (``kvtriton.planner.selection``) on hand-built scenarios, for
both selectors, the fused scan and the loop reference: duplicates and keys in flight, deferral
while the CPU is full of blocks being written, re-store of a running request's evicted blocks and
its bounds, null pages and their recovery from the GPU prefix cache, and the cursor rule.

The scenarios drive the planner through ``helpers.planner_driver.PlannerDriver``; the last one
drives the selectors directly. Random schedules are in ``test_scan.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.planner_driver import (
    HYBRID_TINY,
    LLAMA_TINY,
    SCANS,
    PlannerDriver,
    lookup,
    stored_prompt,
    tokens_for,
)
from kvtriton.planner import PlannerConfig, ScanOutcomes
from kvtriton.pool import NULL_BLOCK

# ---- dedup ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_duplicate_stores_skipped(scan):
    """Two requests computed the same prompt in separate GPU blocks: one copy is stored."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
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
    h = PlannerDriver(config=PlannerConfig(scan=scan))
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


# ---- in-flight protection, evictable running requests --------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_in_flight_store_is_protected(scan):
    """With the CPU full of blocks still being written, the scan defers (cursor stays) instead
    of evicting them."""
    h = PlannerDriver(cpu=10, config=PlannerConfig(scan=scan))
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
    h = PlannerDriver(cpu=12, config=PlannerConfig(restore=restore))
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


# ---- re-store of a running request's evicted block -----------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("restore", [True, False])
def test_evicted_block_of_a_running_request(scan, restore):
    h = PlannerDriver(config=PlannerConfig(scan=scan, restore=restore))
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
    """Re-store candidates are every position below the cursor, also those past the confirmed
    tokens (not only up to ``ready``)."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.evict_cpu_key(h.primary_keys(a)[8])
    a.num_output_placeholders = 32  # confirmed drops to 130 tokens: 8 blocks
    m = h.step(decode=True)
    assert m.store.gpu_blocks == [h.running["a"].tables[0][8]]
    assert h.planner.cursor("a") == 10


# ---- setup switches -----------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_max_restores_per_step(scan):
    h = PlannerDriver(config=PlannerConfig(scan=scan, max_restores_per_step=1))
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
    h = PlannerDriver(config=PlannerConfig(scan=scan, max_restores_per_key=per_key))
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
    h = PlannerDriver(cpu=20, config=PlannerConfig(scan=scan, restore_share=share))
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
    h = PlannerDriver(config=PlannerConfig(scan=scan, scan_idle=scan_idle))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.evict_cpu_key(h.primary_keys(a)[4])
    m = h.step({"a": 0})
    table = h.running["a"].tables[0]
    assert m.store.gpu_blocks == ([table[4]] if scan_idle else [])
    h.complete(m)
    m = h.step({"a": 1})  # scheduled again: without scan_idle it is re-stored now
    assert m.store.gpu_blocks == ([] if scan_idle else [table[4]])


# ---- multi-group layouts: null pages -------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_multi_group_null_blocks_skipped_and_recovered(scan):
    """A sliding-window table starts with null pages after a prefix hit. A null page whose key
    a free GPU block still caches is recovered and stored from it; the others are skipped."""
    h = PlannerDriver(HYBRID_TINY, config=PlannerConfig(scan=scan))
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


@pytest.mark.parametrize("scan", SCANS)
def test_gpu_prefix_reset_then_recovery_finds_the_new_block(scan):
    """After the GPU prefix cache is reset, a key cached again by another block is the one a
    null sliding-window page is recovered from, not the block the reset dropped."""
    h = PlannerDriver(HYBRID_TINY, config=PlannerConfig(scan=scan))
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


# ---- the cursor ----------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_cursor_stays_where_the_budget_ran_out_before_the_scan_reached_it(scan):
    """A cursor stays where it is when the budget was spent before the scan reached its row, as
    vLLM's scan leaves it: moved over cached positions, it would pass a position whose block the
    CPU may evict later, and that position would never be looked at again. Row 0 spends the
    budget; row 1's cursor stays at 0 although its blocks are all cached; with budget left, it
    moves over them."""
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
