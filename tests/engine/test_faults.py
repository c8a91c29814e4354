"""Fault injection: a transfer that fails in the engine's backend, wired through to the planner.

A scheduler (``helpers.planner_driver.PlannerDriver``) and one worker (a real ``TransferEngine``
over tiny int32 KV tensors) are connected the way a server connects them: each step's
``PlannerMeta`` goes to ``engine.execute``; ``engine.poll()`` and ``engine.poll_failures()`` go
back to the planner through ``update_connector_output(completed_stores, finished_loads,
failed_stores, failed_loads)``.

The backend (the torch index copies or the Triton launcher) is replaced by one that scribbles over
the destination blocks and then raises, as a launch that dies half way would. For every kind of
exception the failed transfer must release its blocks, register nothing, be counted in
``planner.stats.failed_transfers`` and logged (by the worker and by the scheduler), while the rest
of the step and every later step proceed: the failed blocks are stored again, a failed load is
recomputed, and at the end both pools are all-free.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import kvtriton.engine.transfer as transfer_mod
from helpers.device_lane import DEVICE
from helpers.planner_driver import PlannerDriver, tokens_for
from kvtriton.engine import TransferEngine, allocate_kv_caches
from kvtriton.planner import PlannerConfig
from kvtriton.specs import FullAttentionSpec, KVLayout

pytestmark = pytest.mark.device_lane

LAYOUT = KVLayout([FullAttentionSpec(4, 1, 4, 1, dtype=torch.int32)], name="faults")
B = LAYOUT.scheduler_block_size
GPU_BLOCKS = 32
BACKENDS = ["torch", "triton"]
FAULTS = {
    "launch-error": lambda: RuntimeError("Triton Error [CUDA]: unspecified launch failure"),
    "backend-value-error": lambda: ValueError("cpu_pool is not pinned (page-locked)"),
    "out-of-memory": lambda: torch.OutOfMemoryError("CUDA out of memory"),
}
# The backend functions TransferEngine._copy calls, per backend and direction.
BACKEND_FNS = {("torch", "store"): "store_blocks_ref", ("torch", "load"): "load_blocks_ref",
               ("triton", "store"): "copy_blocks", ("triton", "load"): "copy_blocks"}


def pattern(key: int, segment: int, nbytes: int) -> torch.Tensor:
    """The bytes segment ``segment`` of the block keyed ``key`` holds (never 0xFF or 0xAB)."""
    seed = (key * 0x9E3779B1 + segment * 0x85EBCA77 + 1) & 0x7FFFFFFF
    i = np.arange(1, nbytes + 1, dtype=np.int64)
    return torch.from_numpy((((i * seed) >> 7) % 151).astype(np.uint8))


class Node:
    """One scheduler and one worker, wired as a server wires them."""

    def __init__(self, backend: str, cpu_blocks: int = 8, **config) -> None:
        self.h = PlannerDriver(LAYOUT, GPU_BLOCKS, cpu_blocks, PlannerConfig(**config))
        kv = allocate_kv_caches(LAYOUT, GPU_BLOCKS, device=DEVICE)
        for t in kv[0]:
            t.fill_(-1)
        self.engine = TransferEngine(LAYOUT, kv, self.h.cpu.num_blocks, backend=backend)
        self.views = [view for view, _ in self.engine.segments[0]]
        self.filled: dict[int, int] = {}  # GPU block -> the key whose bytes it holds
        self.load_keys: dict[int, list[int]] = {}  # load event -> key of each CPU source

    @property
    def planner(self):
        return self.h.planner

    def step(self, scheduled: dict[str, int] | None = None, **kw):
        """Schedule, plan, hand the transfers to the worker, then "compute" the new blocks."""
        meta = self.h.step(scheduled, **kw)
        if meta.load.event >= 0:
            self.load_keys[meta.load.event] = [self.h.cpu.block_hash(c)
                                               for c in meta.load.cpu_blocks]
        self.engine.execute(meta)
        self._fill_computed()
        return meta

    def _fill_computed(self) -> None:
        for b in range(1, GPU_BLOCKS):
            k = self.h.gpu.block_hash(b)
            if k is None:  # reallocated since (a load may be writing it): holds nothing known
                self.filled.pop(b, None)
            elif self.filled.get(b) != k:
                for s, view in enumerate(self.views):
                    view[b] = pattern(k, s, view.shape[1])
                self.filled[b] = k

    def holds(self, gpu_block: int, key: int) -> bool:
        return all(torch.equal(view[gpu_block].cpu(), pattern(key, s, view.shape[1]))
                   for s, view in enumerate(self.views))

    def cpu_holds(self, cpu_block: int, key: int) -> bool:
        pool = self.engine.cpu_pool
        return all(torch.equal(pool[cpu_block, off:off + view.shape[1]],
                               pattern(key, s, view.shape[1]))
                   for s, (view, off) in enumerate(self.engine.segments[0]))

    def report(self, store_reports: int | None = None) -> tuple[list[int], list[str]]:
        """The worker's completions and failures, back to the planner (through the driver,
        which also keeps its own books). Returns what failed."""
        self.engine.flush()  # under CUDA the copies run on side streams; a no-op on CPU
        stored, loaded = self.engine.poll()
        failed_stores, failed_loads = self.engine.poll_failures()
        h = self.h
        h.complete_stores(stored, reports=store_reports, failed=failed_stores)
        for failed, rids in ((False, loaded), (True, failed_loads)):
            events = sorted({ev for ev, (_, _, reqs) in h.loads.items() if set(reqs) & set(rids)})
            if not failed:
                for ev in events:  # a completed load holds the bytes of its CPU sources
                    gpu = h.loads[ev][0]
                    for b, k in zip(gpu, self.load_keys.pop(ev), strict=True):
                        assert self.holds(b, k), f"load {ev}: GPU block {b} lacks key {k}"
                        self.filled[b] = k
            h.complete_loads(events, failed=failed)
        return failed_stores, failed_loads

    def check(self) -> None:
        """Every reference accounted for; every registered CPU block holds its key's bytes."""
        self.h.check_invariants()
        for c in range(1, self.h.cpu.num_blocks):
            k = self.h.cpu.block_hash(c)
            if k is not None:
                assert self.cpu_holds(c, k), f"CPU block {c} is registered as {k}, holds other"

    def drain(self) -> None:
        for rid in list(self.h.running) + list(self.h.preempted):
            self.h.finish(rid)
        for _ in range(4):
            self.step({})
            self.report()
        self.check()
        assert not self.planner.has_pending_work()
        assert self.h.gpu.num_used_blocks == 0 and self.h.cpu.num_used_blocks == 0


