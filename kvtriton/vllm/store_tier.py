"""The second tier (``kvtriton.second_tier``) inside the connector: the fields both roles name
objects by, and each role's part built from vLLM's config.

Both roles compute the same fingerprint from vLLM's config (the scheduler for every rank, a
worker for its own), so the scheduler's existence queries name exactly the objects the workers
put. Replicas share a name only when every field agrees: model and revision, dtypes, the KV
groups' block sizes and bytes, the parallel layout and rank, the platform (with the CPU's
instruction set on CPU, whose attention packs a block by it), the attention backend asked for,
vLLM's version and its block hash (algorithm and ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvtriton.second_tier.client import StoreClient
from kvtriton.second_tier.config import SecondTierConfig, check_master_reachable
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.fetches import StoreFetches
from kvtriton.second_tier.naming import object_names, rank_fingerprint, rank_fingerprints
from kvtriton.second_tier.worker_io import StoreIO
from kvtriton.specs import KVLayout

__all__ = ["fingerprint_fields", "scheduler_fetches", "worker_io"]

logger = logging.getLogger(__name__)

_NON_CRYPTO = ("xxhash", "xxhash_cbor")


def fingerprint_fields(vllm_config: Any, layout: KVLayout) -> dict[str, Any]:
    """What makes a block's bytes (and its hash) differ between servers, rank aside."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    device = current_platform.device_type
    attention = getattr(vllm_config, "attention_config", None)
    return {
        "model": mc.model, "revision": mc.revision, "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype), "hash_block_size": layout.hash_block_size,
        "groups": [[s.kind, s.block_size, b] for s, b in zip(layout.groups,
                                                              layout.group_block_bytes,
                                                              strict=True)],
        "vllm": vllm.__version__, "platform": device,
        "cpu_isa": torch.backends.cpu.get_cpu_capability() if device == "cpu" else None,
        "attention_backend": str(getattr(attention, "backend", None)),
        "hash_algo": str(cc.prefix_caching_hash_algo),
        "hash_seed": os.environ.get("PYTHONHASHSEED"),
    }


def _parallel(vllm_config: Any) -> tuple[int, int]:
    pc = vllm_config.parallel_config
    return pc.tensor_parallel_size, pc.pipeline_parallel_size


def scheduler_fetches(config: SecondTierConfig, vllm_config: Any, layout: KVLayout, cpu_pool,
                      hash_of) -> StoreFetches:
    """The scheduler's part; ``ValueError`` naming the key when the master is unreachable or
    the model has a group the tier does not serve."""
    check_master_reachable(config)
    fields = fingerprint_fields(vllm_config, layout)
    if fields["hash_algo"] in _NON_CRYPTO and fields["hash_seed"] is None:
        logger.warning("KVTritonConnector: prefix_caching_hash_algo=%s without PYTHONHASHSEED "
                       "gives every process other block hashes: this replica's second tier "
                       "objects will not be found by any other replica; use sha256 or set "
                       "PYTHONHASHSEED alike on every replica", fields["hash_algo"])
    tp, pp = _parallel(vllm_config)
    faults = FaultLog("scheduler")
    client = StoreClient(config, 0, faults)
    if config.segment_bytes == 0:  # the workers (joined first) mount nothing: is there a host?
        client.check_memory()
    fps = rank_fingerprints(fields, tp, pp)

    def query(keys: list[int]) -> np.ndarray | None:
        """Whether every rank's object of each key is in the store: one batched query (run on
        the one helper thread of ``StoreFetches``'s executor, never two at once)."""
        hashes = [hash_of(k) for k in keys]
        present = client.exists([n for fp in fps for n in object_names(fp, hashes)])
        return None if present is None else present.reshape(len(fps), len(keys)).all(axis=0)

    fetches = StoreFetches(layout, cpu_pool, query, faults, config.fetch_timeout_s,
                           close=client.close,
                           executor=ThreadPoolExecutor(1, thread_name_prefix="kvtriton-query"))
    logger.info("KVTritonConnector: %s, %d ranks' objects per block, fetch timeout %.1f s",
                config.describe(), tp * pp, config.fetch_timeout_s)
    return fetches


def worker_io(config: SecondTierConfig, vllm_config: Any, layout: KVLayout, pool
              ) -> StoreIO:
    """This worker's part, its objects named for its rank; ``ValueError`` naming the key when
    the master is unreachable (the workers start before the scheduler)."""
    check_master_reachable(config)
    tp, pp = _parallel(vllm_config)
    tp_rank = pp_rank = 0
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
    except (AssertionError, ImportError):  # no distributed state: one rank
        pass
    fields = fingerprint_fields(vllm_config, layout)
    fp = rank_fingerprint(fields, tp_rank, pp_rank, tp, pp)
    rank = pp_rank * tp + tp_rank
    client = StoreClient(config, config.segment_bytes, FaultLog(f"worker {rank}"))
    return StoreIO(client, fp, pool, layout.group_block_bytes, background=pool.is_pinned())
