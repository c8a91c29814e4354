"""What crosses vLLM's process boundary: scheduler -> workers and workers -> scheduler.

The transfers themselves are kvtriton's records (``kvtriton.records.Transfer``, the module both
roles import); these classes only give them vLLM's metadata base classes, so vLLM's executor
ships them to every worker and aggregates the workers' reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtriton.records import PlannerMeta, Transfer

__all__ = ["KVTritonMetadata", "KVTritonWorkerMetadata"]


@dataclass
class KVTritonMetadata(KVConnectorMetadata):
    """One step's work for every worker: ``store`` (GPU -> CPU, after this step's compute wrote
    the blocks), ``load`` (CPU -> GPU, before attention reads them), which requests each load
    event in flight serves, and whether a preemption this step needs in-flight copies flushed
    before freed GPU blocks are reused. Block ids are vLLM's GPU block ids and the CPU tier's
    block ids, identical on every rank."""

    store: Transfer = field(default_factory=Transfer)
    load: Transfer = field(default_factory=Transfer)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    need_flush: bool = False

    @classmethod
    def from_planner(cls, meta: PlannerMeta) -> KVTritonMetadata:
        return cls(meta.store, meta.load, meta.load_event_to_reqs, meta.need_flush)


@dataclass
class KVTritonWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's (or, aggregated, all workers') reports for one step: store event -> how many
    workers completed it, and store event -> how many reported it failed. A store counts once
    every worker (``world_size``) completed it; any failure fails it."""

    completed_store_events: dict[int, int] = field(default_factory=dict)
    failed_store_events: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTritonWorkerMetadata:
        if not isinstance(other, KVTritonWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "KVTritonWorkerMetadata")
        done = dict(self.completed_store_events)
        for ev, n in other.completed_store_events.items():
            done[ev] = done.get(ev, 0) + n
        failed = dict(self.failed_store_events)
        for ev, n in other.failed_store_events.items():
            failed[ev] = failed.get(ev, 0) + n
        return KVTritonWorkerMetadata(done, failed)
