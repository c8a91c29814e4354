"""A stepper for a real vLLM ``Scheduler`` with no model behind it (tests and benchmarks):
``Driver`` plays the engine core and the workers' transfer reports over
``kvtriton.sim.vllm_scheduler``'s scheduler and model outputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtriton.sim.vllm_scheduler import model_output

__all__ = ["Driver"]


class Driver:
    """Steps a ``Scheduler`` as an engine core would, with the workers' transfer reports
    modelled: a store or load issued in step t is reported in the output of step
    ``t + report_delay`` by all ``world_size`` workers at once (``hold_stores`` keeps stores
    unreported until ``release_stores``). Tokens sampled are ``sampled`` per step, else
    ``default_token``. Works with ``KVTritonConnector`` and vLLM's SimpleCPUOffloadConnector
    alike (their worker reports differ only in the metadata class). A same-step load
    (``KVTritonMetadata.sync_load``) is reported in the output of the step that issued it: the
    workers wait for it before that step's forward pass (one of a request in ``failed_loads``
    fails, its GPU blocks reported invalid)."""

    def __init__(self, scheduler: Any, *, report_delay: int = 1, world_size: int = 1) -> None:
        self.scheduler = scheduler
        self.report_delay = report_delay
        self.world_size = world_size
        self.step_no = 0
        self.hold_stores = False
        self._stores: list[tuple[int, int]] = []  # (due step, event)
        self._loads: list[tuple[int, list[str]]] = []  # (due step, request ids)
        self.failed_loads: set[str] = set()
        self.failed_stores: set[int] = set()
        self.invalid_block_ids: set[int] = set()

    def add(self, request: Any) -> None:
        self.scheduler.add_request(request)

    def release_stores(self) -> None:
        self.hold_stores = False

    def _worker_meta(self, events: list[int], sync_event: int = -1,
                     sync_failed: bool = False) -> Any:
        conn = self.scheduler.connector
        if conn is None:
            return None
        name = type(conn).__name__
        done = {e: self.world_size for e in events if e not in self.failed_stores}
        bad = {e: 1 for e in events if e in self.failed_stores}
        if name == "SimpleCPUOffloadConnector":
            from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

            return SimpleCPUOffloadWorkerMetadata(done) if done else None
        from kvtriton.vllm.metadata import KVTritonWorkerMetadata

        sync = {sync_event: self.world_size} if sync_event >= 0 else {}
        if not (done or bad or sync):
            return None
        return KVTritonWorkerMetadata(done, bad, completed_sync_loads={} if sync_failed else sync,
                                      failed_sync_loads=sync if sync_failed else {})

    def step(self, sampled: Mapping[str, Sequence[int]] | None = None) -> tuple[Any, Any]:
        """One schedule + output; returns ``(scheduler_output, engine_core_outputs)``."""
        so = self.scheduler.schedule()
        meta = so.kv_connector_metadata
        due = self.step_no + self.report_delay
        sync = getattr(meta, "sync_load", None)
        sync_event = sync.event if sync is not None and len(sync) else -1
        sync_failed = sync_event >= 0 and bool(self.failed_loads & set(meta.sync_load_reqs))
        if meta is not None:
            store_ev = getattr(meta, "store_event", None)
            if store_ev is None:  # KVTritonMetadata
                store_ev = meta.store.event
                load_ev, load_reqs = meta.load.event, meta.load_event_to_reqs
            else:
                load_ev, load_reqs = meta.load_event, meta.load_event_to_reqs
            if store_ev >= 0:
                self._stores.append((due, store_ev))
            if load_ev >= 0:
                self._loads.append((due, list(load_reqs[load_ev])))
        stores = [] if self.hold_stores else [e for d, e in self._stores if d <= self.step_no]
        self._stores = [(d, e) for d, e in self._stores if e not in stores]
        loads = [r for d, rs in self._loads if d <= self.step_no for r in rs]
        self._loads = [(d, rs) for d, rs in self._loads if d > self.step_no]
        failed = [r for r in loads if r in self.failed_loads]
        invalid = set(self.invalid_block_ids) if failed else set()
        if sync_failed:
            invalid |= set(sync.gpu_blocks)
        out = model_output(self.scheduler, so, sampled,
                           finished_loads=[r for r in loads if r not in self.failed_loads],
                           failed_loads=failed, invalid_block_ids=invalid,
                           worker_meta=self._worker_meta(stores, sync_event, sync_failed))
        result = self.scheduler.update_from_output(so, out)
        self.step_no += 1
        return so, result

    def pending(self) -> bool:
        return bool(self._stores or self._loads)

    def run(self, max_steps: int = 10_000) -> int:
        """Step until every request finished and every transfer was reported; returns steps."""
        n = 0
        s = self.scheduler
        while (s.has_requests() or self.pending()) and n < max_steps:
            self.step()
            n += 1
        return n
