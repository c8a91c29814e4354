"""``KVTritonConnector``: kvtriton's CPU tier as a vLLM v1 KV connector.

Load it by path, as any third-party connector::

    KVTransferConfig(kv_connector="KVTritonConnector", kv_connector_module_path="kvtriton.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"setup": "lazy+hints",
                                                                   "cpu_bytes_per_rank": 8 << 30})

The setup is a composition of ``kvtriton.setups`` (the simulator's ``--setups`` vocabulary);
per-request continuation hints arrive in ``kv_transfer_params`` (``kvtriton.vllm.signals``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtriton.vllm.config import check_host_memory, parse_extra_config
from kvtriton.vllm.layout import cpu_blocks_for_bytes
from kvtriton.vllm.metadata import KVTritonMetadata, KVTritonWorkerMetadata
from kvtriton.vllm.scheduler_side import SchedulerSide
from kvtriton.vllm.stats import KVTritonStats
from kvtriton.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVTritonConnector"]

def _log_through_vllm() -> None:
    """Send kvtriton's log records (the start-up lines, failed transfers) to vLLM's handlers, so
    they appear in the server's log with vLLM's own format; once per process."""
    ours, theirs = logging.getLogger("kvtriton"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


class KVTritonConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtriton's CPU tier for vLLM: the ``OffloadPlanner`` in vLLM's scheduler.

    Scheduler role (``SchedulerSide``, in the engine-core process): lookups in the CPU tier
    after the GPU prefix hit, loads of the accepted hit, eager (or lazy) stores with re-store of
    the blocks the CPU evicted while their request ran, a finish flush, store completions counted
    over every worker, ``reset_cache``, vLLM KV events and stats. Worker role (``WorkerSide``, in
    each worker process): the bytes, with kvtriton's ``TransferEngine`` over vLLM's KV tensors.
    Settings: ``kvtriton.vllm.config``.

    Known difference from vLLM's own ``SimpleCPUOffloadScheduler`` with the same setup
    (``restore=False, cpu_free_order="head_first"``): vLLM allocates CPU blocks (and so evicts
    the CPU tier's LRU blocks) per request inside its scan, so a request scanned later in the same
    step sees some blocks as no longer cached: it can store again a block an earlier request's
    allocation just evicted, or, with the budget spent, its cursor stops at such a block where
    kvtriton's moved past it as cached. kvtriton classifies the whole step against the CPU tier
    as it stood before allocating, and allocates once for the step. They store the same blocks
    whenever the step's stores fit in the CPU tier's free uncached blocks.

    The hole this leaves, kept by measurement: a block the scan passed as cached that the same
    step's allocation then evicts is not stored again for that request (without re-store), where
    vLLM's cursor, stopped at it, may store it later. Keeping the cursor at such a block gave no
    consistent gain (``python -m bench --only hole_rewind``; the figures are in the paper), so
    the cursor is not held back; ``restore`` stores such blocks again where it matters.

    Two deliberate differences: vLLM dedups stores by GPU block id only, so two GPU blocks that
    hold one hash (vLLM never merges them) are copied twice, into two CPU blocks; kvtriton dedups
    by hash too and copies one. And a position whose hash another request made first while this
    one ran keeps the id reserved for it (``kvtriton.vllm.keys``), so it is never stored for this
    request; vLLM stores it. ``tests/vllm/test_differential.py`` (``python -m
    bench.conformance.differential`` for 3,000 seeds) checks all of this step for step against
    vLLM's manager, accepts each difference only with its evidence, and fails on any other.

    One more deliberate difference, on the GPU side (``PlannerConfig.hold_finished``): a request
    that finishes with stores of its blocks in flight or queued keeps its GPU table referenced
    until its last store completes, then releases it tail first. vLLM's manager lets the
    scheduler free the table at once; the blocks its stores pin then rejoin the GPU free queue
    as each store completes, after the others and head first, so the prefix cache evicts the
    chain's head first and the next turn loses its GPU hit, below what no tier gets (measured
    by ``python -m bench --only vllm`` and traced by
    ``python -m bench.tier_study.finish_free_order``; the paper's engine section).
    """

    _cache_hit_source = CacheHitSource.HOST

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a later miss, never lost output.
        return False

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.config = parse_extra_config(extra)
        pc = vllm_config.parallel_config
        # Every rank of this host allocates its own tier, and the scheduler the tier's eviction
        # state (the lfu sketch): their sum must fit, checked before anything is allocated (a
        # bare ENOMEM from mmap or a MemoryError otherwise, much later).
        check_host_memory(self.config, max(1, pc.world_size // max(1, getattr(pc, "nnodes", 1))),
                          cpu_blocks=cpu_blocks_for_bytes(kv_cache_config,
                                                          self.config.cpu_bytes_per_rank),
                          setup_as_written=(extra or {}).get("setup"))
        if not vllm_config.cache_config.enable_prefix_caching:
            raise ValueError("KVTritonConnector needs prefix caching: set "
                             "enable_prefix_caching=True")
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        on_failure = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if role == KVConnectorRole.SCHEDULER and on_failure != "recompute":
            logging.getLogger(__name__).warning(
                "KVTritonConnector: kv_load_failure_policy=%r: a CPU load that fails will fail "
                "its request; set kv_load_failure_policy='recompute' in --kv-transfer-config "
                "to recompute it instead (a CPU tier is a cache)", on_failure)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.config)
        else:
            self.worker_side = WorkerSide(vllm_config, kv_cache_config, self.config)

    def _side(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("KVTritonConnector: a scheduler-role call on the worker role")
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("KVTritonConnector: a worker-role call on the scheduler role")
        return self.worker_side

    # ---- worker role ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._worker().bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        self._worker().clear_connector_metadata()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker().start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A request runs only once its asynchronous load was reported; same-step loads
        # (sync_load_budget_bytes) landed in start_load_kv, which vLLM calls before the forward.
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        pass  # stores copy whole blocks of every layer at once, in wait_for_save

    def wait_for_save(self) -> None:
        self._worker().wait_for_save()

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        done, failed = self._worker().transfer_results()
        return None, (done | failed) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        done, failed = self._worker().transfer_results()
        return KVConnectorTransferResults(finished_recving=done | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVTritonWorkerMetadata | None:
        return self._worker().build_connector_worker_meta()

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ---- scheduler role -------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._side().bind_gpu_block_pool(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        # The waiting queue's arrivals: with the lookahead axis their keys are protected.
        self._side().on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        return self._side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._side().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._side().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        # GPU blocks in transfers are pinned by refs, so vLLM may free the request's blocks now.
        side = self._side()
        # A flat list is one group's table; vLLM passes every group's to the method below.
        tables = (list(block_ids),) if side.layout.num_groups == 1 else None
        return side.request_finished(request, tables)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._side().request_finished(request, tuple(block_ids))

    def has_pending_push_work(self) -> bool:
        # Keeps the engine stepping until queued and in-flight stores are reported.
        return self.scheduler_side is not None and self.scheduler_side.has_pending_stores()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._side().take_events()

    def reset_cache(self) -> bool | None:
        return self._side().reset()

    def get_kv_connector_stats(self) -> KVTritonStats | None:
        side = getattr(self, "scheduler_side", None)
        if side is not None:
            return side.get_stats()
        worker = getattr(self, "worker_side", None)
        if worker is None:
            return None
        data = worker.get_stats()
        return KVTritonStats(data=data) if data else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVTritonStats | None:
        return KVTritonStats(data=dict(data or {}))

    @staticmethod
    def empty_metadata() -> KVTritonMetadata:
        return KVTritonMetadata()
