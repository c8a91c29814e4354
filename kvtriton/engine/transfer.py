"""``TransferEngine``: the worker side of the CPU tier.

It registers a layout's KV tensors, builds the copy tables once, owns the CPU pool and runs each
planner step's store and load:

- a store waits for a compute-done event (by default recorded on the current stream when the step
  is submitted: the forward pass that wrote the blocks is queued before it) and runs on a
  low-priority side stream;
- a load runs on its own low-priority stream, ordered after the compute queued so far (which may
  still read the destination blocks); compute that uses the loaded blocks waits for it through
  ``wait_for_loads`` (or simply runs after ``poll`` reported the load, which implies completion);
- ``poll`` reports completed store events and the request ids whose loads finished.

Backends: ``"triton"`` (the one-launch copy kernel), ``"copy_engine"`` (one DMA copy per contiguous
piece, ``copy_engine.py``), ``"auto"`` (per step and group, the copy engine where pieces are large
and few enough, the kernel otherwise) and ``"torch"`` (vectorized index copies, the fast path on
CPU). On CPU tensors every transfer runs synchronously and is reported by the next ``poll``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtriton.engine.copy_engine import (
    COPY_ENGINE_MAX_PIECES,
    COPY_ENGINE_MIN_PIECE_BYTES,
    build_piece_table,
    choose_copy_engine,
    copy_pieces,
)
from kvtriton.engine.descriptors import ATTN_LAYOUTS, build_copy_table, segment_views
from kvtriton.engine.host_memory import allocate_host_pool
from kvtriton.kernels.copy_blocks import DEFAULT_SM_BUDGET, copy_blocks
from kvtriton.kernels.pairs import validate_pairs
from kvtriton.kernels.reference import load_blocks_ref, store_blocks_ref
from kvtriton.records import PlannerMeta, Transfer
from kvtriton.specs import KVLayout
from kvtriton.validation import is_int

__all__ = ["BACKENDS", "TransferEngine"]

log = logging.getLogger(__name__)

BACKENDS = ("triton", "torch", "copy_engine", "auto")


@dataclass(slots=True)
class _InFlight:
    kind: str  # "store" or "load"
    event_id: int
    req_ids: list[str] = field(default_factory=list)
    done: torch.cuda.Event | None = None
    start: torch.cuda.Event | None = None
    nbytes: int = 0
    seconds: float = 0.0  # CPU path: measured around the copy


@dataclass(slots=True)
class _Pairs:
    gpu: np.ndarray
    cpu: np.ndarray
    grp: np.ndarray


def _check_event(direction: str, event) -> int:
    if not is_int(event) or event < 0:
        raise ValueError(f"{direction} event must be a non-negative int, got {event!r}")
    return int(event)


class TransferEngine:
    """Moves KV blocks between the GPU KV tensors of ``layout`` and a pinned CPU pool.

    ``kv_caches[g][layer]``: an attention tensor per layer in ``attn_layout``
    (``[2, num_gpu_blocks, ...]`` for ``"flash_attn"``, ``[num_gpu_blocks, 2, ...]`` for
    ``"flashinfer"``, ``[num_gpu_blocks, ...]`` with K and V in one range per block for
    ``"block_major"``); for a Mamba group a pair ``(conv, ssm)`` of ``[num_gpu_blocks, ...]``
    tensors. Any dtype and strides whose blocks are each one dense byte range of the layout's
    bytes per block; copies are byte copies. ``backend`` is one of ``BACKENDS`` (module
    docstring). ``sm_budget`` bounds the kernel's programs. With ``backend="auto"`` a group's
    pairs go through the copy engine when its smallest piece has at least
    ``copy_engine_min_piece_bytes`` bytes, while the step's copy-engine pieces stay within
    ``copy_engine_max_pieces`` (``choose_copy_engine``).

    Example::

        engine = TransferEngine(layout, kv_caches, num_cpu_blocks=1024, backend="torch")
        engine.execute(meta)                     # PlannerMeta of one step
        stored_events, loaded_req_ids = engine.poll()
    """

    def __init__(self, layout: KVLayout, kv_caches: Sequence, num_cpu_blocks: int, *,
                 backend: str = "triton", attn_layout: str = "flash_attn",
                 sm_budget: int | None = None,
                 copy_engine_min_piece_bytes: int = COPY_ENGINE_MIN_PIECE_BYTES,
                 copy_engine_max_pieces: int = COPY_ENGINE_MAX_PIECES):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if attn_layout not in ATTN_LAYOUTS:
            raise ValueError(f"attn_layout must be one of {ATTN_LAYOUTS}, got {attn_layout!r}")
        if not is_int(num_cpu_blocks) or num_cpu_blocks <= 0:
            raise ValueError(f"num_cpu_blocks must be a positive int, got {num_cpu_blocks!r}")
        if sm_budget is not None and (not is_int(sm_budget) or sm_budget <= 0):
            raise ValueError(f"sm_budget must be a positive int or None, got {sm_budget!r}")
        for name, value in (("copy_engine_min_piece_bytes", copy_engine_min_piece_bytes),
                            ("copy_engine_max_pieces", copy_engine_max_pieces)):
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        self.layout = layout
        self.backend = backend
        self.attn_layout = attn_layout
        self.num_cpu_blocks = num_cpu_blocks
        self.copy_engine_min_piece_bytes = copy_engine_min_piece_bytes
        self.copy_engine_max_pieces = copy_engine_max_pieces
        self.segments = segment_views(layout, kv_caches, attn_layout)
        self.table = build_copy_table(layout, self.segments)
        self.pieces = build_piece_table(self.segments)
        self.device = self.table.device
        self._cuda = self.device.type == "cuda"
        if backend in ("triton", "auto") and not self._cuda:
            from kvtriton.kernels.copy_blocks import INTERPRETED

            if not INTERPRETED:
                raise ValueError(f"backend={backend!r} needs CUDA KV tensors or TRITON_INTERPRET=1 "
                                 f"(tensors are on {self.device}); use backend='torch' on CPU")
        if sm_budget is None:
            sm_budget = DEFAULT_SM_BUDGET
            if self._cuda:
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
                sm_budget = min(sm_budget, sms)
        self.sm_budget = sm_budget
        self._pool = allocate_host_pool(num_cpu_blocks, layout.cpu_block_bytes, pin=self._cuda)
        self._in_flight: list[_InFlight] = []
        self._done_stores: list[int] = []
        self._done_loads: list[str] = []
        self._failed_stores: list[int] = []
        self._failed_loads: list[str] = []
        self._last_load: torch.cuda.Event | None = None
        # Bytes per block of each group (all its layers), and what completed transfers moved:
        # direction -> [transfers, bytes, seconds of copying] (device time under CUDA).
        self._group_bytes = np.array([sum(v.shape[1] for v, _ in views)
                                      for views in self.segments], dtype=np.int64)
        self.totals: dict[str, list[float]] = {"store": [0, 0, 0.0], "load": [0, 0, 0.0]}
        if self._cuda:
            # Priority 0 is CUDA's lowest: copies yield to the model's kernels.
            self._store_stream = torch.cuda.Stream(self.device, priority=0)
            self._load_stream = torch.cuda.Stream(self.device, priority=0)

    @property
    def cpu_pool(self) -> torch.Tensor:
        """The ``[num_cpu_blocks, layout.cpu_block_bytes]`` uint8 pool (pinned under CUDA)."""
        return self._pool.tensor

    @property
    def cpu_pool_device_ptr(self) -> int:
        """The pool's address as the copy kernel sees it (its host address without CUDA)."""
        return self._pool.device_ptr

    @property
    def num_in_flight(self) -> int:
        """What ``poll`` has still to report, in its own units: store events, and the request
        ids of loads (one load event serves several requests), running or finished."""
        running = sum(1 if job.kind == "store" else len(job.req_ids) for job in self._in_flight)
        return running + len(self._done_stores) + len(self._done_loads)

    def _validate(self, direction: str, gpu_blocks, cpu_blocks, groups) -> _Pairs:
        gpu, cpu, grp = validate_pairs(self.table, self.num_cpu_blocks, direction,
                                       gpu_blocks, cpu_blocks, groups)
        return _Pairs(gpu, cpu, grp)

    def copy_engine_groups(self, groups) -> np.ndarray:
        """``[G]`` bool: the groups whose pairs in a step with these group ids (host ints) the
        copy engine moves; what ``backend`` decides, whichever it is."""
        counts = np.bincount(np.asarray(groups, dtype=np.int64), minlength=self.layout.num_groups)
        if self.backend == "copy_engine":
            return counts > 0
        if self.backend != "auto":
            return np.zeros(self.layout.num_groups, dtype=bool)
        return choose_copy_engine(self.pieces, counts,
                                  min_piece_bytes=self.copy_engine_min_piece_bytes,
                                  max_pieces=self.copy_engine_max_pieces)

    def _copy(self, direction: str, pairs: _Pairs) -> None:
        if len(pairs.gpu) == 0:
            return
        if self.backend == "torch":
            fn = store_blocks_ref if direction == "store" else load_blocks_ref
            fn(self.segments, self.cpu_pool, pairs.gpu, pairs.cpu, pairs.grp)
            return
        dma = self.copy_engine_groups(pairs.grp)[pairs.grp]
        parts = [(self._copy_dma, dma), (self._copy_kernel, ~dma)]
        for run, mask in parts:
            if mask.all():
                run(direction, pairs)
            elif mask.any():
                run(direction, _Pairs(pairs.gpu[mask], pairs.cpu[mask], pairs.grp[mask]))

    def _copy_dma(self, direction: str, pairs: _Pairs) -> None:
        copy_pieces(direction, self.pieces, self.cpu_pool, pairs.gpu, pairs.cpu, pairs.grp,
                    non_blocking=self._cuda)

    def _copy_kernel(self, direction: str, pairs: _Pairs) -> None:
        copy_blocks(direction, self.table, self.cpu_pool, pairs.gpu, pairs.cpu, pairs.grp,
                    sm_budget=self.sm_budget, cpu_pool_device_ptr=self._pool.device_ptr,
                    ids_checked=True)

    def _submit(self, job: _InFlight, pairs: _Pairs, after: torch.cuda.Event | None,
                barrier: Sequence[torch.cuda.Event] = ()) -> None:
        job.nbytes = int(self._group_bytes[pairs.grp].sum())
        try:
            if not self._cuda:
                t0 = time.perf_counter()
                self._copy(job.kind, pairs)
                job.seconds = time.perf_counter() - t0
                self._finish(job)
                return
            if after is None:
                after = torch.cuda.Event()
                after.record(torch.cuda.current_stream(self.device))
            stream = self._store_stream if job.kind == "store" else self._load_stream
            with torch.cuda.stream(stream):
                stream.wait_event(after)
                for event in barrier:
                    stream.wait_event(event)
                job.start = torch.cuda.Event(enable_timing=True)
                job.start.record(stream)
                self._copy(job.kind, pairs)
                job.done = torch.cuda.Event(enable_timing=True)
                job.done.record(stream)
            if job.kind == "load":
                self._last_load = job.done
            self._in_flight.append(job)
        except Exception:
            # The pairs were validated before: whatever the backend raises (a launch error, a
            # CUDA error, a ValueError of its own) is this transfer's failure, reported by
            # poll_failures; raising would leave the planner waiting for it forever. A failed
            # transfer must not be reported as done: its blocks hold no valid data.
            self._fail(job)

    def _fail(self, job: _InFlight) -> None:
        log.exception("%s event %d failed", job.kind, job.event_id)
        if job.kind == "store":
            self._failed_stores.append(job.event_id)
        else:
            self._failed_loads.extend(job.req_ids)

    def _finish(self, job: _InFlight) -> None:
        seconds = job.seconds
        if job.start is not None:
            seconds = job.start.elapsed_time(job.done) / 1e3  # the copy's device time
        t = self.totals[job.kind]
        t[0] += 1
        t[1] += job.nbytes
        t[2] += seconds
        if job.kind == "store":
            self._done_stores.append(job.event_id)
        else:
            self._done_loads.extend(job.req_ids)

    def store(self, event: int, gpu_blocks, cpu_blocks, groups, *,
              after: torch.cuda.Event | None = None) -> None:
        """Copy GPU block ``gpu_blocks[i]`` of group ``groups[i]`` into CPU block
        ``cpu_blocks[i]``; ``poll`` reports ``event`` once every copy landed. Under CUDA the copy
        waits for ``after`` (default: an event recorded now on the current stream)."""
        event = _check_event("store", event)
        pairs = self._validate("store", gpu_blocks, cpu_blocks, groups)
        self._submit(_InFlight("store", event), pairs, after)

    def load(self, event: int, req_ids: Sequence[str], gpu_blocks, cpu_blocks, groups, *,
             after: torch.cuda.Event | None = None) -> None:
        """Copy CPU block ``cpu_blocks[i]`` into GPU block ``gpu_blocks[i]`` of group
        ``groups[i]``; ``poll`` reports ``req_ids`` once every copy landed. Under CUDA the copy
        waits for ``after`` (default: the compute queued so far, which may read the
        destinations)."""
        event = _check_event("load", event)
        pairs = self._validate("load", gpu_blocks, cpu_blocks, groups)
        self._submit(_InFlight("load", event, list(req_ids)), pairs, after)

    def execute(self, meta: PlannerMeta, *, compute_done: torch.cuda.Event | None = None
                ) -> None:
        """Run one planner step: its store, then its load. Both are validated before either
        starts. With ``meta.need_flush`` they are also ordered after every transfer in flight
        (on the GPU streams; the host does not block)."""
        jobs = []
        for direction, transfer in (("store", meta.store), ("load", meta.load)):
            if not isinstance(transfer, Transfer):
                raise ValueError(f"meta.{direction} must be a Transfer, got "
                                 f"{type(transfer).__name__}")
            if transfer.event == -1:
                if len(transfer):
                    raise ValueError(f"meta.{direction} has {len(transfer)} pairs but event -1")
                continue
            event = _check_event(direction, transfer.event)
            pairs = self._validate(direction, transfer.gpu_blocks, transfer.cpu_blocks,
                                   transfer.groups)
            req_ids = list(meta.load_event_to_reqs.get(event, [])) if direction == "load" else []
            jobs.append((_InFlight(direction, event, req_ids), pairs))
        barrier = [j.done for j in self._in_flight] if meta.need_flush else []
        if self._cuda and compute_done is None and jobs:
            compute_done = torch.cuda.Event()
            compute_done.record(torch.cuda.current_stream(self.device))
        for job, pairs in jobs:
            self._submit(job, pairs, compute_done, barrier)

    def wait_for_loads(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current one) wait for every load submitted so far,
        without blocking the host. A no-op on CPU, where loads complete when submitted."""
        if not self._cuda or self._last_load is None:
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self.device)
        stream.wait_event(self._last_load)

    def synchronize_loads(self) -> None:
        """Block the host until every load submitted so far has landed (loads run in order on
        one stream), for compute about to read them that no stream order covers. A no-op on
        CPU. A copy that faulted is left to ``poll``, which reports it failed."""
        if not self._cuda or self._last_load is None:
            return
        try:
            self._last_load.synchronize()
        except Exception:
            log.exception("waiting for the loads in flight failed")

    def poll(self) -> tuple[list[int], list[str]]:
        """Completed store event ids and finished load request ids since the last poll."""
        still = []
        for job in self._in_flight:
            try:
                done = job.done.query()
            except Exception:
                # A copy that faulted on the device surfaces here (CUDA errors are asynchronous):
                # the transfer failed; raising would report the jobs before it twice.
                self._fail(job)
                continue
            if done:
                self._finish(job)
            else:
                still.append(job)
        self._in_flight = still
        stores, loads = self._done_stores, self._done_loads
        self._done_stores, self._done_loads = [], []
        return stores, loads

    def poll_failures(self) -> tuple[list[int], list[str]]:
        """Store event ids and load request ids whose transfer raised (logged when it did);
        their destinations hold no valid data. Cleared by the call."""
        stores, loads = self._failed_stores, self._failed_loads
        self._failed_stores, self._failed_loads = [], []
        return stores, loads

    def flush(self) -> None:
        """Block the host until every submitted transfer has finished (before a reset or
        shutdown); ``poll`` still reports them."""
        for job in self._in_flight:
            job.done.synchronize()

    def close(self) -> None:
        """Wait for transfers in flight and unregister the CPU pool from CUDA."""
        self.flush()
        self._pool.close()
