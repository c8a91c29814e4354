"""Same-step loads (``sync_load_budget_bytes``) in vLLM's real ``Scheduler`` (no model runs) and
in the worker role: a CPU hit whose bytes fit the step's budget is answered synchronous, so vLLM
schedules its request in the step that issues the load; one that does not fit waits for its
load as before; the budget is per step; a failed same-step load is recomputed.

The layout is ``helpers.vllm_driver.FULL``: one 16-token block of one layer, 1 KiB.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from vllm.v1.request import RequestStatus

from helpers.vllm_driver import BS, FULL, WINDOW, assert_idle, build, evict_gpu, run, tokens
from kvtriton.sim.vllm_scheduler import make_scheduler, vllm_request

pytestmark = pytest.mark.scheduler_role

BLOCK = 1024  # bytes of one FULL block (K and V, 16 tokens x 8 fp32)
HIT = 5  # blocks of the CPU hit each test sets up


def cached_prompts(drv, *seeds):
    """Prompts of ``HIT`` blocks plus 3 tokens, run once (stored in the CPU tier) and evicted
    from the GPU: each comes back as a ``HIT``-block CPU hit."""
    prompts = [tokens(seed, HIT * BS + 3) for seed in seeds]
    for i, p in enumerate(prompts):
        drv.add(vllm_request(f"warm{i}", p, 1, BS))
    run(drv)
    evict_gpu(drv)
    return prompts


def test_a_hit_that_fits_is_computed_in_the_step_that_loads_it(model_config_dir):
    s, side, drv = build(model_config_dir, extra_config={"sync_load_budget_bytes": HIT * BLOCK})
    assert side.layout.hit_bytes(HIT * BS) == HIT * BLOCK
    (p,) = cached_prompts(drv, 1)
    q = p + tokens(2, 20)
    drv.add(vllm_request("b", q, 2, BS))
    so, _ = drv.step()
    meta = so.kv_connector_metadata
    # Loaded and scheduled in one step: every token past the hit, first token sampled now.
    assert len(meta.sync_load) == HIT and meta.sync_load_reqs == ["b"] and not len(meta.load)
    assert meta.sync_load.gpu_blocks == s.kv_cache_manager.get_block_ids("b")[0][:HIT]
    assert "b" not in meta.load_event_to_reqs.get(meta.sync_load.event, [])
    assert so.has_sync_kv_loads and so.num_scheduled_tokens == {"b": len(q) - HIT * BS}
    assert s.requests["b"].status == RequestStatus.RUNNING
    assert len(s.requests["b"].output_token_ids) == 1
    run(drv)
    counters = side.counters()
    assert (counters["sync_loads"], counters["sync_load_bytes"]) == (1, HIT * BLOCK)
    assert side.planner.stats.blocks_loaded == HIT and side.planner.stats.failed_transfers == 0
    assert_idle(s, side)


def test_a_hit_that_does_not_fit_waits_for_its_load(model_config_dir):
    s, side, drv = build(model_config_dir, extra_config={"sync_load_budget_bytes": HIT * BLOCK - 1})
    (p,) = cached_prompts(drv, 3)
    drv.add(vllm_request("b", p + tokens(4, 20), 2, BS))
    so, _ = drv.step()
    meta = so.kv_connector_metadata
    assert len(meta.load) == HIT and not len(meta.sync_load) and not so.has_sync_kv_loads
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "b" not in so.num_scheduled_tokens
    run(drv)
    assert side.counters()["sync_loads"] == 0 and side.planner.stats.blocks_loaded == HIT
    assert_idle(s, side)


def test_the_budget_is_per_step(model_config_dir):
    """Two hits of one budget each in one step: the first is loaded in the step, the second
    waits for its load; the next step's hit has the whole budget again."""
    s, side, drv = build(model_config_dir, extra_config={"sync_load_budget_bytes": HIT * BLOCK})
    p1, p2, p3 = cached_prompts(drv, 5, 6, 7)
    drv.add(vllm_request("b", p1 + tokens(8, 20), 2, BS))
    drv.add(vllm_request("c", p2 + tokens(9, 20), 2, BS))
    so, _ = drv.step()
    meta = so.kv_connector_metadata
    assert meta.sync_load_reqs == ["b"] and meta.load_event_to_reqs[meta.load.event] == ["c"]
    assert set(so.num_scheduled_tokens) == {"b"}
    assert s.requests["c"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    drv.add(vllm_request("d", p3 + tokens(10, 20), 2, BS))
    so, _ = drv.step()
    assert so.kv_connector_metadata.sync_load_reqs == ["d"]
    run(drv)
    assert side.counters()["sync_loads"] == 2 and side.planner.stats.blocks_loaded == 3 * HIT
    assert_idle(s, side)


def test_one_token_is_left_to_compute(model_config_dir):
    """A prompt that is all CPU hit: the hit stops a block short of its end (the last token
    must be computed), and that hit loads in the step that computes the rest."""
    s, side, drv = build(model_config_dir, extra_config={"sync_load_budget_bytes": 1 << 20})
    p = tokens(11, HIT * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    evict_gpu(drv)
    drv.add(vllm_request("b", p, 2, BS))
    so, _ = drv.step()
    assert len(so.kv_connector_metadata.sync_load) == HIT - 1
    assert so.num_scheduled_tokens == {"b": BS}
    run(drv)
    assert_idle(s, side)


def test_a_failed_same_step_load_is_recomputed(model_config_dir):
    """The workers report the load failed (its blocks invalid): vLLM recomputes the request
    from its first invalid block and drops the step's token; the planner releases the load's
    pins and offers the request no CPU hit again."""
    s, side, drv = build(model_config_dir, extra_config={"sync_load_budget_bytes": 1 << 20})
    s.recompute_kv_load_failures = True  # kv_load_failure_policy="recompute", as a server's
    (p,) = cached_prompts(drv, 12)
    drv.failed_loads.add("b")
    drv.add(vllm_request("b", p + tokens(13, 20), 2, BS))
    so, _ = drv.step()
    assert so.kv_connector_metadata.sync_load_reqs == ["b"]
    assert s.requests["b"].num_computed_tokens == 0  # truncated at the first invalid block
    assert not s.requests["b"].output_token_ids
    run(drv)
    assert side.planner.stats.failed_transfers == 1 and side.planner.stats.blocks_loaded == 0
    assert_idle(s, side)


def test_several_kv_cache_groups_are_refused_at_start(model_config_dir):
    with pytest.raises(ValueError, match=r"\['sync_load_budget_bytes'\] = 4096 needs a model "
                                         r"with one KV cache group, this one has 2"):
        make_scheduler(model_config_dir, [FULL, WINDOW], num_gpu_blocks=32,
                       extra_config={"sync_load_budget_bytes": 4096})
    make_scheduler(model_config_dir, [FULL, WINDOW], num_gpu_blocks=32,
                   extra_config={"sync_load_budget_bytes": 0})


def test_the_worker_waits_for_a_same_step_load_and_reports_it_apart(model_config_dir):
    """In the worker role a same-step load has landed when ``start_load_kv`` returns; it is
    reported in the worker metadata, never in ``finished_recving`` (the asynchronous load of
    the same event is); one that fails has its GPU blocks reported invalid."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from helpers.faults import inject
    from kvtriton.records import Transfer
    from kvtriton.sim.vllm_scheduler import make_configs
    from kvtriton.vllm import KVTritonConnector
    from kvtriton.vllm.metadata import KVTritonMetadata

    vllm_config, kv_cache_config, _ = make_configs(model_config_dir, [FULL], num_gpu_blocks=16,
                                                   cpu_blocks=8)
    conn = KVTritonConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
    kv = torch.zeros(2, 16, BS, 1, 8)
    conn.register_kv_caches({"layer0": kv})
    pool = conn.worker_side.engine.cpu_pool
    pool[1], pool[2] = 7, 9

    def step(ev: int) -> tuple:
        conn.bind_connector_metadata(KVTritonMetadata(
            load=Transfer(ev, [4], [2], [0]), load_event_to_reqs={ev: ["a"]},
            sync_load=Transfer(ev, [3], [1], [0]), sync_load_reqs=["s"]))
        conn.start_load_kv(None)
        landed = bool((kv[:, 3].view(torch.uint8) == 7).all())
        results = conn.get_transfer_results(set())
        return landed, results, conn.get_block_ids_with_load_errors(), \
            conn.build_connector_worker_meta()

    landed, results, invalid, meta = step(0)
    assert landed and results.finished_recving == {"a"} and not invalid
    assert meta.completed_sync_loads == {0: 1} and not meta.failed_sync_loads
    undo = inject("fail_loads")
    try:
        _, results, invalid, meta = step(1)
    finally:
        undo()
    assert results.failed_recving == {"a"} and invalid == {3, 4}
    assert meta.failed_sync_loads == {1: 1} and not meta.completed_sync_loads
    stats = conn.get_kv_connector_stats().data
    assert stats["worker_sync_loads_issued"] == 2 and stats["worker_loads_issued"] == 4
    conn.shutdown()