def break_backend(monkeypatch, node: Node, backend: str, direction: str, fault: str,
                  times: int = 1) -> list[int]:
    """The next ``times`` copies in ``direction`` scribble 0xAB over their destinations and raise
    ``FAULTS[fault]``; returns a one-item list counting the faults fired."""
    name = BACKEND_FNS[backend, direction]
    real = getattr(transfer_mod, name)
    fired = [0]

    def broken(*args, **kwargs):
        if backend == "triton":
            d = args[0]
            gpu, cpu = args[3], args[4]
        else:
            d = direction
            gpu, cpu = args[2], args[3]
        if d != direction or fired[0] >= times:
            return real(*args, **kwargs)
        fired[0] += 1
        if direction == "store":
            node.engine.cpu_pool[torch.as_tensor(np.asarray(cpu), dtype=torch.int64)] = 0xAB
        else:
            for view in node.views:
                view[torch.as_tensor(np.asarray(gpu), dtype=torch.int64)] = 0xAB
        raise FAULTS[fault]()

    monkeypatch.setattr(transfer_mod, name, broken)
    return fired


def _run_prompt(node: Node, rid: str, family: int, n_blocks: int):
    req = node.h.request(rid, tokens_for(family, n_blocks * B + 1))
    node.h.admit(req)
    node.step()  # computes the prompt
    return req


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_store_releases_its_blocks_caches_nothing_and_is_stored_again(
        monkeypatch, caplog, backend, fault):
    node = Node(backend)
    h = node.h
    req = _run_prompt(node, "a", 1, 3)
    fired = break_backend(monkeypatch, node, backend, "store", fault)
    caplog.set_level(logging.WARNING)
    meta = node.step({"a": 1})  # a decode step: the prompt's 3 blocks are stored
    assert fired == [1] and len(meta.store) == 3
    failed_stores, _ = node.report()
    assert failed_stores == [meta.store.event]
    # Released, nothing registered, counted, logged by both sides.
    assert h.cpu.num_used_blocks == 0 and h.cpu.num_cached_keys == 0
    assert all(c not in h.cpu.cached_blocks(k) for c in meta.store.cpu_blocks
               for k in h.primary_keys(req).tolist())
    assert node.planner.stats.failed_transfers == 1
    assert node.planner.stats.stores_completed == 0
    assert f"store event {meta.store.event} failed" in caplog.text  # the worker
    assert "failed on a worker: 3 blocks released, nothing cached" in caplog.text  # the planner
    node.check()
    # The planner keeps serving: the next step stores the same blocks again, intact this time.
    meta = node.step({"a": 1})
    assert sorted(meta.store.gpu_blocks) == sorted(h.running["a"].tables[0][:3])
    assert node.report() == ([], [])
    assert h.cpu_prefix_blocks(req) == 3
    node.check()
    node.drain()


