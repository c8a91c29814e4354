"""The worker role of ``KVTritonConnector``: vLLM's KV tensors and kvtriton's ``TransferEngine``.

Each worker process (one per rank) registers its KV tensors once, then per step runs the
transfers the scheduler side planned (``KVTritonMetadata``), block ids identical on every rank:

- loads start in ``start_load_kv``. A request waiting for its load is not in the step's batch,
  and vLLM schedules it only after ``get_finished`` reported the load, so attention never reads
  a block before its copy landed; the engine still orders a load after the compute queued so
  far, which may read the destination blocks' previous contents (vLLM #47282);
- same-step loads (``sync_load_budget_bytes``: requests this step computes on top of their CPU
  hit) start first in ``start_load_kv``, which vLLM then calls before the forward pass
  (``has_sync_kv_loads``), and the host waits there until they landed. They are reported to the
  scheduler side in ``KVTritonWorkerMetadata``, never in ``finished_recving`` (vLLM waits for
  no load of a running request); one that failed has its GPU blocks reported invalid, so vLLM
  recomputes them and drops the step's token for the request;
- stores start in ``wait_for_save``, after the step's forward pass was queued: the engine
  orders them after a compute-done event recorded then, so a store never reads a block the
  forward pass is still writing (vLLM #45704);
- ``transfer_results`` polls the engine: finished loads go back as ``finished_recving``,
  completed and failed store events as ``KVTritonWorkerMetadata``
  (``build_connector_worker_meta``), which vLLM's executor sums over the ranks for the scheduler
  side. A load that failed is reported in ``failed_recving`` (and, with one KV cache group, its
  GPU blocks in ``get_block_ids_with_load_errors``), never as a silent success: with vLLM's
  ``kv_load_failure_policy="recompute"`` the request recomputes them, with the default
  ``"fail"`` vLLM fails the request (the connector warns at start-up).

KV tensors: vLLM's CUDA FlashAttention layout ``(2, num_blocks, ...)`` registers as
``"flash_attn"``; a layout with one dense byte range per block (FlashInfer's
``(num_blocks, 2, ...)``, the CPU platform's ``(num_blocks, heads, block_size, 2 * head)``, whose
packing inside a block depends on the CPU's instruction set) as ``"block_major"``, copied as
opaque bytes. Mamba layers give ``(conv, ssm)`` state tensors. The backend: ``"auto"`` on CUDA
(the Triton kernel, or the copy engine where pieces are large), ``"torch"`` on CPU (the kernel
under ``TRITON_INTERPRET=1`` in tests, through ``KVTRITON_WORKER_BACKEND``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtriton.engine import TransferEngine
from kvtriton.engine.transfer import BACKENDS
from kvtriton.vllm.config import ConnectorConfig
from kvtriton.vllm.layout import cpu_blocks_for_bytes, layout_from_vllm
from kvtriton.vllm.metadata import KVTritonMetadata, KVTritonWorkerMetadata

__all__ = ["WorkerSide", "kv_caches_by_group"]

logger = logging.getLogger(__name__)

BACKEND_ENV = "KVTRITON_WORKER_BACKEND"


def _attn_layout(name: str, x: torch.Tensor, num_blocks: int) -> str:
    if x.dim() >= 3 and x.shape[0] == 2 and x.shape[1] == num_blocks:
        return "flash_attn"
    if x.dim() >= 2 and x.shape[0] == num_blocks:
        return "block_major"
    raise ValueError(f"KVTritonConnector: KV cache tensor of {name} has shape "
                     f"{tuple(x.shape)}; expected (2, {num_blocks}, ...) or ({num_blocks}, ...) "
                     f"with one dense range per block")


def kv_caches_by_group(kv_cache_config: Any, kv_caches: Mapping[str, Any], layout: Any
                       ) -> tuple[list[list[Any]], str]:
    """vLLM's ``{layer name: tensor}`` as the engine's ``kv_caches[g][layer]`` (in the groups'
    layer order) and the attention layout they share; ``ValueError`` naming the layer for a
    missing tensor or a layout the engine cannot address."""
    n = kv_cache_config.num_blocks
    out: list[list[Any]] = []
    layouts: dict[str, str] = {}
    for g, (group, spec) in enumerate(zip(kv_cache_config.kv_cache_groups, layout.groups,
                                          strict=True)):
        layers = []
        for name in group.layer_names:
            if name not in kv_caches:
                raise ValueError(f"KVTritonConnector: group {g}'s layer {name!r} has no KV "
                                 "cache tensor in register_kv_caches")
            x = kv_caches[name]
            if spec.kind == "mamba":
                if not isinstance(x, Sequence) or len(x) != 2:
                    raise ValueError(f"KVTritonConnector: Mamba layer {name!r} must give "
                                     f"(conv, ssm) state tensors, got {type(x).__name__}")
                layers.append(tuple(x))
            else:
                layouts[name] = _attn_layout(name, x, n)
                layers.append(x)
        out.append(layers)
    kinds = set(layouts.values())
    if len(kinds) > 1:
        raise ValueError(f"KVTritonConnector: attention layers mix KV layouts {sorted(kinds)}; "
                         "the CPU tier needs one")
    return out, kinds.pop() if kinds else "block_major"


class WorkerSide:
    """One rank's ``TransferEngine`` and the step's transfers (see the module docstring)."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any | None, config: ConnectorConfig
                 ) -> None:
        self.config = config
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.engine: TransferEngine | None = None
        self._meta: KVTritonMetadata | None = None
        self._done_stores: dict[int, int] = {}
        self._failed_stores: dict[int, int] = {}
        self._load_blocks: dict[str, list[int]] = {}  # rid -> GPU blocks of its load in flight
        self._sync_rids: dict[str, int] = {}  # rid -> load event of its same-step load
        self._done_sync: dict[int, int] = {}
        self._failed_sync: dict[int, int] = {}
        self._load_errors: set[int] = set()
        self._num_groups = 0
        self._stats_before: dict[str, int | float] = {}
        self.store_io = None  # the second tier's traffic (kvtriton.second_tier.worker_io)
        self._puts: dict[int, tuple[list[int], list[int], list[bytes]]] = {}  # store event ->
        self._fetch_reports: dict[int, list[int]] = {}  # fetch event -> failed indices
        self.stats = {"stores_issued": 0, "loads_issued": 0, "blocks_stored": 0,
                      "blocks_loaded": 0, "failed_stores": 0, "failed_loads": 0,
                      "sync_loads_issued": 0}

    # ---- registration --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, Any]) -> None:
        kv_cache_config = self._kv_cache_config
        if kv_cache_config is None:
            raise RuntimeError("KVTritonConnector: the worker was built without a "
                               "KVCacheConfig; vLLM >= 0.32 passes one")
        layout, _ = layout_from_vllm(self._vllm_config, kv_cache_config)
        num_cpu_blocks = cpu_blocks_for_bytes(kv_cache_config, self.config.cpu_bytes_per_rank)
        by_group, attn_layout = kv_caches_by_group(kv_cache_config, kv_caches, layout)
        first = next(t for layers in by_group for t in layers)
        device = (first[0] if isinstance(first, tuple) else first).device
        backend = os.environ.get(BACKEND_ENV) or ("auto" if device.type == "cuda" else "torch")
        if backend not in BACKENDS:
            raise ValueError(f"KVTritonConnector: {BACKEND_ENV}={backend!r}; expected one of "
                             f"{', '.join(BACKENDS)}")
        self.engine = TransferEngine(layout, by_group, num_cpu_blocks, backend=backend,
                                     attn_layout=attn_layout)
        self._num_groups = layout.num_groups
        if self.config.second_tier is not None:
            from kvtriton.vllm.store_tier import worker_io

            self.store_io = worker_io(self.config.second_tier, self._vllm_config, layout,
                                      self.engine.cpu_pool)
        logger.info("KVTritonConnector worker: %d CPU blocks (%.2f GiB %s host memory), "
                    "%d groups, %s KV tensors on %s, backend %s", num_cpu_blocks - 1,
                    num_cpu_blocks * layout.cpu_block_bytes / 2**30,
                    "pinned" if device.type == "cuda" else "pageable", layout.num_groups,
                    attn_layout, device, backend)

    def _engine(self) -> TransferEngine:
        if self.engine is None:
            raise RuntimeError("KVTritonConnector: register_kv_caches was not called")
        return self.engine

    # ---- per step ------------------------------------------------------------------------------

    def bind_connector_metadata(self, meta: Any) -> None:
        if not isinstance(meta, KVTritonMetadata):
            raise TypeError(f"KVTritonConnector: connector metadata of type "
                            f"{type(meta).__name__}, expected KVTritonMetadata")
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    def handle_preemptions(self, meta: Any) -> None:
        """A preemption frees GPU blocks that transfers in flight may still read or write:
        wait for them before the blocks are handed out again."""
        if isinstance(meta, KVTritonMetadata) and meta.need_flush and self.engine is not None:
            self.engine.flush()

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is not None and meta.fetches and self.store_io is not None:
            for event, cpu, groups, hashes in meta.fetches:
                self.store_io.fetch(event, cpu, groups, hashes)
        if meta is not None and len(meta.sync_load):
            self._load_now(meta.sync_load, meta.sync_load_reqs)
        if meta is None or meta.load.event < 0 or not len(meta.load):
            return
        t = meta.load
        req_ids = list(meta.load_event_to_reqs.get(t.event, []))
        self._engine().load(t.event, req_ids, t.gpu_blocks, t.cpu_blocks, t.groups)
        for rid in req_ids:
            self._load_blocks[rid] = list(t.gpu_blocks)
        self.stats["loads_issued"] += 1
        self.stats["blocks_loaded"] += len(t)

    def _load_now(self, t: Any, req_ids: list[str]) -> None:
        """The loads of requests this step computes: issued, then waited for on the host."""
        engine = self._engine()
        engine.load(t.event, req_ids, t.gpu_blocks, t.cpu_blocks, t.groups)
        engine.synchronize_loads()
        for rid in req_ids:
            self._load_blocks[rid] = list(t.gpu_blocks)
            self._sync_rids[rid] = t.event
        self.stats["loads_issued"] += 1
        self.stats["sync_loads_issued"] += 1
        self.stats["blocks_loaded"] += len(t)

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or meta.store.event < 0 or not len(meta.store):
            return
        t = meta.store
        if self.store_io is not None:
            # A put queued earlier may still read a CPU block this store overwrites.
            self.store_io.wait_unread(t.cpu_blocks)
            if meta.store_hashes:
                self._puts[t.event] = (t.cpu_blocks, t.groups, meta.store_hashes)
        self._engine().store(t.event, t.gpu_blocks, t.cpu_blocks, t.groups)
        self.stats["stores_issued"] += 1
        self.stats["blocks_stored"] += len(t)

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """Request ids whose load finished since the last call, and those whose load failed
        (their GPU blocks go to ``get_block_ids_with_load_errors``, so vLLM recomputes them).
        Store completions and failures go through ``build_connector_worker_meta``."""
        if self.engine is None:
            return set(), set()
        stores, loads = self.engine.poll()
        bad_stores, bad_loads = self.engine.poll_failures()
        for ev in stores:
            self._done_stores[ev] = 1
            if (put := self._puts.pop(ev, None)) is not None:
                self.store_io.put(*put)  # write-through, off this step's path
        for ev in bad_stores:
            self._failed_stores[ev] = 1
            self._puts.pop(ev, None)
            self.stats["failed_stores"] += 1
        if self.store_io is not None:
            self._fetch_reports.update(self.store_io.take_results())
        for rid in bad_loads:
            self._load_errors.update(self._load_blocks.get(rid, ()))
            self.stats["failed_loads"] += 1
            logger.warning("KVTritonConnector: the CPU load of request %s failed; vLLM "
                           "recomputes its blocks", rid)
        done, failed = set(loads) - set(bad_loads), set(bad_loads)
        for rid in done | failed:
            self._load_blocks.pop(rid, None)
        if self._sync_rids:
            # Same-step loads go to the scheduler side in the worker metadata, once per event.
            for rid in list((done | failed) & self._sync_rids.keys()):
                ev = self._sync_rids.pop(rid)
                if rid in failed:
                    self._failed_sync[ev] = 1
                    self._done_sync.pop(ev, None)
                elif ev not in self._failed_sync:
                    self._done_sync[ev] = 1
                done.discard(rid)
                failed.discard(rid)
        return done, failed

    def build_connector_worker_meta(self) -> KVTritonWorkerMetadata | None:
        if not (self._done_stores or self._failed_stores or self._fetch_reports
                or self._done_sync or self._failed_sync):
            return None
        meta = KVTritonWorkerMetadata(self._done_stores, self._failed_stores,
                                      dict.fromkeys(self._fetch_reports, 1),
                                      {ev: bad for ev, bad in self._fetch_reports.items() if bad},
                                      self._done_sync, self._failed_sync)
        self._done_stores, self._failed_stores, self._fetch_reports = {}, {}, {}
        self._done_sync, self._failed_sync = {}, {}
        return meta

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of failed loads, so vLLM recomputes from the first of them on. Only with
        one KV cache group: block ids repeat across groups, and vLLM refuses block-level
        failures then; the request-level report (``failed_recving``) recomputes the request."""
        bad, self._load_errors = self._load_errors, set()
        return bad if self._num_groups == 1 else set()

    def get_stats(self) -> dict[str, int | float]:
        """This rank's counters since the last call, named ``worker_*`` so that vLLM's sum
        over the ranks and the scheduler side's counters stay apart: transfers issued, blocks,
        failures, and per direction the bytes moved and the seconds spent copying."""
        from kvtriton.vllm.stats import counter_deltas

        now = {f"worker_{k}": v for k, v in self.counters().items()}
        if self.engine is not None:
            for kind, (_, nbytes, seconds) in self.engine.totals.items():
                now[f"worker_{kind}_bytes"] = int(nbytes)
                now[f"worker_{kind}_s"] = float(seconds)
        data = counter_deltas(now, self._stats_before)
        self._stats_before = now
        return data

    def counters(self) -> dict[str, int | float]:
        """This rank's counters so far (``STATS`` names without ``worker_``), the second
        tier's with them when it is on."""
        now = dict(self.stats)
        if self.store_io is not None:
            now.update(self.store_io.stats)
            now.update(self.store_io.faults.as_stats())
        return now

    def transfer_totals(self) -> dict[str, dict[str, float]]:
        """Per direction: completed transfers, bytes moved, seconds copying and GB/s."""
        if self.engine is None:
            return {}
        out = {}
        for kind, (n, nbytes, seconds) in self.engine.totals.items():
            out[kind] = {"transfers": n, "bytes": nbytes, "seconds": seconds,
                         "gb_per_s": nbytes / seconds / 1e9 if seconds else None}
        return out

    def shutdown(self) -> None:
        if self.store_io is not None:
            self.store_io.close()  # the puts queued so far go out first
            self.store_io = None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
