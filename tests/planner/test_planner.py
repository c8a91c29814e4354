"""``OffloadPlanner`` driven as a scheduler drives it: a round trip, preemption, reset with
transfers in flight, reports and request ids it does not know, and its constructor and entry
checks.

Every test drives the planner through ``helpers.planner_driver.PlannerDriver`` (a tiny
scheduler) and asserts exact block ids, token counts and counters. A 161-token prompt with
16-token blocks has 10 full blocks; the step that prefills it does not store it (``build_meta``
runs before the step's tokens count), the next step does. A refused call must leave the planner,
both pools and the selector as they were (``helpers.planner_state``).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from helpers.planner_driver import (
    HYBRID_TINY,
    LLAMA_TINY,
    SCANS,
    PlannerDriver,
    cpu_blocks_of,
    evict_gpu_cache,
    pool_snapshot,
    stored_prompt,
    tokens_for,
)
from helpers.planner_state import (
    assert_unchanged,
    cpu_hit,
    deep_state,
    finish_and_drain,
    run_hit,
    snapshot,
)
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request, ScanOutcomes, StepOutput
from kvtriton.pool import BlockPool

# ---- a round trip, preemption, reset -------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
def test_eager_store_then_load_round_trip(scan):
    h = PlannerDriver(config=PlannerConfig(scan=scan))
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


@pytest.mark.parametrize("scan", SCANS)
def test_preemption_leaks_no_cpu_block(scan):
    h = PlannerDriver(cpu=16, config=PlannerConfig(scan=scan))
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


@pytest.mark.parametrize("scan", SCANS)
def test_reset_with_pending_eager_stores_and_loads(scan):
    h = PlannerDriver(config=PlannerConfig(scan=scan))
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

    # The cleared CPU tier takes the same prompt again: the reset cleared the scan's presence
    # bits too, so no old key counts as cached.
    d, m = stored_prompt(h, "d", tokens_for(1, 161))
    assert len(m.store) == 10 and h.cpu_prefix_blocks(d) == 10


def test_reset_with_pending_lazy_stores():
    h = PlannerDriver(num_gpu_blocks=32, config=PlannerConfig(lazy=True, lazy_target_blocks=64))
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


# ---- requests, events and reports the planner does not know --------------------------------------


def test_unknown_request_ids_raise():
    h = PlannerDriver()
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


def test_stale_and_excess_reports_are_ignored_and_counted(caplog):
    h = PlannerDriver(config=PlannerConfig(world_size=2))
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
    h = PlannerDriver()
    m = h.planner.build_meta(StepOutput(num_scheduled_tokens={"ghost": 16},
                                        new_block_ids={"ghost": ([1],)}))
    assert m.store.event == -1 and m.load.event == -1


# ---- refused calls change nothing ----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["64", 64.0, True, None, [64], 0, -1, "same-pool"], ids=repr)
def test_bad_cpu_pool_is_refused_before_listening_to_the_gpu_pool(bad):
    """A bad ``cpu_pool`` is a ``ValueError`` raised before the planner adds its listener to the
    GPU pool, which is left exactly as it was."""
    h = PlannerDriver()
    bad = h.gpu if bad == "same-pool" else bad
    gpu_before, before = deep_state(h.gpu), snapshot(h)
    with pytest.raises(ValueError, match="cpu_pool"):
        OffloadPlanner(LLAMA_TINY, h.gpu, bad)
    assert deep_state(h.gpu) == gpu_before
    assert_unchanged(h, before)
    run_hit(h, cpu_hit(h))
    finish_and_drain(h)


@pytest.mark.parametrize(("args", "text"), [
    (("tiny", "gpu", 8, None), "layout must be a KVLayout, got str"),
    ((LLAMA_TINY, "gpu", 8, None), "gpu_pool must be a block pool, got str"),
    ((LLAMA_TINY, "gpu-pool", 8, {"restore": False}), "config must be a PlannerConfig"),
    ((HYBRID_TINY, "gpu-pool", 8, PlannerConfig(fine_grained=True)), "fine_grained hits need"),
], ids=["layout", "gpu-pool", "config", "fine-grained-hybrid"])
def test_bad_planner_arguments_are_refused_before_listening(args, text):
    gpu = BlockPool(16)
    layout, gpu_arg, cpu, config = args
    gpu_arg = gpu if gpu_arg == "gpu-pool" else gpu_arg
    before = deep_state(gpu)
    with pytest.raises(ValueError, match=re.escape(text)):
        OffloadPlanner(layout, gpu_arg, cpu, config)
    assert deep_state(gpu) == before


def test_planner_refuses_a_request_of_another_layout():
    h = PlannerDriver()
    req = Request("r", np.arange(8, dtype=np.int64).reshape(2, 4), 64, 64)
    before = snapshot(h)
    with pytest.raises(ValueError, match="has keys for 2 groups, the layout has 1"):
        h.planner.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ValueError, match="expected a kvtriton Request, got str"):
        h.planner.update_state_after_alloc("r", ([],), 0)
    assert_unchanged(h, before)


@pytest.mark.parametrize("scan", SCANS)
def test_forget_keys_refuses_keys_the_planner_still_refers_to(scan):
    """Key ids a recycler hands out again: the planner refuses to forget one it still refers to
    (a running request's key here) and changes nothing; an unreferenced one is forgotten."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    req = cpu_hit(h)
    assert h.admit(req, ext=160) == (0, 160)
    owned = h.primary_keys(req)
    referenced = set(h.planner.referenced_keys().tolist())
    assert set(owned.tolist()) <= referenced
    before = snapshot(h)
    with pytest.raises(ValueError, match=f"keys \\[{int(owned.min())}"):
        h.planner.forget_keys([int(owned.min()), 10**6])
    assert_unchanged(h, before)
    h.planner.forget_keys(np.array([10**6]))  # never seen: nothing to forget, no error
    h.step()
    h.check_invariants()
    finish_and_drain(h)


@pytest.mark.parametrize("bad", [([1, -1],), ([1, 10**6],), ([1.5],), ([1], [2]), "0"],
                         ids=repr)
def test_request_finished_refuses_a_bad_final_table(bad):
    """The table vLLM hands over at the end is checked before anything changes: ids in the GPU
    pool, one table per group."""
    h = PlannerDriver()
    req = cpu_hit(h)
    before = snapshot(h)
    with pytest.raises(ValueError, match="request 'b'"):
        h.planner.request_finished(req, bad)
    assert_unchanged(h, before)
    h.planner.request_finished(req, None)
    finish_and_drain(h)
