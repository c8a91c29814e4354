"""What a refused planner call must leave as it was, and the scenario those checks share.

``snapshot`` captures the books a reader checks (ref counts, free counts, cached keys, pending
work, the planner's own invariants) and, to catch what those miss, the whole state reachable
from the planner (``deep_state``: its lifecycles, the selector's arrays, both pools);
``assert_unchanged`` compares two of them part by part. ``cpu_hit`` leaves a request with a
pending CPU hit, ``run_hit`` loads it, and ``finish_and_drain`` checks that the planner still
works to the end.
"""

from __future__ import annotations

import re
import types

import numpy as np
import pytest

from helpers.planner_driver import PlannerDriver, tokens_for
from kvtriton.planner import Request
from kvtriton.pool import NULL_BLOCK


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


def snapshot(h: PlannerDriver) -> dict:
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


def assert_unchanged(h: PlannerDriver, before: dict) -> None:
    after = snapshot(h)
    for part in before:  # one part at a time, so a failure names what moved
        assert after[part] == before[part], f"{part} changed"


def finish_and_drain(h: PlannerDriver) -> None:
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


def cpu_hit(h: PlannerDriver, rid: str = "b") -> Request:
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


def run_hit(h: PlannerDriver, req: Request) -> None:
    """Allocate ``req`` through the driver, taking the pending hit whole, and load it."""
    assert h.admit(req, ext=160) == (0, 160)
    m = h.step()
    assert len(m.load) == sum(1 for t in h.running[req.request_id].tables for b in t[:10]
                              if b != NULL_BLOCK)
    h.complete(m)
    assert not h.planner.load_pending(req.request_id)
    h.step()