@pytest.mark.parametrize("fault", ["launch-error", "backend-value-error"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_load_releases_its_pins_and_the_request_recomputes(
        monkeypatch, caplog, backend, fault):
    node = Node(backend)
    h = node.h
    _run_prompt(node, "a", 1, 3)
    node.step({"a": 1})
    node.report()
    h.finish("a")
    node.step({})
    node.report()
    for b in list(h.gpu.iter_free()):  # the GPU prefix cache forgets the prompt
        h.gpu.evict_cached(b)
    b_req = h.request("b", tokens_for(1, 3 * B + 1))
    assert h.admit(b_req) == (0, 3 * B)
    fired = break_backend(monkeypatch, node, backend, "load", fault)
    caplog.set_level(logging.WARNING)
    meta = node.step()
    assert fired == [1] and len(meta.load) == 3
    assert node.planner.load_pending("b")
    _, failed_loads = node.report()
    assert failed_loads == ["b"]
    assert not node.planner.load_pending("b")
    assert node.planner.stats.failed_transfers == 1
    assert h.cpu.num_used_blocks == 0, "the failed load's CPU pins were not released"
    assert h.cpu.num_cached_keys == 3, "a failed load must not touch the CPU copies"
    assert f"load event {meta.load.event} failed" in caplog.text
    assert "load of request 'b' failed on a worker: 3 blocks released" in caplog.text
    node.check()
    # The scheduler recomputes the scribbled blocks; then a third request loads them intact.
    assert b_req.num_computed_tokens == 0
    # b is not offered the hit again: vLLM looks a failed request up again, and a copy that
    # keeps failing would load, fail and retry forever (found in vLLM's engine).
    assert node.planner.get_num_new_matched_tokens(b_req, 0) == (0, False)
    node.step()
    assert all(node.holds(b, k) for b, k in zip(h.running["b"].tables[0][:3],
                                                h.primary_keys(b_req).tolist(), strict=True))
    h.finish("b")
    node.step({})
    node.report()
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)
    c_req = h.request("c", tokens_for(1, 3 * B + 2))
    assert h.admit(c_req) == (0, 3 * B)
    node.step()
    assert node.report() == ([], [])
    assert node.planner.stats.blocks_loaded == 3
    node.check()
    node.drain()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_backend_value_error_fails_one_transfer_not_the_step(monkeypatch, backend):
    """A ``ValueError`` the backend raises fails that transfer, not the step: the pairs are
    validated before any copy starts, so the step's load is still submitted and reported
    (re-raised out of ``execute``, it would leak its pins and leave its request waiting
    forever)."""
    node = Node(backend)
    h = node.h
    _run_prompt(node, "a", 1, 3)
    node.step({"a": 1})
    node.report()
    h.finish("a")
    node.step({})
    node.report()
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)
    _run_prompt(node, "x", 2, 2)  # computes blocks the next step stores
    b_req = h.request("b", tokens_for(1, 3 * B + 1))
    assert h.admit(b_req) == (0, 3 * B)
    break_backend(monkeypatch, node, backend, "store", "backend-value-error")
    meta = node.step({"x": 1})  # one store (fails) and one load (must still run)
    assert meta.store.event >= 0 and meta.load.event >= 0
    failed_stores, failed_loads = node.report()
    assert failed_stores == [meta.store.event] and failed_loads == []
    assert not node.planner.load_pending("b")
    assert node.planner.stats.blocks_loaded == 3
    node.check()
    node.drain()


