"""Bad calls to the planner API leave everything as it was (issue 15, items 4 to 6).

Each bad call must raise ``ValueError`` naming the bad value, and leave the planner, both pools
and the selector exactly as they were: no pin taken or released, no table or cursor moved, no
listener added. ``snapshot`` captures the books a reader checks (ref counts, free counts, cached
keys, pending work, the planner's own invariants) and, to catch what those miss, the whole state
reachable from the planner (its lifecycles, the selector's arrays, both pools). After the error
the planner must still work: the same requests run to the end, and once they are finished and
every transfer drained both pools are all free and ``reset()`` clears the CPU cache.
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest
from planner_harness import HYBRID_TINY, LLAMA_TINY, Harness, tokens_for

from kvtriton.planner import OffloadPlanner, PlannerConfig, Request, StepOutput
from kvtriton.pool import NULL_BLOCK, BlockPool

SCANS = ["fused", "loop"]


# ---- the snapshot -------------------------------------------------------------------------------


def deep_state(obj, seen: dict[int, int] | None = None):
    """Everything reachable from ``obj`` as comparable nested tuples: arrays by dtype, shape and
    bytes, objects by their attributes (``__dict__`` and slots), callables by name, an object met
    before as a back-reference (so cycles end, and aliasing counts)."""
    seen = {} if seen is None else seen
    if obj is None or isinstance(obj, bool | int | float | str | bytes):
        return obj
    if isinstance(obj, np.generic):
        return ("scalar", obj.dtype.str, obj.item())
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.str, obj.shape, obj.tobytes())
    if isinstance(obj, bytearray):
        return ("bytearray", bytes(obj))
    if isinstance(obj, types.MethodType | types.FunctionType | types.BuiltinFunctionType):
        return ("callable", getattr(obj, "__qualname__", repr(obj)))
    if id(obj) in seen:
        return ("ref", seen[id(obj)])
    seen[id(obj)] = len(seen)
    if isinstance(obj, dict):
        return ("dict", tuple((deep_state(k, seen), deep_state(v, seen)) for k, v in obj.items()))
    if isinstance(obj, set | frozenset):
        return ("set", frozenset(deep_state(x, seen) for x in obj))
    if isinstance(obj, list | tuple) or (hasattr(obj, "__iter__") and hasattr(obj, "appendleft")):
        return (type(obj).__name__, tuple(deep_state(x, seen) for x in obj))
    attrs = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    return (type(obj).__name__,
            tuple((name, deep_state(attrs[name], seen)) for name in sorted(attrs)))


def snapshot(h: Harness) -> dict:
    """The planner's, the selector's and both pools' state (checking their invariants)."""
    p = h.planner
    p.check_invariants()
    h.gpu.check_invariants()
    h.cpu.check_invariants()
    pools = {}
    for name, pool in (("gpu", h.gpu), ("cpu", h.cpu)):
        pools[f"{name}_ref_cnt"] = list(pool.ref_cnt)
        pools[f"{name}_free"] = pool.num_free_blocks
        pools[f"{name}_keys"] = [pool.block_keys(b) for b in range(pool.num_blocks)]
    return {
        **pools,
        "pending_hits": p.pending_hits(),
        "queued_loads": p.queued_loads(),
        "loads_in_flight": p.loads_in_flight(),
        "store_events": p.store_events_in_flight(),
        "queued_flush": p.queued_flush(),
        "pending_work": p.has_pending_work(),
        "stats": p.stats.as_dict(),
        "everything": deep_state(p),  # the planner, its selector and both pools
    }


def assert_unchanged(h: Harness, before: dict) -> None:
    after = snapshot(h)
    for part in before:  # one part at a time, so a failure names what moved
        assert after[part] == before[part], f"{part} changed"


def finish_and_drain(h: Harness) -> None:
    """Finish every request, deliver every transfer: both pools end all free, nothing pending,
    and ``reset()`` clears the CPU cache."""
    for rid in [*h.running, *h.preempted]:
        h.finish(rid)
    for _ in range(3):
        h.complete_all()
        h.step({})  # issues the finish flush
    h.complete_all()
    p = h.planner
    assert not p.has_pending_work() and not p.pending_hits()
    p.check_invariants(idle=True)
    assert h.gpu.num_used_blocks == 0 and h.cpu.num_used_blocks == 0
    assert p.reset() is True
    assert h.cpu.num_cached_keys == 0


