"""Stateful fuzzing: planner, both block pools and the TransferEngine, with real bytes in the KV.

A hypothesis ``RuleBasedStateMachine`` drives ``helpers.planner_driver.PlannerDriver`` (a tiny
scheduler around ``OffloadPlanner``) wired to a real ``TransferEngine`` over miniature KV tensors
(one layer, one head of four int32 values). Every GPU block the model "computes" is filled with
bytes derived from its key; every copy is done by the engine. Actions (drawn by weight, see
``ACTIONS``), in any interleaving:

- admissions: the next turn of an earlier request (its GPU copy optionally dropped, so the CPU
  serves it), shared prefixes of three families, exact repeats; partial CPU acceptance; resumption;
- steps: chunked prefill, decode, idle requests, confirmed-token jitter (output placeholders);
- preemption, finish, abort (also while a load is in flight, or while preempted);
- worker reports delivered late, in any order, one worker at a time (``world_size`` 1 to 3:
  partial reports), duplicated after completion, or withheld until the final drain ("missing");
- copies run when the step is submitted or as late as possible (just before the report that
  completes them), which is what exposes a pin released too early;
- an injected backend failure (a copy that scribbles garbage over its destinations, then raises
  a launch error or a ValueError of its own), reported through ``engine.poll_failures()`` ->
  ``update_connector_output(failed_*)``;
- ``planner.reset()`` at any moment (optionally the GPU prefix cache too), outside eviction
  pressure on either pool, and a full drain to quiescence in the middle of a run;
- lazy mode only (it stores from the GPU free queue, so what it offloads depends on how blocks
  leave the GPU): idle steps, allocation pressure that evicts the next victims as vLLM's
  allocation does, and a spill (steps and allocation at the pace the walk's target assumes, then
  the next turn of a finished request, which the CPU alone can serve). Lazy mode runs on every
  layout, a full-attention + sliding-window + Mamba one included (the eager machines do not).

Invariants after every rule: both pools' own invariants (ref counts, free-queue membership, map
consistency), every pool reference accounted for by a running table, a transfer in flight or the
queued finish flush, no block both free and in flight, the planner's and the selector's own books
(rows, events, loads, in-flight flags, the ``running_present`` gauge), every hashed GPU block and
every registered CPU block holding the bytes of its key, and the exact stale-report and
failed-transfer counts. At quiescence (everything finished, every report delivered) both pools are
all-free, no pin leaked, and the planner, selector and engine hold nothing.

Sizes include a CPU pool of one block and a GPU pool just big enough for the largest request. The
machines are fixed by class (fused or loop scan, re-store on or off, lazy, the Triton backend);
layout, pool sizes, world size and planner knobs are drawn per example.

CI runs at the profile's fixed seed (``tests/conftest.py``, derandomized) with the example counts
below. ``KVTRITON_HYPOTHESIS_PROFILE=long`` runs 20x the examples and 2x the steps with random
seeds; ``KVTRITON_FUZZ_EXAMPLES=N`` sets the examples per machine directly.

What this fuzzing cannot check, by the API's design: a store report is counted, not attributed to a
worker, so one worker's report duplicated before the others arrive would count as theirs; a load
report names a request, not an event. Neither is generated here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from helpers.device_lane import DEVICE
from helpers.planner_driver import PlannerDriver, Running, tokens_for
from kvtriton.engine import TransferEngine, allocate_kv_caches
from kvtriton.lookup import find_longest_hit
from kvtriton.planner import PlannerConfig, PlannerMeta
from kvtriton.pool import NULL_BLOCK
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.device_lane

I32 = torch.int32
LAYOUTS = {
    "tiny": KVLayout([FullAttentionSpec(4, 1, 4, 1, dtype=I32)], name="fuzz-tiny"),
    # 8-token blocks hashed every 4 tokens: every block carries an alias key.
    "alias": KVLayout([FullAttentionSpec(8, 1, 4, 1, dtype=I32)], hash_block_size=4,
                      name="fuzz-alias"),
    # Full attention plus a 10-token window; out-of-window pages are freed (null in the table).
    "hybrid": KVLayout([FullAttentionSpec(4, 1, 4, 1, dtype=I32),
                        SlidingWindowSpec(4, 1, 4, 1, sliding_window=10, dtype=I32)],
                       name="fuzz-hybrid"),
    # Every group kind: full attention and a 10-token window in 4-token blocks, Mamba states
    # every 8 tokens (the scheduler block); states before the last are freed as it computes.
    "three": KVLayout([FullAttentionSpec(4, 1, 4, 1, dtype=I32),
                       SlidingWindowSpec(4, 1, 4, 1, sliding_window=10, dtype=I32),
                       MambaSpec(8, (3,), (2, 2), 1, dtype=I32)], name="fuzz-three-kinds"),
}
# The eager machines' layouts; lazy mode runs on every layout (Mamba included).
EAGER_LAYOUTS = ["alias", "hybrid", "tiny"]
MAX_RUNNING = 4
# Request shapes, in scheduler blocks: shared prefix, own prompt, output.
MAX_SHARED, MAX_OWN, MAX_OUT = 5, 3, 1
SENTINEL = -1  # fills the KV tensors and the CPU pool's untouched bytes: never a pattern byte

_LONG = os.environ.get("KVTRITON_HYPOTHESIS_PROFILE") == "long"
_SCALE = 20 if _LONG else 1
_STEPS = 200 if _LONG else 100
_EXAMPLES_OVERRIDE = os.environ.get("KVTRITON_FUZZ_EXAMPLES")


def _settings(examples: int, steps: int = _STEPS) -> settings:
    n = int(_EXAMPLES_OVERRIDE) if _EXAMPLES_OVERRIDE else examples * _SCALE
    # Unset fields come from the loaded profile (derandomized in CI).
    return settings(max_examples=n, stateful_step_count=steps, deadline=None)


def max_tokens(layout: KVLayout) -> int:
    B = layout.scheduler_block_size
    return (MAX_SHARED + MAX_OWN + MAX_OUT) * B + layout.hash_block_size


def min_gpu_blocks(layout: KVLayout) -> int:
    """The smallest GPU pool that can hold the largest request (plus the null block)."""
    n = max_tokens(layout)
    return 1 + sum(-(-n // g.block_size) for g in layout.groups)


def pattern(keys: np.ndarray, segment: int, nbytes: int) -> np.ndarray:
    """``[len(keys), nbytes]`` uint8: the bytes segment ``segment`` of a block keyed ``k`` holds.
    Values stay below 251, so they never equal the 0xFF sentinel."""
    seed = (np.asarray(keys, dtype=np.int64) * 0x9E3779B1 + segment * 0x85EBCA77 + 1) & 0x7FFFFFFF
    i = np.arange(1, nbytes + 1, dtype=np.int64)
    return (((i[None, :] * seed[:, None]) >> 7) % 251).astype(np.uint8)


@dataclass
class Pending:
    """Worker reports still to come for one transfer."""

    kind: str  # "store" or "load"
    event: int
    reports: list[str]  # "ok" or "fail", one per report still to deliver
    copy: tuple[list[int], list[int], list[int], list[str]] | None = None  # deferred copy
    src_keys: list[int] = field(default_factory=list)  # load: key of each CPU source at issue
    groups: list[int] = field(default_factory=list)  # load: group of each pair


class InjectedFault(RuntimeError):
    """A launch error from the backend."""


class InjectedValueError(ValueError):
    """A backend's own ValueError, raised after the pairs were validated."""


