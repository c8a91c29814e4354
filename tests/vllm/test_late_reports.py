"""Transfers reported late, as a GPU's asynchronous copies are: on CPU a worker's copy finishes
within its step, so without this no store outlives a step.

- In vLLM's whole engine (``LLM``, in this process), with every transfer reported
  ``LATE_POLLS`` polls after it finished (``helpers.faults.inject("late_reports")``): outputs
  equal the recompute's, and once the engine has stepped while its scheduler has work
  (``bench.vllm.engine_run`` drains it as the engine-core process's loop does; ``LLM.generate``
  alone stops at its last output) nothing is in flight, every store batch issued is
  registered, the planner's idle invariants hold and the GPU pool is whole.
- In vLLM's scheduler, with stores held in flight: ``reset_prefix_cache(reset_running_requests
  =True, reset_connector=True)`` raises vLLM's ``RuntimeError`` before it reaches the
  connector's reset. vLLM's own ``SimpleCPUOffloadConnector`` does the same, so the fault is
  vLLM's (its GPU reset fails while a store pins GPU blocks, and it raises before resetting the
  connector); the README says so.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.conformance.scheduler_driver import Driver
from bench.vllm.engine_run import run_turns
from helpers.faults import inject
from helpers.vllm_driver import FULL, needs_engine, tokens
from kvtriton.sim.vllm_scheduler import make_scheduler, vllm_request

pytestmark = pytest.mark.scheduler_role

BS_ENGINE = 32
BLOCK_BYTES = 2 * 2 * BS_ENGINE * 32 * 4 * 2
TIER = {"cpu_bytes_per_rank": 1025 * BLOCK_BYTES}


def _conversations() -> list[list[list[int]]]:
    import random

    rng = random.Random(3)
    convs = [[rng.randrange(1, 999) for _ in range(300)] for _ in range(8)]
    out = []
    for _ in range(3):
        for c in convs:
            c += [rng.randrange(1, 999) for _ in range(100)]
        out.append([list(c) for c in convs])
    return out


@needs_engine()
def test_late_reports_in_the_engine_end_idle_with_every_store_registered(model_dir):
    turns = _conversations()
    ref = run_turns(model_dir, turns, connector=None)
    run = run_turns(model_dir, turns, connector=TIER, patch=lambda: inject("late_reports"))
    assert run.tokens == ref.tokens
    stats, worker = run.connector_stats, run.worker_stats
    assert stats["blocks_loaded"] > 0 and run.drain_steps > 0  # stores outlived generate()
    # Every store batch the workers ran was registered; nothing left in flight or pinned.
    assert stats["stores_completed"] == worker["stores_issued"]
    assert stats["blocks_stored"] == worker["blocks_stored"]
    assert run.idle == {"stores_pending": False, "loads_in_flight": 0,
                        "gpu_free": run.kv_cache_blocks - 1}


@pytest.mark.parametrize("connector", ["KVTritonConnector", "SimpleCPUOffloadConnector"])
def test_reset_of_running_requests_with_a_store_in_flight_raises_in_vllm(model_config_dir,
                                                                         connector):
    kw = {} if connector == "KVTritonConnector" else {"kv_connector_module_path": None}
    s = make_scheduler(model_config_dir, [FULL], num_gpu_blocks=64, cpu_blocks=128,
                       max_num_batched_tokens=256, kv_connector=connector, **kw)
    drv = Driver(s)
    drv.hold_stores = True
    drv.add(vllm_request("a", tokens(40, 4 * BS_ENGINE), 40, 16))
    for _ in range(3):
        drv.step()
    assert s.connector.has_pending_push_work()
    with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
        s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)


def test_requests_preempted_by_a_reset_are_looked_up_again(model_config_dir):
    # reset_prefix_cache(reset_running_requests=True) preempts every running request and vLLM
    # looks each up again before the step that reports the preemption: the connector tells the
    # planner, which otherwise refuses a lookup under a running request's id.
    s = make_scheduler(model_config_dir, [FULL], num_gpu_blocks=64, cpu_blocks=128,
                       max_num_batched_tokens=256)
    drv = Driver(s)
    drv.add(vllm_request("a", tokens(41, 3 * 16 + 5), 60, 16))
    for _ in range(4):
        drv.step()
    while s.connector.has_pending_push_work():
        drv.step()
    assert "a" in s.requests and s.reset_prefix_cache(reset_running_requests=True)
    drv.run()
    side = s.connector.scheduler_side
    assert "a" not in s.requests and side.planner.stats.lookups >= 2
    side.planner.check_invariants(idle=True)