def raises_naming(value, *, also: str = ""):
    """``pytest.raises(ValueError)`` whose message shows ``repr(value)``."""
    return pytest.raises(ValueError, match=re.escape(also) + ".*" + re.escape(repr(value)) if also
                         else re.escape(repr(value)))


def cpu_hit(h: Harness, rid: str = "b") -> Request:
    """A 161-token request whose 160-token CPU hit is pending (looked up, not yet allocated):
    an identical prompt was stored and finished, and the GPU prefix cache emptied."""
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step({"a": 161})
    h.complete(h.step({"a": 1}))
    h.finish("a")
    h.complete_all()
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)
    req = h.request(rid, tokens_for(1, 161))
    assert h.planner.get_num_new_matched_tokens(req, 0) == (160, True)
    return req


def run_hit(h: Harness, req: Request) -> None:
    """Allocate ``req`` through the harness, taking the pending hit whole, and load it."""
    assert h.admit(req, ext=160) == (0, 160)
    m = h.step()
    assert len(m.load) == sum(1 for t in h.running[req.request_id].tables for b in t[:10]
                              if b != NULL_BLOCK)
    h.complete(m)
    assert not h.planner.load_pending(req.request_id)
    h.step()


# ---- item 4: a bad GPU table at allocation -----------------------------------------------------

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
    """Issue 15 item 4: the hit's CPU pins were taken (and the request admitted) before the ids
    were checked, so they leaked for good; ``block_ids=()`` raised ``IndexError``."""
    h = Harness(config=PlannerConfig(scan=scan))
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
    h = Harness()
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
    h = Harness(HYBRID_TINY)
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


# ---- item 5: a lookup outside the request, a second load for one request ------------------------


@pytest.mark.parametrize("bad", [-16, -1, 16.0, True, np.float64(0.0), "0", None, 162,
                                 np.int64(-16)], ids=repr)
def test_lookup_refuses_num_computed_tokens_outside_the_request(bad):
    """Issue 15 item 5: ``num_computed_tokens=-16`` was accepted and hit on the wrong key (the
    request's last), and the load then wrote the table's last block."""
    h = Harness()
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
    """Issue 15 item 5: a second lookup and allocation of a request whose load was pending
    replaced that load (its pins leaked) and a report of the first load completed the second.
    Now a request takes one load at a time: while its load is queued or in flight, another
    lookup or an allocation with external tokens is refused and changes nothing; an allocation
    with none (what vLLM sends once the load landed) is accepted and changes nothing."""
    h = Harness(config=PlannerConfig(scan=scan))
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


# ---- item 6: the constructor, a step's new blocks, records, counts ----------------------------


@pytest.mark.parametrize("bad", ["64", 64.0, True, None, [64], 0, -1, "same-pool"], ids=repr)
def test_bad_cpu_pool_is_refused_before_listening_to_the_gpu_pool(bad):
    """Issue 15 item 6: a bad ``cpu_pool`` raised ``AttributeError`` after the planner had added
    its listener to the GPU pool."""
    h = Harness()
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
    """Issue 15 item 6: out-of-range ids in a step's new blocks raised ``IndexError`` after the
    tables of the requests before them were updated. Request "a" comes first in the step with
    valid new blocks; "b" carries the bad ones."""
    h = Harness(config=PlannerConfig(scan=scan))
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


