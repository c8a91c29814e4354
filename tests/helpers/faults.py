"""Faults injected into the worker's ``TransferEngine`` for the end-to-end tests.

``inject("corrupt_loads")`` is the negative control: each CPU load's destination blocks get the
wrong (valid) KV once the load landed, so outputs that depend on loaded KV must change.
``inject("fail_loads")`` makes each load fail half-way, as a copy that dies would.
``inject("corrupt_sync_cpu")`` is the negative control of same-step loads
(``sync_load_budget_bytes``): the CPU copy each of them reads is scrambled while it loads (and
put back after, so later loads of those blocks read valid KV).
``inject("late_reports")`` reports each finished transfer ``LATE_POLLS`` polls after it finished,
as a GPU's asynchronous copies are (on CPU a copy completes within its step, so no store would
outlive a step otherwise). Pass ``patch=lambda: inject(fault)`` to
``bench.vllm.engine_run.run_turns``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

FAULTS = ("corrupt_loads", "fail_loads", "late_reports", "corrupt_sync_cpu")
#: How many polls ``late_reports`` holds a finished transfer back.
LATE_POLLS = 3


def _scramble(engine: Any, gpu_blocks: Sequence[int], groups: Sequence[int]) -> None:
    """Rotate the contents of ``gpu_blocks`` by one (block i gets block i+1's KV; one block
    gets zeros): valid KV in the wrong place, as a wrong block mapping would leave it."""
    for g, views in enumerate(engine.segments):
        rows = [b for b, gg in zip(gpu_blocks, groups, strict=True) if gg == g]
        for view, _ in views:  # uint8 [num_gpu_blocks, nbytes], sharing the KV storage
            if len(rows) > 1:
                view[rows] = view[rows[1:] + rows[:1]].clone()
            elif rows:
                view[rows] = 0


def inject(fault: str) -> Callable[[], None]:
    """Patch ``TransferEngine`` in this process; returns the undo. ``"corrupt_loads"``: every
    load lands scrambled (the negative control). ``"fail_loads"``: every load writes the
    scrambled blocks and then raises, as a copy that dies half-way would (the connector must
    report it failed, and vLLM recompute)."""
    from kvtriton.engine.transfer import TransferEngine

    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}: expected one of {FAULTS}")
    if fault == "corrupt_sync_cpu":
        return _corrupt_sync_cpu()
    load, copy, poll = TransferEngine.load, TransferEngine._copy, TransferEngine.poll
    held: list[list] = []  # [polls left, store events, load request ids]

    def late(self):
        stores, loads = poll(self)
        if stores or loads:
            held.append([LATE_POLLS, stores, loads])
        out_stores, out_loads = [], []
        for h in held:
            h[0] -= 1
            if h[0] < 0:
                out_stores += h[1]
                out_loads += h[2]
        held[:] = [h for h in held if h[0] >= 0]
        return out_stores, out_loads

    def corrupted(self, event, req_ids, gpu_blocks, cpu_blocks, groups, **kw):
        load(self, event, req_ids, gpu_blocks, cpu_blocks, groups, **kw)
        _scramble(self, list(gpu_blocks), list(groups))

    def failing(self, direction, pairs):
        copy(self, direction, pairs)
        if direction == "load":
            _scramble(self, pairs.gpu.tolist(), pairs.grp.tolist())
            raise RuntimeError("injected load failure")

    if fault == "corrupt_loads":
        TransferEngine.load = corrupted
    elif fault == "fail_loads":
        TransferEngine._copy = failing
    else:
        TransferEngine.poll = late

    def undo() -> None:
        TransferEngine.load, TransferEngine._copy, TransferEngine.poll = load, copy, poll

    return undo


def _corrupt_sync_cpu() -> Callable[[], None]:
    """Patch ``WorkerSide._load_now`` (same-step loads): the CPU rows it reads are rotated by
    one (one row alone is zeroed) for the load, then restored."""
    from kvtriton.vllm.worker_side import WorkerSide

    load_now = WorkerSide._load_now

    def corrupted(self, t, req_ids):
        pool = self.engine.cpu_pool
        rows = list(dict.fromkeys(t.cpu_blocks))
        saved = pool[rows].clone()
        pool[rows] = saved[[*range(1, len(rows)), 0]] if len(rows) > 1 else 0
        try:
            load_now(self, t, req_ids)
        finally:
            pool[rows] = saved

    WorkerSide._load_now = corrupted

    def undo() -> None:
        WorkerSide._load_now = load_now

    return undo
