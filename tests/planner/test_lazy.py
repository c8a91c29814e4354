"""Lazy mode (``kvtriton.planner.lazy``): the walk of the GPU free queue, its cursor and target,
the group each stored block is named with, and the hit its stores serve.
"""

from __future__ import annotations

import pytest

from helpers.planner_driver import (
    HYBRID_TINY,
    LLAMA_TINY,
    PlannerDriver,
    cpu_blocks_of,
    evict_gpu_cache,
    stored_prompt,
    tokens_for,
)
from kvtriton.planner import PlannerConfig, StepOutput
from kvtriton.pool import NULL_BLOCK


def test_lazy_store_then_load_round_trip():
    h = PlannerDriver(num_gpu_blocks=32, config=PlannerConfig(lazy=True, lazy_target_blocks=64))
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
    resumes after its cursor, or from the head when the cursor block left the free queue (the
    cursor is the last block walked, so a stored one sends the next walk back to the head)."""
    h = PlannerDriver(num_gpu_blocks=16, config=PlannerConfig(lazy=True, lazy_target_blocks=4))
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
    h = PlannerDriver(num_gpu_blocks=16, config=PlannerConfig(lazy=True, lazy_target_blocks=4))
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
    h = PlannerDriver(HYBRID_TINY, num_gpu_blocks=48,
                      config=PlannerConfig(lazy=True, lazy_target_blocks=64),
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
        planner = OffloadPlanner(layout, gpu, 4, PlannerConfig(lazy=True))
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
        OffloadPlanner(HYBRID_TINY, blind, 4, PlannerConfig(lazy=True))
    OffloadPlanner(HYBRID_TINY, BlockPool(8), 4, PlannerConfig())  # eager mode does not ask