KEYS = np.arange(4, dtype=np.int64).reshape(1, 4)
BAD_REQUESTS = {
    "negative-key": ({"keys": np.array([[0, -2]])}, "keys must be non-negative ids, got -2"),
    "float-keys": ({"keys": KEYS.astype(np.float64)}, "int64 array [groups, n], got dtype float64"),
    "int32-keys": ({"keys": KEYS.astype(np.int32)}, "got dtype int32"),
    "uint64-keys": ({"keys": KEYS.astype(np.uint64)}, "got dtype uint64"),
    "bool-keys": ({"keys": KEYS > 1}, "got dtype bool"),
    "list-keys": ({"keys": [[0, 1, 2, 3]]}, "int64 array [groups, n], got list"),
    "1-d-keys": ({"keys": KEYS[0]}, "got dtype int64, shape (4,)"),
    "bool-prompt": ({"num_prompt_tokens": True, "num_tokens": 64}, "got True"),
    "float-prompt": ({"num_prompt_tokens": 64.0}, "num_prompt_tokens must be a non-negative int"),
    "zero-prompt": ({"num_prompt_tokens": 0, "num_tokens": 64}, "must be positive, got 0"),
    "short-tokens": ({"num_tokens": 32}, "num_tokens=32 < num_prompt_tokens=64"),
    "negative-computed": ({"num_computed_tokens": -16}, "num_computed_tokens must be a non-neg"),
    "float-placeholders": ({"num_output_placeholders": 1.5}, "got 1.5"),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_request_refuses_bad_keys_and_counts(bad):
    """Issue 15 item 6: ``Request`` accepted negative and float keys, which the planner's
    per-key arrays then indexed (a negative one wraps to the end)."""
    fields, text = BAD_REQUESTS[bad]
    kw = {"keys": KEYS, "num_prompt_tokens": 64, "num_tokens": 64, **fields}
    with pytest.raises(ValueError, match=re.escape(text)):
        Request("r", **kw)


def test_request_accepts_numpy_ints_and_no_keys():
    r = Request("r", np.zeros((2, 0), dtype=np.int64), num_prompt_tokens=np.int64(8),
                num_tokens=8)
    assert r.keys.shape == (2, 0)
    assert Request("s", KEYS, num_prompt_tokens=64, num_tokens=64).keys is KEYS


def test_planner_refuses_a_request_of_another_layout():
    h = Harness()
    req = Request("r", np.arange(8, dtype=np.int64).reshape(2, 4), 64, 64)
    before = snapshot(h)
    with pytest.raises(ValueError, match="has keys for 2 groups, the layout has 1"):
        h.planner.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ValueError, match="expected a kvtriton Request, got str"):
        h.planner.update_state_after_alloc("r", ([],), 0)
    assert_unchanged(h, before)


@pytest.mark.parametrize(("field", "value"), [
    ("max_restores_per_step", True), ("max_restores_per_step", 1.0),
    ("max_restores_per_step", -1), ("max_restores_per_key", False),
    ("max_restores_per_key", 2.5), ("lazy_target_blocks", True), ("lazy_target_blocks", 8.0),
    ("world_size", True), ("world_size", 2.0), ("world_size", 0),
    ("max_num_batched_tokens", True), ("max_num_batched_tokens", 8192.0),
    ("max_num_batched_tokens", 0), ("restore_share", True), ("restore_share", 1.5),
    ("restore_share", float("nan")), ("restore_share", "0.5"), ("restore", 1),
    ("scan_idle", "no"), ("lazy", None), ("fine_grained", np.float64(1.0)),
], ids=repr)
def test_planner_config_refuses_bools_and_floats_for_counts(field, value):
    """Issue 15 item 6: ``PlannerConfig`` accepted bools and floats for its counts."""
    with raises_naming(value, also=field):
        PlannerConfig(**{field: value})


def test_planner_config_accepts_numpy_ints_and_int_shares():
    c = PlannerConfig(world_size=np.int64(2), max_restores_per_key=np.int32(1), restore_share=1)
    assert c.world_size == 2 and c.restore_share == 1


@pytest.mark.parametrize("bad", [True, False, 2.0, -1, "2", None, np.float64(2.0)], ids=repr)
def test_get_new_blocks_refuses_bools_and_floats(bad):
    """Issue 15 item 6: ``get_new_blocks(True)`` handed out a block, ``get_new_blocks(2.0)``
    two."""
    pool = BlockPool(8)
    before = deep_state(pool)
    with raises_naming(bad, also="get_new_blocks: n must be a non-negative int"):
        pool.get_new_blocks(bad)
    assert deep_state(pool) == before
    got = pool.get_new_blocks(np.int64(2))
    assert got == [1, 2] and all(type(b) is int for b in got)
    pool.check_invariants()


@pytest.mark.parametrize("scan", SCANS)
def test_forget_keys_refuses_keys_the_planner_still_refers_to(scan):
    """Key ids a recycler hands out again: the planner refuses to forget one it still refers to
    (a running request's key here) and changes nothing; an unreferenced one is forgotten."""
    h = Harness(config=PlannerConfig(scan=scan))
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
    h = Harness()
    req = cpu_hit(h)
    before = snapshot(h)
    with pytest.raises(ValueError, match="request 'b'"):
        h.planner.request_finished(req, bad)
    assert_unchanged(h, before)
    h.planner.request_finished(req, None)
    finish_and_drain(h)
