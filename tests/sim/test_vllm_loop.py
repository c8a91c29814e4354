"""``simulate(engine="vllm")`` (``VllmLoop``): kvtriton's workloads through vLLM's real
scheduler, rows shaped as the kvtriton engine's, and exact agreement with ``ServingLoop`` where
the two must agree."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.conformance.crosscheck import compare, serving_loop_options
from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.splits import TEST, TRAIN, session_sets

HIT_KEYS = ("requests", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens")


@pytest.fixture(scope="module")
def workload():
    return agent_workload(num_conversations=4, min_turns=2, max_turns=4, system_prompt_tokens=512,
                          first_user_tokens=256, user_tokens=96, output_tokens=48, seed=3)


SETUPS = ["none", "eager", "eager+restore:0.5+tail+arc"]


@pytest.mark.scheduler_role
def test_rows_have_simulates_shape_and_everything_finishes(workload):
    # A GPU too small for the conversations' histories: next turns hit in the CPU tier.
    kw = {"gpu_tokens": 2048, "cpu_tokens": 16384, "setups": SETUPS, "bound": False}
    ours = simulate(workload, engine="vllm", **kw)
    ref = simulate(workload, **kw)
    assert [r["setup"] for r in ours.rows] == SETUPS
    assert ours.conditions["engine"] == "vllm"
    for a, b in zip(ours.rows, ref.rows, strict=True):
        assert set(a) == set(b)
        assert a["finished"] == a["requests"] == len(workload) and a["rejected"] == 0
        assert a["prompt_tokens"] == b["prompt_tokens"]
        assert len(a["ttft_all_s"]) == len(workload)
    no_cpu, control, arc = ours.rows
    assert no_cpu["cpu_hit_tokens"] == 0 and no_cpu["stored_blocks"] == 0
    assert control["cpu_hit_tokens"] > 0 and control["loaded_blocks"] > 0
    assert arc["token_hit_rate"] >= no_cpu["token_hit_rate"]
    row = compare(ref.rows[1], control)
    assert row["hit_rate_diff_points"] == pytest.approx(
        100 * (control["token_hit_rate"] - ref.rows[1]["token_hit_rate"]))


@pytest.mark.scheduler_role
def test_ample_gpu_gives_the_serving_loops_hits_exactly(workload):
    # Nothing is ever evicted and every turn waits for the previous one: both loops must see
    # the same prefix hits, token for token, and recompute nothing.
    kw = {"gpu_tokens": 1 << 18, "cpu_tokens": 1 << 18, "setups": ["none", "eager"],
          "bound": False, "parts": session_sets(workload)}
    vllm, ours = simulate(workload, engine="vllm", **kw), simulate(workload, **kw)
    for a, b in zip(vllm.rows, ours.rows, strict=True):
        assert (a["gpu_hit_tokens"], a["cpu_hit_tokens"], a["recomputed_tokens"]) == (
            b["gpu_hit_tokens"], b["cpu_hit_tokens"], b["recomputed_tokens"])
        assert a["recomputed_tokens"] == 0
        # Each part's figures are its own requests', in both engines.
        for part in (TRAIN, TEST):
            assert a["parts"][part]["requests"] > 0
            assert {k: a["parts"][part][k] for k in HIT_KEYS} == \
                {k: b["parts"][part][k] for k in HIT_KEYS}


@pytest.mark.scheduler_role
def test_bad_input(workload):
    with pytest.raises(ValueError, match="integrity"):
        simulate(workload, engine="vllm", integrity=True)
    with pytest.raises(ValueError, match="unknown setup"):
        simulate(workload, engine="vllm", setups=["nope"])
    with pytest.raises(ValueError, match="Mamba"):
        simulate(workload, engine="vllm", model="nemotron-h-8b")


# Measured wall time (the planner's own cost), the only figures the two loops may not share.
_MEASURED = {"wall_s", "planner_ms_per_step", "build_meta_ms_mean", "build_meta_ms_p99"}


# Not scheduler_role (the second lane, on vLLM 0.33): 25 s, and the serving loop models 0.32.
@pytest.mark.parametrize("full_isl", [True, False], ids=["vllm-defaults", "first-chunk"])
def test_under_gpu_pressure_the_serving_loop_is_vllms_step_for_step(full_isl):
    # A GPU too small for the conversations: preemptions, CPU loads that land while the GPU is
    # full, admissions the whole-prompt rule holds back. ServingLoop models vLLM 0.32's step
    # setup (loads that landed wait holding their blocks and never preempt, the in-flight
    # prefill reservation, the CPU lookup before allocation, scheduler_reserve_full_isl), and
    # the connector gets finished loads in completion order: every modeled figure agrees.
    wl = agent_workload(num_conversations=8, min_turns=3, max_turns=6, seed=0)
    kw = {"gpu_tokens": 12288, "cpu_tokens": 16384, "setups": ["none", "eager"],
          "bound": False}
    overrides = {"scheduler_reserve_full_isl": full_isl}
    loop = simulate(wl, **serving_loop_options(overrides), **kw)
    assert loop.conditions["reserve_full_isl"] is full_isl
    vllm = simulate(wl, engine="vllm", scheduler_overrides=overrides, **kw)
    for a, b in zip(loop.rows, vllm.rows, strict=True):
        assert a["preemptions"] > 0 and a["finished"] == len(wl)
        assert {k: v for k, v in a.items() if k not in _MEASURED} == \
            {k: v for k, v in b.items() if k not in _MEASURED}


@pytest.mark.scheduler_role
def test_serving_loop_options_follow_vllms_settings():
    assert serving_loop_options(None) == {"reserve_full_isl": True}  # vLLM 0.32's default
    assert serving_loop_options({"scheduler_reserve_full_isl": False}) == {
        "reserve_full_isl": False}
    assert serving_loop_options({"watermark": 0.0}) == {"reserve_full_isl": True}


@pytest.mark.scheduler_role
def test_finished_loads_reach_vllm_in_completion_order():
    # vLLM types finished_recving a set, and the connector hands the ids to the planner in its
    # iteration order (the order the loaded CPU blocks rejoin the CPU queue). A plain set would
    # iterate in string-hash order, so every figure would depend on PYTHONHASHSEED.
    from types import SimpleNamespace

    from kvtriton.sim.vllm_loop import VllmLoop

    loads = [f"conv{i}-turn{7 * i % 5}" for i in range(24)][::-1]
    run = SimpleNamespace(scheduler=SimpleNamespace(requests={}))
    out = VllmLoop._output(run, SimpleNamespace(num_scheduled_tokens={}), loads, {})
    got = out.kv_connector_output.finished_recving
    assert isinstance(got, set) and got == set(loads) and list(got) == loads
    assert VllmLoop._output(run, SimpleNamespace(num_scheduled_tokens={}), [], {}
                            ).kv_connector_output.finished_recving is None


@pytest.mark.scheduler_role
def test_sliding_window_admission_cap_is_vllms():
    # ServingLoop's whole-prompt rule counts a sliding window's pages as vLLM caps them
    # (max_admission_blocks_per_request at this step budget); full attention is not capped.
    import tempfile

    from kvtriton.pool import BlockPool
    from kvtriton.sim.batch_scheduler import BatchScheduler
    from kvtriton.sim.vllm_scheduler import make_scheduler, tiny_model_dir
    from kvtriton.specs import preset

    layout = preset("gemma3-12b", block_size=16)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(tiny_model_dir(tmp, 8192))
        for budget in (512, 2048):
            vllm = make_scheduler(model_dir, list(layout.groups), num_gpu_blocks=1000,
                                  kv_connector=None, kv_connector_module_path=None,
                                  max_num_batched_tokens=budget, max_model_len=8192)
            caps = [getattr(m, "max_admission_blocks_per_request", None)
                    for m in vllm.kv_cache_manager.coordinator.single_type_managers]
            ours = BatchScheduler(layout, BlockPool(1001), None, token_budget=budget,
                                  max_running=64)
            tables = [[] for _ in layout.groups]
            assert caps[0] is None and caps[1] > 0
            assert ours.blocks_to_hold(tables, 8000) == [500, caps[1]]
