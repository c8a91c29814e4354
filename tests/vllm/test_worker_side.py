"""``KVTritonConnector``'s worker role (``kvtriton.vllm.worker_side``): vLLM's KV tensors checked
at registration, and one store moved through the worker role and reported.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import BS, FULL


def test_worker_role_refuses_kv_tensors_it_cannot_address(model_config_dir):
    """The worker role checks vLLM's KV tensors at ``register_kv_caches`` (engine start): a
    missing layer or a tensor whose blocks are not dense ranges of the spec's bytes is one
    error naming the layer, before any request is served."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtriton.sim.vllm_scheduler import make_configs
    from kvtriton.vllm import KVTritonConnector

    vllm_config, kv_cache_config, _ = make_configs(model_config_dir, [FULL], num_gpu_blocks=16,
                                                   cpu_blocks=8)
    conn = KVTritonConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    with pytest.raises(ValueError, match="layer 'layer0' has no KV cache tensor"):
        conn.register_kv_caches({})
    with pytest.raises(ValueError, match=r"layer0.*shape \(3, 3\)"):
        conn.register_kv_caches({"layer0": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="bytes per block"):
        conn.register_kv_caches({"layer0": torch.zeros(16, 2, BS, 1, 4)})  # half the bytes
    kv = torch.zeros(2, 16, BS, 1, 8)  # (2, num_blocks, block, heads, head): FlashAttention's
    conn.register_kv_caches({"layer0": kv})
    assert conn.worker_side.engine.attn_layout == "flash_attn"
    # One store through the worker role: reported in the worker metadata and its stats.
    from kvtriton.records import Transfer
    from kvtriton.vllm.metadata import KVTritonMetadata

    assert conn.get_kv_connector_stats() is None
    kv[:, 3] = 7.0
    conn.bind_connector_metadata(KVTritonMetadata(store=Transfer(0, [3], [1], [0])))
    conn.start_load_kv(None)
    conn.wait_for_save()
    results = conn.get_transfer_results(set())
    assert results.finished_recving == set() and results.failed_recving == set()
    assert conn.build_connector_worker_meta().completed_store_events == {0: 1}
    assert conn.build_connector_worker_meta() is None  # reported once
    conn.clear_connector_metadata()
    stats = conn.get_kv_connector_stats().data
    assert stats["worker_blocks_stored"] == 1 and stats["worker_store_bytes"] == 2 * BS * 8 * 4
    from kvtriton.vllm.stats import STATS

    assert set(stats) <= set(STATS)  # every name the worker reports says what it counts there
    assert torch.equal(conn.worker_side.engine.cpu_pool[1].view(torch.float32),
                       torch.full((2 * BS * 8,), 7.0))
    with pytest.raises(RuntimeError, match="scheduler-role call on the worker role"):
        conn.build_connector_meta(None)
