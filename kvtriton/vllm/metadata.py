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
    block ids, identical on every rank.

    ``sync_load``: the loads of ``sync_load_reqs``, requests this step computes on top of them
    (``sync_load_budget_bytes``): they must land before the forward pass reads them, and are
    reported in ``KVTritonWorkerMetadata``, never as ``finished_recving`` (vLLM waits for no
    load of a running request). Same event as ``load``, which carries the asynchronous rest."""

    store: Transfer = field(default_factory=Transfer)
    load: Transfer = field(default_factory=Transfer)
    load_event_to_reqs: dict[int, list[str]] = field(default_factory=dict)
    need_flush: bool = False
    # The second tier: the vLLM hash of each stored pair (written through once stored), and
    # the fetches from the store, (event, CPU blocks, groups, vLLM hashes) each.
    store_hashes: list[bytes] = field(default_factory=list)
    fetches: list[tuple[int, list[int], list[int], list[bytes]]] = field(default_factory=list)
    sync_load: Transfer = field(default_factory=Transfer)
    sync_load_reqs: list[str] = field(default_factory=list)

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
    # The second tier's fetches: event -> how many workers reported it, and event -> the
    # indices of its blocks any worker failed to read or verify.
    fetch_reports: dict[int, int] = field(default_factory=dict)
    fetch_failed: dict[int, list[int]] = field(default_factory=dict)
    # Same-step loads (``KVTritonMetadata.sync_load``): load event -> workers that completed
    # it, and -> workers on which it failed.
    completed_sync_loads: dict[int, int] = field(default_factory=dict)
    failed_sync_loads: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVTritonWorkerMetadata:
        if not isinstance(other, KVTritonWorkerMetadata):
            raise TypeError(f"cannot aggregate {type(other).__name__} into "
                            "KVTritonWorkerMetadata")
        done = _summed(self.completed_store_events, other.completed_store_events)
        failed = _summed(self.failed_store_events, other.failed_store_events)
        reports = _summed(self.fetch_reports, other.fetch_reports)
        bad = {ev: list(ix) for ev, ix in self.fetch_failed.items()}
        for ev, ix in other.fetch_failed.items():
            bad[ev] = sorted(set(bad.get(ev, ())) | set(ix))
        return KVTritonWorkerMetadata(
            done, failed, reports, bad,
            _summed(self.completed_sync_loads, other.completed_sync_loads),
            _summed(self.failed_sync_loads, other.failed_sync_loads))


def _summed(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    """Per event, the workers' reports of ``a`` and ``b`` added up."""
    out = dict(a)
    for ev, n in b.items():
        out[ev] = out.get(ev, 0) + n
    return out