@pytest.mark.parametrize("failing_worker_first", [True, False])
def test_one_worker_fails_the_other_succeeds(monkeypatch, failing_worker_first):
    """``world_size=2``: one worker's copy fails, the other's lands. The store fails once,
    whichever report comes first; the late success is a stale report; nothing is cached."""
    node = Node("torch", world_size=2)
    h = node.h
    _run_prompt(node, "a", 1, 2)
    break_backend(monkeypatch, node, "torch", "store", "launch-error")
    meta = node.step({"a": 1})
    ev = meta.store.event
    assert node.engine.poll() == ([], [])
    failed, _ = node.engine.poll_failures()
    assert failed == [ev]
    if failing_worker_first:
        h.complete_stores([], failed=[ev])
        h.planner.update_connector_output(completed_stores={ev: 1})  # the other worker, late
    else:
        h.complete_stores([ev], reports=1)  # the other worker: 1 of 2, nothing yet
        assert h.cpu.num_cached_keys == 0 and h.cpu.num_used_blocks == 2
        h.complete_stores([], failed=[ev])
    assert h.cpu.num_cached_keys == 0 and h.cpu.num_used_blocks == 0
    assert node.planner.stats.failed_transfers == 1
    assert node.planner.stats.stale_reports == int(failing_worker_first)
    node.check()
    node.drain()


def test_failed_transfer_abandoned_by_reset_is_released(monkeypatch):
    """A store in flight when the planner resets fails afterwards: its pins are still released
    and it is counted; the CPU cache can then be cleared."""
    node = Node("torch")
    h = node.h
    _run_prompt(node, "a", 1, 2)
    break_backend(monkeypatch, node, "torch", "store", "launch-error")
    meta = node.step({"a": 1})
    assert meta.store.event >= 0
    assert node.planner.reset() is False  # a store is in flight
    h.abandon_tracking()
    assert node.planner.stats.abandoned_stores == 1
    node.report()
    assert node.planner.stats.failed_transfers == 1
    assert h.cpu.num_used_blocks == 0 and h.gpu.num_used_blocks == 0
    assert not node.planner.has_pending_work()
    assert node.planner.reset() is True
    node.check()


def test_a_backend_failing_every_store_leaks_nothing(monkeypatch):
    """A backend that fails every store for a while: requests still run to the end, nothing is
    ever registered or leaked, and once it recovers the tier fills again."""
    node = Node("torch", cpu_blocks=4)
    h = node.h
    break_backend(monkeypatch, node, "torch", "store", "launch-error", times=10**6)
    for i in range(6):
        req = h.request(f"r{i}", tokens_for(i % 2, 3 * B + 2), output=2)
        h.admit(req)
        for _ in range(4):  # prefill, then decode
            node.step(decode=True)
            node.report()
            node.check()
        h.finish(f"r{i}")
        node.step({})
        node.report()
        assert h.cpu.num_cached_keys == 0 and h.cpu.num_used_blocks == 0
    assert node.planner.stats.failed_transfers > 0
    assert node.planner.stats.stores_completed == 0
    monkeypatch.undo()
    req = h.request("ok", tokens_for(7, 2 * B + 1))
    h.admit(req)
    node.step()
    node.step({"ok": 1})
    node.report()
    assert h.cpu_prefix_blocks(req) == 2
    node.check()
    node.drain()


class _FakeEvent:
    """A CUDA event stand-in: ``query`` answers from a script (True, False, or an exception)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)

    def query(self) -> bool:
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_a_device_fault_found_by_poll_is_a_failure_reported_once(caplog):
    """Under CUDA a copy kernel that faults is only seen when its event is queried: the faulted
    transfer is a failure, reported once through ``poll_failures``, and the exception stays inside
    ``poll`` (let out after the jobs before it moved to the done lists, the next ``poll`` would
    report those twice, a double completion, and the fault never). (On CPU tensors the engine
    never has jobs in flight, so they are staged here by hand.)"""
    engine = Node("torch").engine
    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    engine._in_flight = [
        transfer_mod._InFlight("store", 1, done=_FakeEvent(True)),
        transfer_mod._InFlight("store", 2, done=_FakeEvent(fault)),
        transfer_mod._InFlight("load", 3, ["r"], done=_FakeEvent(False, True)),
    ]
    caplog.set_level(logging.ERROR)
    assert engine.poll() == ([1], [])
    assert engine.poll_failures() == ([2], [])
    assert "store event 2 failed" in caplog.text
    assert engine.poll() == ([], ["r"])
    assert engine.poll() == ([], []) and engine.poll_failures() == ([], [])
    assert engine.num_in_flight == 0
