"""The entry checks of each step (``kvtriton.planner.checks``): a step's new blocks and
hand-offs, and workers' reports of store events, are refused before anything is applied.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from helpers.planner_driver import SCANS, PlannerDriver, pool_snapshot, stored_prompt, tokens_for
from helpers.planner_state import (
    assert_unchanged,
    cpu_hit,
    finish_and_drain,
    run_hit,
    snapshot,
)
from kvtriton.planner import PlannerConfig, StepOutput


def test_never_issued_store_events_raise_before_anything_is_applied():
    h = PlannerDriver()
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


BAD_STEPS = {
    "out-of-range": (lambda n: {"b": ([n],)}, {}, "block id 256 out of range [0, 256)"),
    "negative": (lambda n: {"b": ([-1],)}, {}, "block id -1 out of range"),
    "float": (lambda n: {"b": ([2.5],)}, {}, "block id 2.5 is not an int"),
    "bool": (lambda n: {"b": ([True],)}, {}, "block id True is not an int"),
    "two-groups": (lambda n: {"b": ([1], [2])}, {}, "per group (1), got 2 lists"),
    "no-groups": (lambda n: {"b": ()}, {}, "per group (1), got 0 lists"),
    "not-a-list": (lambda n: {"b": (5,)}, {}, "group 0: expected a list of block ids, got int"),
    "handoff-block": (lambda n: {}, {"b": [(64, 999, 0)]}, "block id 999 out of range"),
    "handoff-group": (lambda n: {}, {"b": [(64, 1, 3)]}, "group 3 out of range [0, 1)"),
    "handoff-shape": (lambda n: {}, {"b": [(64, 1)]}, "expected (boundary_tokens, gpu_block_id"),
}


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("bad", list(BAD_STEPS), ids=list(BAD_STEPS))
def test_bad_new_block_ids_are_refused_before_any_table_moves(bad, scan):
    """Bad ids in a step's new blocks are a ``ValueError`` raised before any table moves, those of
    the requests before them in the step included. Request "a" comes first in the step with
    valid new blocks; "b" carries the bad ones."""
    h = PlannerDriver(config=PlannerConfig(scan=scan))
    a, b = h.request("a", tokens_for(1, 161)), h.request("b", tokens_for(2, 161))
    h.admit(a)
    h.admit(b)
    h.step({"a": 32, "b": 32})
    new_a = h.gpu.get_new_blocks(1)
    make, handoffs, text = BAD_STEPS[bad]
    step = StepOutput(num_scheduled_tokens={"a": 16, "b": 16},
                      new_block_ids={"a": (new_a,), **make(h.gpu.num_blocks)},
                      boundary_handoffs=handoffs, order=["a", "b"])
    cursors = [h.planner.cursor(r) for r in "ab"]
    before = snapshot(h)
    with pytest.raises(ValueError, match=re.escape(text)):
        h.planner.build_meta(step)
    assert_unchanged(h, before)
    assert [h.planner.cursor(r) for r in "ab"] == cursors
    h.gpu.free_blocks(new_a)
    stored = []
    for m in (h.step(), h.step(decode=True)):  # the rest of both prompts, one decode step
        stored += m.store.gpu_blocks
        h.complete(m)
    assert sorted(stored) == sorted(h.running["a"].tables[0][:10] + h.running["b"].tables[0][:10])
    h.check_invariants()
    finish_and_drain(h)


@pytest.mark.parametrize(("reports", "named"), [
    ({"completed_stores": {0: 1.5}}, "report count must be a positive int, got 1.5"),
    ({"completed_stores": {0: True}}, "report count must be a positive int, got True"),
    ({"completed_stores": {0: 1}, "failed_stores": [0]}, "both completed and failed"),
    ({"completed_stores": [0], "failed_stores": [0]}, "both completed and failed"),
    ({"finished_loads": "a"}, "got the string 'a'"),
    ({"failed_loads": "a"}, "got the string 'a'"),
    ({"finished_loads": [7]}, "request ids are strings, got 7"),
])
def test_malformed_reports_are_refused_with_nothing_changed(reports, named):
    # A count of 1.5 used to complete the store at world size 1 and leave half a report stale;
    # a str was read letter by letter; an event both completed and failed was applied twice.
    h = PlannerDriver()
    a, m = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    before = pool_snapshot(h)
    with pytest.raises(ValueError, match=re.escape(named)):
        h.planner.update_connector_output(**reports)
    assert pool_snapshot(h) == before and h.planner.has_pending_stores()
    assert h.planner.stats.as_dict()["stale_reports"] == 0
    h.complete(m)
    assert h.cpu_prefix_blocks(a) == 10


@pytest.mark.parametrize("as_numpy", [np.int64, np.int32, np.uint16])
def test_a_numpy_integer_event_id_that_was_issued_is_accepted(as_numpy):
    h = PlannerDriver()
    a, m = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    h.planner.update_connector_output(completed_stores={as_numpy(m.store.event): as_numpy(1)})
    assert not h.planner.has_pending_stores() and h.cpu_prefix_blocks(a) == 10


def _running(h: PlannerDriver, rid: str, seed: int):
    """A request admitted and scheduled for part of its prompt: running, with blocks to store."""
    req = h.request(rid, tokens_for(seed, 161))
    h.admit(req)
    h.step({rid: 64})
    return req


@pytest.mark.parametrize("call", ["lookup", "allocation", "allocation-same-keys"])
def test_a_lookup_or_allocation_under_a_running_id_is_refused_with_nothing_changed(call):
    # Another record under a running request's id used to replace it: the running request's
    # stores then stopped silently.
    h = PlannerDriver()
    a = _running(h, "a", 1)
    other = h.request("a", tokens_for(1 if call.endswith("same-keys") else 2, 161))
    before, cursor = snapshot(h), h.planner.cursor("a")
    with pytest.raises(ValueError, match="request 'a' is running"):
        if call == "lookup":
            h.planner.get_num_new_matched_tokens(other, 0)
        else:
            h.planner.update_state_after_alloc(other, tuple(h.running["a"].tables), 0)
    assert_unchanged(h, before)
    assert h.planner.cursor("a") == cursor
    stored = []
    for m in (h.step(), h.step(decode=True)):  # the running request stores its whole prompt
        stored += m.store.gpu_blocks
        h.complete(m)
    assert sorted(stored) == sorted(h.running["a"].tables[0][:10])
    assert h.cpu_prefix_blocks(a) == 10
    finish_and_drain(h)


def test_a_running_request_is_looked_up_again_once_preempted_or_finished():
    h = PlannerDriver()
    _running(h, "a", 1)
    # Preempted (the scheduler says so before a step does): looked up and allocated again.
    h.preempt("a")
    h.resume("a")
    h.step()
    h.check_invariants()
    # Reported preempted by a step alone.
    _running(h, "b", 2)
    h.planner.build_meta(StepOutput(preempted_req_ids={"b"}))
    h.planner.get_num_new_matched_tokens(h.request("b", tokens_for(2, 161)), 0)
    # Finished: the id may name a new request.
    h.finish("a")
    h.planner.get_num_new_matched_tokens(h.request("a", tokens_for(3, 161)), 0)


def test_the_same_running_request_may_be_allocated_again():
    # vLLM calls update_state_after_alloc again for a request scheduled from the waiting queue
    # with its blocks kept (a streaming session's next input): the record is the same one.
    h = PlannerDriver()
    a = _running(h, "a", 1)
    h.planner.update_state_after_alloc(a, tuple(h.running["a"].tables), 0)
    h.check_invariants()


# (what the step schedules for "a", the message naming it); "a" runs with its prompt half done
BAD_SCHEDULED = {
    "negative": (-16, "step.num_scheduled_tokens['a'] must be an int >= 0, got -16"),
    "float": (16.0, "step.num_scheduled_tokens['a'] must be an int >= 0, got 16.0"),
    "bool": (True, "step.num_scheduled_tokens['a'] must be an int >= 0, got True"),
    "numpy-float": (np.float64(16), "got np.float64(16.0)"),
    "str": ("16", "step.num_scheduled_tokens['a'] must be an int >= 0, got '16'"),
}


@pytest.mark.parametrize("bad", list(BAD_SCHEDULED), ids=list(BAD_SCHEDULED))
def test_scheduled_token_counts_that_are_not_ints_ge_0_are_refused_with_nothing_changed(bad):
    # A negative or float count used to be taken: the step ran, its stores issued.
    h = PlannerDriver()
    _running(h, "a", 1)
    _running(h, "b", 2)
    value, text = BAD_SCHEDULED[bad]
    step = StepOutput(num_scheduled_tokens={"b": 16, "a": value}, order=["b", "a"])
    before = snapshot(h)
    with pytest.raises(ValueError, match=re.escape(text)):
        h.planner.build_meta(step)
    assert_unchanged(h, before)
    h.complete(h.step())
    finish_and_drain(h)


def test_numpy_and_zero_scheduled_token_counts_are_taken_as_ints():
    metas = []
    for count in (int, np.int64):
        h = PlannerDriver()
        _running(h, "a", 1)
        _running(h, "b", 2)
        metas.append(h.step({"a": count(97), "b": count(0)}))
        h.complete(metas[-1])
        finish_and_drain(h)
    assert metas[0] == metas[1] and len(metas[0].store) > 0


@pytest.mark.parametrize("field", ["finished_loads", "failed_loads", "failed_stores"])
def test_a_mapping_as_a_list_of_ids_is_refused_with_nothing_changed(field):
    # {"b": 1} as finished_loads used to finish b's load (its keys read as the ids).
    h = PlannerDriver()
    b = cpu_hit(h)
    assert h.admit(b, ext=160) == (0, 160)
    m = h.step()
    assert m.load.event >= 0 and h.planner.load_pending("b")
    bad = {m.store.event: 1} if field == "failed_stores" else {"b": 1}
    if field == "failed_stores":
        h.step({"b": 0})  # a store event to name: b's load is in flight, its stores are not
    before = snapshot(h)
    with pytest.raises(ValueError, match=re.escape(f"{field} must be a collection") + ".*dict"):
        h.planner.update_connector_output(**{field: bad})
    assert_unchanged(h, before)
    assert h.planner.load_pending("b")
    h.complete(m)
    finish_and_drain(h)


BAD_KEY_IDS = {
    "negative-list": ([-1], "key ids must be non-negative, got -1"),
    "negative-array": (np.array([3, -2]), "key ids must be non-negative, got -2"),
    "float-array": (np.array([1.5]), "expected a 1-D array of integer key ids, got dtype float64"),
    "float": ([2.0], "key id 2.0 is not an int"),
    "bool": ([True], "key id True is not an int"),
    "dict": ({7: 1}, "expected a collection of key ids, got a dict"),
}


@pytest.mark.parametrize("bad", list(BAD_KEY_IDS), ids=list(BAD_KEY_IDS))
def test_forget_keys_refuses_ids_that_are_not_ints_ge_0_with_nothing_changed(bad):
    # -1 used to reach the selector's per-key arrays, where it names the last key's entry.
    h = PlannerDriver()
    _running(h, "a", 1)
    keys, text = BAD_KEY_IDS[bad]
    before = snapshot(h)
    with pytest.raises(ValueError, match=re.escape("forget_keys: " + text)):
        h.planner.forget_keys(keys)
    assert_unchanged(h, before)
    finish_and_drain(h)


@pytest.mark.parametrize("call", ["lookup", "allocation", "finish"])
def test_a_request_whose_keys_were_written_negative_is_refused_with_nothing_changed(call):
    # Request checks its keys when built; one written into since used to be taken.
    h = PlannerDriver()
    b = cpu_hit(h)
    if call == "finish":
        run_hit(h, b)
    before, key = snapshot(h), b.keys[0, 3]
    b.keys[0, 3] = -7
    with pytest.raises(ValueError, match=re.escape(
            "request 'b': keys must be non-negative ids, got -7 (group 0, position 3)")):
        if call == "lookup":
            h.planner.get_num_new_matched_tokens(b, 0)
        elif call == "allocation":
            h.planner.update_state_after_alloc(b, ([],), 0)
        else:
            h.planner.request_finished(b)
    b.keys[0, 3] = key  # the planner holds this array too: its invariants read it
    assert_unchanged(h, before)
    if call != "finish":
        run_hit(h, b)  # the hit is still pending, whole
    finish_and_drain(h)