class Rig(PlannerDriver):
    """The planner driver plus a real engine: computed blocks get their key's bytes, every copy runs
    through ``TransferEngine``, and worker reports are queued for the test to deliver."""

    def __init__(self, layout: KVLayout, gpu_blocks: int, cpu_blocks: int,
                 config: PlannerConfig, backend: str) -> None:
        super().__init__(layout, gpu_blocks, cpu_blocks, config, free_out_of_window=True)
        kv = allocate_kv_caches(layout, gpu_blocks, device=DEVICE)
        for group in kv:
            for layer in group:  # an attention layer's KV tensor, or a Mamba layer's states
                for t in layer if isinstance(layer, tuple) else (layer,):
                    t.fill_(SENTINEL)
        self.engine = TransferEngine(layout, kv, self.cpu.num_blocks, backend=backend)
        self.engine.cpu_pool.fill_(0xFF)
        self.world = config.world_size
        self.all_full = all(g.kind == "full" for g in layout.groups)
        self.key_group: dict[int, int] = {}
        self.length: dict[str, int] = {}  # prompt + output tokens of each request
        self.pending: dict[tuple[str, int], Pending] = {}
        self.done_stores: set[int] = set()  # store events completed or failed
        self.done_loads: list[str] = []  # request ids whose load report was delivered
        self.defer = ("store", "load")
        self.fail_next = 0
        self.faults_fired = 0
        self.expect_failed = 0
        self.expect_stale = 0
        self._loaded_now: set[int] | None = None
        self._real_copy = self.engine._copy
        self.engine._copy = self._copy

    # ---- keys and bytes ---------------------------------------------------------------------

    def request(self, rid, tokens, output=0):
        req = super().request(rid, tokens, output)
        for g in range(self.G):
            for k in req.keys[g].tolist():
                self.key_group[k] = g
        self.length[rid] = len(tokens)
        return req

    def admit(self, req, accept=None, ext=None):
        """A sliding window or a Mamba state makes a shorter hit a different set of blocks,
        which the CPU may not hold: the scheduler then takes the whole hit or none of it."""
        if accept is not None and ext is None and not self.all_full:
            local = self.gpu_hit(req).num_tokens
            ext, _ = self.planner.get_num_new_matched_tokens(req, local)
            if 0 < accept < ext:
                skip = local // self.layout.hash_block_size
                keys = req.keys[:, skip:skip + accept // self.layout.hash_block_size].tolist()
                if find_longest_hit(self.layout, self.cpu, keys, accept).num_tokens != accept:
                    accept = 0
        return super().admit(req, accept, ext)

    def _fill(self, g: int, b: int, key: int) -> None:
        for s, (view, _) in enumerate(self.engine.segments[g]):
            view[b] = torch.from_numpy(pattern([key], s, view.shape[1])[0])

    def _gpu_bytes_ok(self, g: int, blocks: list[int], keys: list[int]) -> list[int]:
        """The blocks of ``blocks`` (group g) that do not hold their key's bytes."""
        bad = np.zeros(len(blocks), dtype=bool)
        idx = torch.tensor(blocks, dtype=torch.int64)
        for s, (view, _) in enumerate(self.engine.segments[g]):
            got = view[idx].cpu().numpy()
            bad |= (got != pattern(keys, s, view.shape[1])).any(axis=1)
        return [b for b, x in zip(blocks, bad, strict=True) if x]

    def _cache_full(self, run: Running, upto: int) -> None:
        """Blocks about to be hashed were computed (write their bytes) or, while a load report
        is applied, loaded (their bytes must already be there)."""
        hbs = self.layout.hash_block_size
        for g, spec in enumerate(self.layout.groups):
            r = spec.block_size // hbs
            table = run.tables[g]
            stop = min(upto // spec.block_size, len(table), run.req.keys.shape[1] // r)
            for i in range(run.cached[g], stop):
                b = table[i]
                if b == NULL_BLOCK or self.gpu.block_hash(b) is not None:
                    continue
                key = int(run.req.keys[g, (i + 1) * r - 1])
                if self._loaded_now is None:
                    self._fill(g, b, key)
                    continue
                assert b in self._loaded_now, (
                    f"request {run.req.request_id!r}: GPU block {b} (group {g}, position {i}) is "
                    "hashed after its load completed, but no load wrote it")
                assert not self._gpu_bytes_ok(g, [b], [key]), (
                    f"request {run.req.request_id!r}: GPU block {b} (group {g}, position {i}) "
                    f"does not hold key {key} after its CPU load")
        super()._cache_full(run, upto)

    def check_bytes(self) -> None:
        """Every hashed GPU block and every registered CPU block holds its key's bytes."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for b in range(1, self.gpu.num_blocks):
            k = self.gpu.block_hash(b)
            if k is not None:
                blocks, keys = by_group.setdefault(self.key_group[k], ([], []))
                blocks.append(b)
                keys.append(k)
        for g, (blocks, keys) in by_group.items():
            bad = self._gpu_bytes_ok(g, blocks, keys)
            assert not bad, f"GPU blocks {bad} (group {g}) do not hold their keys' bytes"
        pool = self.engine.cpu_pool
        for c in range(1, self.cpu.num_blocks):
            k = self.cpu.block_hash(c)
            if k is None:
                continue
            g = self.key_group[k]
            for s, (view, off) in enumerate(self.engine.segments[g]):
                n = view.shape[1]
                got = pool[c, off:off + n].numpy()
                assert (got == pattern([k], s, n)[0]).all(), (
                    f"CPU block {c} is registered under key {k} (group {g}) but segment {s} "
                    "holds other bytes")

    # ---- the engine -------------------------------------------------------------------------

    def _copy(self, direction, pairs) -> None:
        if self.fail_next:
            self.fail_next -= 1
            self.faults_fired += 1
            # A launch that dies half way: garbage in the destinations, then an exception.
            if direction == "store":
                self.engine.cpu_pool[torch.as_tensor(pairs.cpu, dtype=torch.int64)] = 0xAB
            else:
                for g in set(pairs.grp.tolist()):
                    dst = torch.as_tensor(pairs.gpu[pairs.grp == g], dtype=torch.int64)
                    for view, _ in self.engine.segments[g]:
                        view[dst] = 0xAB
            error = InjectedValueError if self.faults_fired % 2 else InjectedFault
            raise error(f"injected {direction} failure")
        self._real_copy(direction, pairs)

    def _record(self, meta: PlannerMeta) -> None:
        super()._record(meta)
        s, ld = meta.store, meta.load
        if ld.event >= 0:
            keys = [self.cpu.block_hash(c) for c in ld.cpu_blocks]
            assert None not in keys, f"load {ld.event} reads an unregistered CPU block"
        immediate = PlannerMeta(s, ld, meta.load_event_to_reqs, meta.need_flush)
        if s.event >= 0:
            self.pending["store", s.event] = Pending("store", s.event, ["ok"] * self.world)
            if "store" in self.defer:
                self.pending["store", s.event].copy = (
                    list(s.gpu_blocks), list(s.cpu_blocks), list(s.groups), [])
                immediate = PlannerMeta(type(s)(), ld, meta.load_event_to_reqs, meta.need_flush)
        if ld.event >= 0:
            rids = list(meta.load_event_to_reqs[ld.event])
            p = self.pending["load", ld.event] = Pending("load", ld.event, ["ok"], src_keys=keys,
                                                        groups=list(ld.groups))
            if "load" in self.defer:
                p.copy = (list(ld.gpu_blocks), list(ld.cpu_blocks), list(ld.groups), rids)
                immediate = PlannerMeta(immediate.store, type(ld)(), {}, meta.need_flush)
        self.engine.execute(immediate)
        self.engine.flush()  # under CUDA the copies run on side streams; a no-op on CPU
        self.engine.poll()
        failed_stores, failed_loads = self.engine.poll_failures()
        for ev in failed_stores:  # this worker failed (which one varies); the others succeed
            self.pending["store", ev].reports[ev % self.world] = "fail"
        if failed_loads:
            self.pending["load", ld.event].reports[0] = "fail"

    def _run_deferred(self, p: Pending) -> None:
        gpu, cpu, groups, rids = p.copy
        p.copy = None
        if p.kind == "store":
            self.engine.store(p.event, gpu, cpu, groups)
        else:
            self.engine.load(p.event, rids, gpu, cpu, groups)
        self.engine.flush()
        failed_stores, failed_loads = self.engine.poll_failures()
        self.engine.poll()
        if failed_stores or failed_loads:
            p.reports[-1] = "fail"

    # ---- delivering reports -----------------------------------------------------------------

    def deliver(self, kind: str, ev: int) -> None:
        """Deliver the next report of one transfer (its deferred copy runs first if this report
        completes it)."""
        p = self.pending[kind, ev]
        last = len(p.reports) == 1
        if last and p.copy is not None:
            self._run_deferred(p)
        outcome = p.reports.pop(0)
        if not p.reports:
            del self.pending[kind, ev]
        if kind == "load":
            self._deliver_load(p, outcome == "fail")
            return
        if ev in self.done_stores:  # the store already failed on another worker
            assert outcome == "ok"
            self.planner.update_connector_output(completed_stores=[ev])
            self.expect_stale += 1
        elif outcome == "fail":
            self.complete_stores([], failed=[ev])
            self.done_stores.add(ev)
            self.expect_failed += 1
        else:
            self.complete_stores([ev], reports=1)
            if ev not in self.stores:
                self.done_stores.add(ev)

    def _deliver_load(self, p: Pending, failed: bool) -> None:
        gpu, _, rids = self.loads[p.event]
        groups = p.groups
        if not failed:
            for g in set(groups):
                sel = [i for i, x in enumerate(groups) if x == g]
                assert all(self.key_group[p.src_keys[i]] == g for i in sel)
                bad = self._gpu_bytes_ok(g, [gpu[i] for i in sel], [p.src_keys[i] for i in sel])
                assert not bad, f"load {p.event}: GPU blocks {bad} do not hold their source keys"
        self._loaded_now = set(gpu)
        try:
            self.complete_loads([p.event], failed=failed)
        finally:
            self._loaded_now = None
        if failed:
            self.expect_failed += len(rids)
        self.done_loads += rids

    def deliver_all(self) -> None:
        while self.pending:
            kind, ev = min(self.pending)
            self.deliver(kind, ev)

    # ---- invariants -------------------------------------------------------------------------

    def check(self) -> None:
        gpu, cpu, p = self.gpu, self.cpu, self.planner
        gpu.check_invariants()
        cpu.check_invariants()
        cpu_ref = [0] * cpu.num_blocks
        gpu_ref = [0] * gpu.num_blocks
        dests: set[int] = set()
        flush = p.queued_flush()
        for c_list, g_list in [*((s.cpu, s.gpu) for s in self.stores.values()),
                               (flush.cpu_blocks, flush.gpu_blocks)]:
            for c in c_list:
                assert c not in dests, f"CPU block {c} is the destination of two stores"
                dests.add(c)
                cpu_ref[c] += 1
            for b in g_list:
                gpu_ref[b] += 1
        load_rids = []
        unissued = [(ld.gpu_blocks, ld.cpu_blocks, []) for ld in p.queued_loads().values()]
        for g_list, c_list, rids in [*self.loads.values(), *unissued]:
            for c in c_list:
                cpu_ref[c] += 1
            for b in g_list:
                gpu_ref[b] += 1
            load_rids += rids
        for run in self.running.values():
            for table in run.tables:
                for b in table:
                    if b != NULL_BLOCK:
                        gpu_ref[b] += 1
        for b in p.held_after_finish():
            gpu_ref[b] += 1
        for b in range(1, gpu.num_blocks):
            assert gpu.ref_cnt[b] == gpu_ref[b], (
                f"GPU block {b}: ref count {gpu.ref_cnt[b]}, accounted for {gpu_ref[b]}")
        for c in range(1, cpu.num_blocks):
            assert cpu.ref_cnt[c] == cpu_ref[c], (
                f"CPU block {c}: ref count {cpu.ref_cnt[c]}, accounted for {cpu_ref[c]}")
        # Registered keys are those of the GPU source of the last completed store.
        for c in range(1, cpu.num_blocks):
            keys = cpu.block_keys(c)
            if keys:
                assert keys == self.registered.get(c), f"CPU block {c} holds {keys}"
        # The planner's and the selector's own books (rows, events, report counts, in-flight
        # flags, ownership, the running_present gauge), then their agreement with the transfers
        # in flight.
        p.check_invariants()
        events = p.store_events_in_flight()
        assert events == set(self.stores), (
            f"planner store events {sorted(events)} != in flight {sorted(self.stores)}")
        planner_loads = p.loads_in_flight()
        assert sorted(planner_loads) == sorted(load_rids), (
            f"planner loads {sorted(planner_loads)} != in flight {sorted(load_rids)}")
        assert not p.pending_hits(), "a CPU hit stayed pinned past its allocation"
        for b in set(flush.gpu_blocks) | {b for s in self.stores.values() for b in s.gpu}:
            assert not gpu.is_free(b), f"GPU block {b} is free and in flight"
        for c in dests | {c for _, cl, _ in self.loads.values() for c in cl}:
            assert not cpu.is_free(c), f"CPU block {c} is free and in flight"
        assert p.stats.failed_transfers == self.expect_failed, (
            f"failed_transfers {p.stats.failed_transfers}, injected {self.expect_failed}")
        assert p.stats.stale_reports == self.expect_stale, (
            f"stale_reports {p.stats.stale_reports}, sent {self.expect_stale}")
        self.check_bytes()

    def check_quiescent(self) -> None:
        p, sel = self.planner, self.planner.selector
        assert not p.has_pending_work(), "work left after the drain"
        assert self.gpu.num_used_blocks == 0, f"GPU blocks leaked: {self.gpu.ref_cnt}"
        assert self.cpu.num_used_blocks == 0, f"CPU pins leaked: {self.cpu.ref_cnt}"
        p.check_invariants(idle=True)  # the planner and the selector hold nothing
        assert sel.running_present == 0
        assert self.engine.num_in_flight == 0
        assert self.engine.poll() == ([], []) and self.engine.poll_failures() == ([], [])

    def quiesce(self) -> None:
        """Finish every request, deliver every report, push the finish flushes out."""
        for rid in sorted(self.running) + sorted(self.preempted):
            self.finish(rid)
        for _ in range(8):
            self.deliver_all()
            if not self.planner.has_pending_work():
                break
            self.step({})
        self.deliver_all()
        self.check()
        self.check_quiescent()


# Actions and their weights. Hypothesis picks among a machine's rules with a strong bias toward the
# simplest one, which would make a rare action (a drain, a reset) the most common; so the machine
# has one rule that draws an action from this weighted list (of the actions enabled now).
ACTIONS = {
    "step": 20, "deliver": 10, "admit": 6, "finish": 6, "resume": 4, "evict": 4, "preempt": 2,
    "fault": 1, "abort": 1, "jitter": 1, "duplicate": 1, "reset": 1, "drain": 1,
}


class PlannerMachine(RuleBasedStateMachine):
    """Fixed per subclass: the selector, re-store, lazy mode and the engine backend."""

    scan = "fused"
    restore = True
    lazy = False
    backend = "torch"
    layouts = EAGER_LAYOUTS
    actions = ACTIONS
    cpu_sizes = (8, 24, 1, 2, 3)
    cpu_per_group = False  # scale the roomier CPU sizes by the layout's groups

    def __init__(self) -> None:
        super().__init__()
        self.rig: Rig | None = None
        self.n_req = 0
        self.tokens: dict[str, list[int]] = {}
        self.history: list[list[int]] = []  # computed tokens of recently finished requests
        self.clean = True  # False once a rule or invariant failed: teardown then leaves it be

    @initialize(data=st.data())
    def setup(self, data) -> None:
        draw = data.draw
        name = draw(st.sampled_from(self.layouts), label="layout")
        layout = LAYOUTS[name]
        low = min_gpu_blocks(layout)
        # Hypothesis leans toward the first choice of a list: the roomier pools come first.
        gpu = draw(st.sampled_from([low + 6, 48, low]), label="gpu_blocks")
        cpu = draw(st.sampled_from(self.cpu_sizes), label="cpu_blocks")
        if self.cpu_per_group and cpu > 3:
            cpu *= layout.num_groups
        cfg = PlannerConfig(
            scan=self.scan, restore=self.restore, lazy=self.lazy,
            lazy_target_blocks=draw(st.sampled_from([None, 2, 8])) if self.lazy else None,
            # Hinted admission holds back keys a closed session held last (lazy mode only).
            admission=draw(st.sampled_from(["all", "hinted"])) if self.lazy else "all",
            world_size=draw(st.sampled_from([1, 1, 2, 3]), label="world_size"),
            cpu_free_order=draw(st.sampled_from(["tail_first", "head_first"])),
            max_restores_per_step=draw(st.sampled_from([None, None, 0, 1])),
            max_restores_per_key=draw(st.sampled_from([None, None, 1])),
            restore_share=draw(st.sampled_from([None, None, 0.5])),
            scan_idle=draw(st.booleans()),
            # Hits may end on any hash boundary (inside a block): the alias layout only.
            fine_grained=name == "alias" and draw(st.booleans()),
        )
        self.rig = Rig(layout, gpu, cpu, cfg, self.backend)

    def _enabled(self, action: str) -> bool:
        h = self.rig
        if action in ("admit", "resume") and len(h.running) >= MAX_RUNNING:
            return False
        busy = bool(h.running or h.preempted or h.pending)
        return {
            # Lazy mode stores at every step what nears eviction, also with nothing scheduled.
            "step": (busy or h.planner.has_pending_work()
                     or (self.lazy and h.gpu.num_cached_keys > 0)),
            "pressure": h.gpu.num_cached_keys > 0 and h.gpu.num_free_blocks > 0,
            "spill": bool(self.history) and h.gpu.num_cached_keys > 0,
            "reset": busy,
            "fault": busy,
            "drain": busy,
            "evict": h.gpu.num_cached_keys + h.cpu.num_cached_keys > 0,
            "resume": bool(h.preempted),
            "finish": any(r.req.num_computed_tokens >= h.length[rid]
                          for rid, r in h.running.items()),
            "abort": bool(h.running or h.preempted),
            "preempt": bool(h.running),
            "jitter": bool(h.running),
            "deliver": bool(h.pending),
            "duplicate": bool(h.done_stores or h.done_loads),
        }.get(action, True)

    @rule(data=st.data())
    def act(self, data) -> None:
        choices = [a for a, w in self.actions.items() if self._enabled(a) for _ in range(w)]
        action = data.draw(st.sampled_from(choices), label="action")
        self.clean = False
        getattr(self, f"_{action}")(data.draw)
        self.clean = True

    # ---- requests ---------------------------------------------------------------------------

    def _admit(self, draw, kind: str | None = None, best: bool = False) -> None:
        """A new request: the next turn of an earlier one (its whole sequence, then more), or a
        shared prefix of one of three families (or an exact repeat of one) and its own tokens;
        then output. The scheduler may accept less of the CPU hit. ``best``: the turn of the
        sequence the CPU holds most of, taking its whole CPU hit."""
        h = self.rig
        B, hbs = h.layout.scheduler_block_size, h.layout.hash_block_size
        q = B // 4  # own prompt and output come in quarter blocks
        own, output = draw(st.integers(1, MAX_OWN * 4)) * q, draw(st.integers(0, MAX_OUT * 4)) * q
        self.n_req += 1
        rid = f"r{self.n_req}"
        fresh = tokens_for(1000 + self.n_req, own + output)
        kind = kind or draw(st.sampled_from(["turn", "family", "repeat"] if self.history
                                            else ["family"]))
        if kind == "turn":  # earlier sequences most present in the CPU first
            ranked = sorted(self.history, key=lambda t: -self._cpu_presence(h.request("?", t)))
            prev = ranked[0] if best else draw(st.sampled_from(ranked))
            toks = prev[:max_tokens(h.layout) - len(fresh) - hbs] + fresh
        else:
            family = draw(st.integers(0, 2))
            n_shared = draw(st.sampled_from([MAX_SHARED, 2, 0, 1, 3, 4])) * B \
                + draw(st.sampled_from([0, 0, 1, 3]))
            toks = tokens_for(family, n_shared) + fresh
            if kind == "repeat":
                toks = tokens_for(family, len(toks))
        self.tokens[rid] = toks
        accept = None if best else draw(st.sampled_from([None, None, 0, 1, 2]))
        req = h.request(rid, toks, output)
        if kind == "turn" and draw(st.sampled_from([True, False])):
            # The GPU prefix cache lost this prefix, so the CPU tier has to serve it.
            self._lose_gpu_copies(set(req.keys.ravel().tolist()))
        if h.blocks_needed(req, len(toks)) <= h.gpu.num_free_blocks:  # else it keeps waiting
            h.admit(req, None if accept is None else accept * hbs)

    def _cpu_presence(self, req) -> int:
        """How much of ``req`` the CPU holds, to rank earlier sequences for a next turn."""
        return self.rig.cpu_prefix_blocks(req)

    def _lose_gpu_copies(self, keys: set[int]) -> None:
        """Drop the GPU prefix cache's free blocks holding ``keys`` (outside pressure)."""
        h = self.rig
        for b in list(h.gpu.iter_free()):
            if h.gpu.block_hash(b) in keys:
                h.gpu.evict_cached(b)

    def _resume(self, draw) -> None:
        h = self.rig
        rid = draw(st.sampled_from(sorted(h.preempted)))
        accept = draw(st.sampled_from([None, 0, 1]))
        if h.blocks_needed(h.preempted[rid], h.length[rid]) <= h.gpu.num_free_blocks:
            h.resume(rid, None if accept is None else accept * h.layout.hash_block_size)

    def _step(self, draw) -> None:
        """One step: per request nothing, one token, half or all of what is left (chunked
        prefill), or one decode token; copies run now or are deferred to their last report."""
        h = self.rig
        scheduled, budget = {}, h.gpu.num_free_blocks
        for rid in sorted(h.running):
            if h.planner.load_pending(rid):
                continue
            req = h.running[rid].req
            left = req.num_tokens - req.num_computed_tokens
            if left > 0:
                n = draw(st.sampled_from([left, 1, max(1, left // 2), 0]))
            else:  # decode until the output is complete
                n = draw(st.sampled_from([1, 1, 0])) if req.num_tokens < h.length[rid] else 0
            grow = h.grow_need(rid, n)
            if grow <= budget:
                budget -= grow
                scheduled[rid] = n
        h.defer = draw(st.sampled_from([(), ("store", "load"), ("store",), ("load",)]))
        h.step(scheduled)

    def _jitter(self, draw) -> None:
        """Scheduled-but-unconfirmed tokens (async scheduling): stores must not trust them."""
        h = self.rig
        run = h.running[draw(st.sampled_from(sorted(h.running)))]
        hi = min(run.req.num_computed_tokens, 2 * h.layout.scheduler_block_size)
        run.req.num_output_placeholders = draw(st.integers(0, hi))

    def _preempt(self, draw) -> None:
        h = self.rig
        rid = draw(st.sampled_from(sorted(h.running)))
        if not h.planner.load_pending(rid):  # a request waiting for its KV is not running
            h.preempt(rid)

    def _finish(self, draw) -> None:
        h = self.rig
        done = sorted(rid for rid, r in h.running.items()
                      if r.req.num_computed_tokens >= h.length[rid])
        self._end(draw(st.sampled_from(done)), draw)

    def _abort(self, draw) -> None:
        """Finish at any moment: mid-prefill, while preempted, or while its load is in flight."""
        h = self.rig
        self._end(draw(st.sampled_from(sorted(h.running) + sorted(h.preempted))), draw)

    def _end(self, rid: str, draw) -> None:
        """Finish ``rid`` with a drawn hint; what it computed becomes a prefix later turns may
        continue."""
        h = self.rig
        run = h.running.get(rid)
        if run is not None and run.req.num_computed_tokens >= h.layout.scheduler_block_size:
            self.history = [*self.history[-7:], self.tokens[rid][:run.req.num_computed_tokens]]
        if run is not None:
            run.hint = draw(st.sampled_from([None, "close", "continue"]), label="hint")
        h.finish(rid)

    # ---- reports, faults, resets --------------------------------------------------------------

    def _deliver(self, draw) -> None:
        """Some of the reports still to come, one worker's report each, in any order."""
        h = self.rig
        items = sorted(h.pending)
        chosen = draw(st.lists(st.sampled_from(items), min_size=1, max_size=len(items)))
        for kind, ev in draw(st.permutations(chosen)):
            if (kind, ev) in h.pending:
                h.deliver(kind, ev)

    def _duplicate(self, draw) -> None:
        """A late duplicate of a report that already took effect: ignored, counted as stale."""
        h = self.rig
        p = h.planner
        stores = sorted(ev for ev in h.done_stores if ("store", ev) not in h.pending)
        loads = [r for r in dict.fromkeys(h.done_loads)
                 if not p.load_pending(r) and r not in p.loads_in_flight()]
        choices = [("store", ev) for ev in stores] + [("load", r) for r in loads]
        if not choices:
            return
        kind, what = draw(st.sampled_from(choices))
        if kind == "store":
            p.update_connector_output(completed_stores=[what])
        else:
            p.update_connector_output(finished_loads=[what])
        h.expect_stale += 1

    def _fault(self, draw) -> None:
        """The next copy fails in the backend."""
        self.rig.fail_next += 1

    def _reset(self, draw) -> None:
        h = self.rig
        h.planner.reset()
        h.abandon_tracking()
        if draw(st.booleans()):
            h.gpu.reset_prefix_cache()  # refused (and logged) while blocks are referenced

    def _evict(self, draw) -> None:
        """Outside pressure: drop the hashes of free cached blocks, on the GPU (so the next
        admission hits the CPU) or on the CPU (so re-stores follow)."""
        gpu = draw(st.sampled_from(["gpu", "cpu"])) == "gpu"
        pool = self.rig.gpu if gpu else self.rig.cpu
        victims = [b for b in pool.iter_free() if pool.block_hash(b) is not None]
        if victims:
            counts = [1, max(1, len(victims) // 2), len(victims)]
            how_many = draw(st.sampled_from(counts[::-1] if gpu else counts))
            for b in draw(st.permutations(victims))[:how_many]:
                pool.evict_cached(b)

    def _pressure(self, draw) -> None:
        """Allocation pressure on the GPU (another tenant's blocks, taken and given back): the
        first free blocks in eviction order are handed out, losing their hashes, as vLLM's
        allocation evicts; what the lazy walk stored of them before survives in the CPU."""
        n = self.rig.gpu.num_free_blocks
        self._allocate_free(draw(st.sampled_from([n, max(1, n // 2), 1])))

    def _spill(self, draw) -> None:
        """Lazy mode's way to a CPU hit: steps with nothing scheduled, each followed by every
        report and by another tenant taking (and holding) the free blocks at the head of the
        eviction order that are safe to evict (unhashed, or offloaded already), at most half
        the walk's target (what it assumes one step allocates), until the free queue holds no
        hashed block; the tenant then gives its blocks back. A turn of a finished request,
        admitted next, finds its prefix in the CPU only (if the CPU kept every group of it)."""
        h = self.rig
        gpu, cpu = h.gpu, h.cpu
        target = h.planner.config.lazy_target_blocks
        per_step = max(1, gpu.num_blocks if target is None else target // 2)
        h.defer = draw(st.sampled_from([(), ("store", "load")]))
        held: list[int] = []
        for _ in range(2 * gpu.num_blocks):
            h.step({})
            h.deliver_all()
            if not any(gpu.block_hash(b) is not None for b in gpu.iter_free()):
                break
            safe = 0
            for b in gpu.iter_free():
                key = gpu.block_hash(b)
                if safe == per_step or (key is not None and key not in cpu):
                    break
                safe += 1
            held += gpu.get_new_blocks(safe)
        gpu.free_blocks(held)
        if len(h.running) < MAX_RUNNING:
            self._admit(draw, kind="turn", best=True)

    def _allocate_free(self, n: int) -> None:
        gpu = self.rig.gpu
        if n > 0:
            gpu.free_blocks(gpu.get_new_blocks(n))

    def _drain(self, draw) -> None:
        self.rig.fail_next = 0
        self.rig.quiesce()

    @invariant()
    def consistent(self) -> None:
        if self.rig is not None:
            self.clean = False
            self.rig.check()
            self.clean = True

    def teardown(self) -> None:
        if self.rig is not None and self.clean:
            self.rig.fail_next = 0
            self.rig.quiesce()


class FusedRestoreMachine(PlannerMachine):
    scan, restore = "fused", True


class FusedNoRestoreMachine(PlannerMachine):
    scan, restore = "fused", False


class LoopRestoreMachine(PlannerMachine):
    scan, restore = "loop", True


class LoopNoRestoreMachine(PlannerMachine):
    scan, restore = "loop", False


class LazyMachine(PlannerMachine):
    """Lazy offload on every layout: single-group, full attention with a sliding window, and
    full attention with a window and Mamba states. Stores come from the GPU free queue, each
    block with the group it was cached for; ``check_bytes`` then proves every CPU block holds
    the bytes of its key's own group, and every load the bytes of its source key."""

    lazy = True
    layouts = ("three", "hybrid", "three", "hybrid", "alias", "tiny")  # hybrids drawn most
    actions: ClassVar[dict[str, int]] = {**ACTIONS, "pressure": 4, "spill": 2}
    # A hybrid hit needs every group's blocks at once, and lazy stores reach the CPU in GPU
    # eviction order (a window's early pages before the rest): room for a few turns per group.
    cpu_sizes = (24, 8, 48, 1, 3)
    cpu_per_group = True

    def _cpu_presence(self, req) -> int:
        """The CPU hit of ``req`` (every group at once: a window or a state may be missing)."""
        h = self.rig
        return find_longest_hit(h.layout, h.cpu, req.keys.tolist(), req.num_tokens - 1).num_tokens

    def _lose_gpu_copies(self, keys: set[int]) -> None:
        """The prefix leaves the GPU as allocation evicts it, with every free block ahead of
        it in the eviction order: the walks of earlier steps offloaded what they reached."""
        h = self.rig
        free = list(h.gpu.iter_free())
        self._allocate_free(1 + max((i for i, b in enumerate(free)
                                     if h.gpu.block_hash(b) in keys), default=-1))


class TritonMachine(PlannerMachine):
    """The same rules with every copy through the Triton kernel (interpreted on CPU)."""

    backend = "triton"


# CI's counts keep the suite within its time; KVTRITON_HYPOTHESIS_PROFILE=long runs 20x as many
# (and longer programs), KVTRITON_FUZZ_EXAMPLES any count.
TestFusedRestore = FusedRestoreMachine.TestCase
TestFusedRestore.settings = _settings(150)
TestFusedNoRestore = FusedNoRestoreMachine.TestCase
TestFusedNoRestore.settings = _settings(100)
TestLoopRestore = LoopRestoreMachine.TestCase
TestLoopRestore.settings = _settings(100)
TestLoopNoRestore = LoopNoRestoreMachine.TestCase
TestLoopNoRestore.settings = _settings(100)
TestLazy = LazyMachine.TestCase
TestLazy.settings = _settings(100)
TestTriton = TritonMachine.TestCase
TestTriton.settings = _settings(20, steps=50)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_minimum_gpu_pool_runs_the_largest_request(name):
    """The smallest GPU pool the machines draw fits the largest request they admit."""
    layout = LAYOUTS[name]
    rig = Rig(layout, min_gpu_blocks(layout), 1,
              PlannerConfig(world_size=2), "torch")
    toks = tokens_for(7, max_tokens(layout) - layout.hash_block_size)
    out = MAX_OUT * layout.scheduler_block_size
    req = rig.request("big", toks, out)
    assert rig.blocks_needed(req, len(toks)) <= rig.gpu.num_free_blocks
    rig.admit(req)
    while req.num_computed_tokens < len(toks):
        rig.step(decode=True)
        rig.check()
        rig.deliver_all()
        rig.check()
    rig.quiesce()


def _hybrid_prompt_in_cpu_only(cpu_blocks: int = 24) -> Rig:
    """A 24-token prompt of family 1, stored in the CPU (both groups), gone from the GPU."""
    rig = Rig(LAYOUTS["hybrid"], 40, cpu_blocks, PlannerConfig(), "torch")
    rig.admit(rig.request("a", tokens_for(1, 24)))
    rig.step({"a": 24})
    rig.finish("a")
    rig.step({})
    rig.deliver_all()
    for b in list(rig.gpu.iter_free()):
        rig.gpu.evict_cached(b)
    return rig


def test_partial_accept_of_a_hybrid_hit_loads_the_window_of_the_shorter_hit():
    """A sliding window needs, at a shorter hit, blocks the longer hit left null (out of its
    window): the planner looks the shorter hit up again and loads the window of the accepted 12
    tokens (the accepted prefix of the longer hit's blocks would leave that window unloaded and
    the request running on garbage)."""
    rig = _hybrid_prompt_in_cpu_only()
    req = rig.request("b", tokens_for(1, 28))
    assert rig.planner.get_num_new_matched_tokens(req, 0) == (24, True)
    assert rig.admit(req, accept=12, ext=24) == (0, 12)
    load = rig.planner.queued_loads()["b"]
    window = rig.running["b"].tables[1][:3]  # tokens [3, 12) need sliding-window blocks 0..2
    assert sorted(load.gpu_blocks) == sorted(rig.running["b"].tables[0][:3] + window)
    rig.step({})
    rig.deliver_all()  # checks the loaded bytes of every block it hashes
    rig.check()
    rig.quiesce()


def test_partial_accept_the_cpu_cannot_serve_is_refused():
    """Without the window blocks of the shorter hit in the CPU, accepting it is an error that
    changes nothing (the hit stays pinned), not a load that silently misses them; accepting
    none of it then releases the hit."""
    rig = _hybrid_prompt_in_cpu_only()
    req = rig.request("b", tokens_for(1, 28))
    window_key = int(req.keys[1, 0])  # sliding-window block 0: out of the 24-token hit's window
    rig.cpu.evict_cached(rig.cpu.get_cached_block(window_key))
    assert rig.planner.get_num_new_matched_tokens(req, 0) == (24, True)
    table = (rig.gpu.get_new_blocks(3), rig.gpu.get_new_blocks(3))
    pinned = rig.cpu.num_used_blocks
    with pytest.raises(ValueError, match="cannot supply exactly 12 of its 24-token hit"):
        rig.planner.update_state_after_alloc(req, table, 12)
    assert pinned > 0 and rig.cpu.num_used_blocks == pinned
    rig.planner.update_state_after_alloc(req, table, 0)
    assert rig.cpu.num_used_blocks == 0
    rig.gpu.free_blocks(table[0] + table[1])
    rig.planner.request_finished(req)
    rig.quiesce()


# ---- lazy mode on hybrid layouts: stores name their group, a later turn loads every group -------


def _lazy_turn_from_cpu(name: str, check_groups: bool = True) -> tuple[Rig, PlannerMeta]:
    """A 40-token prompt computed and finished under lazy mode; the walk of the next step
    offloads every block it freed (sliding-window pages and Mamba states dropped while it ran
    included); allocation then takes the whole GPU free queue, so the next turn (the prompt and
    8 more tokens) can only be served from the CPU. Returns the rig and the step issuing the
    load, whose copies have run; every invariant and byte check passed along the way (and,
    with ``check_groups``, each store named the group of its GPU block's key)."""
    rig = Rig(LAYOUTS[name], 64, 64, PlannerConfig(lazy=True), "torch")
    rig.admit(rig.request("a", tokens_for(1, 40)))
    rig.step({"a": 40})
    rig.check()
    rig.finish("a")
    stores = rig.step({}).store
    for b, g in zip(stores.gpu_blocks, stores.groups, strict=True):
        assert not check_groups or g == rig.key_group[rig.gpu.block_hash(b)], (
            f"GPU block {b} stored as group {g}")
    rig.deliver_all()
    rig.check()  # every registered CPU block holds its key's bytes, of its key's group
    rig.gpu.free_blocks(rig.gpu.get_new_blocks(rig.gpu.num_free_blocks))
    assert rig.gpu.num_cached_keys == 0
    assert rig.admit(rig.request("b", tokens_for(1, 48))) == (0, 40)
    meta = rig.step({})
    rig.deliver_all()  # checks the loaded bytes, then every block it hashes
    rig.check()
    return rig, meta


@pytest.mark.parametrize("name", ["hybrid", "three"])
def test_lazy_stores_serve_a_hybrid_hit_of_every_group(name):
    """Lazy mode on full attention + a sliding window (and + Mamba states): each store names
    the group its GPU block was cached for, the CPU registers it under that group, and the next
    turn's hit loads every group's blocks (10 full-attention blocks, the 3 window pages before
    token 40, the state saved at 40) with their keys' bytes."""
    rig, meta = _lazy_turn_from_cpu(name)
    layout = rig.layout
    held = {}
    for c in range(1, rig.cpu.num_blocks):
        if (k := rig.cpu.block_hash(c)) is not None:
            g = rig.cpu.block_group(c)
            assert g == rig.key_group[k], f"CPU block {c} of key {k} registered as group {g}"
            held[layout.groups[g].kind] = held.get(layout.groups[g].kind, 0) + 1
    assert held == {"full": 10, "sliding_window": 10, **({"mamba": 5} if name == "three" else {})}
    load = meta.load
    expected = {0: 10, 1: 3, **({2: 1} if name == "three" else {})}
    assert {g: load.groups.count(g) for g in set(load.groups)} == expected
    assert rig.planner.stats.cpu_hit_tokens == 40
    assert rig.planner.stats.lazy_stored == sum(held.values())
    rig.quiesce()


@pytest.mark.parametrize("check", ["group_ids", "bytes"])
def test_lazy_stores_with_the_wrong_group_are_caught(monkeypatch, check):
    """Negative control: a pool that names group 0 for every block (what lazy mode assumed
    before it read the block's group) makes the lazy stores copy a window page or a Mamba state
    from the full-attention group's tensors: the stored group ids disagree with the keys'
    groups, and without that check the CPU block's bytes give it away."""
    from kvtriton.pool import BlockPool

    monkeypatch.setattr(BlockPool, "block_group",
                        lambda self, b: None if self.block_hash(b) is None else 0)
    match = (r"GPU block \d+ stored as group 0" if check == "group_ids" else
             r"CPU block \d+ is registered under key \d+ \(group [12]\) but segment 0 holds "
             r"other bytes")
    with pytest.raises(AssertionError, match=match):
        _lazy_turn_from_cpu("three", check_groups=check == "group_ids")
