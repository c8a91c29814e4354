"""``simulate_vllm``: kvtriton's workloads through vLLM's real scheduler, rows shaped as
``kvtriton.simulate``'s, and exact agreement with ``ServingLoop`` where the two must agree."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from kvtriton.sim import agent_workload, simulate
from kvtriton.vllm import simulate_vllm
from kvtriton.vllm.crosscheck import compare


@pytest.fixture(scope="module")
def workload():
    return agent_workload(num_conversations=4, min_turns=2, max_turns=4, system_prompt_tokens=512,
                          first_user_tokens=256, user_tokens=96, output_tokens=48, seed=3)


POLICIES = ["no_cpu", "control", "restore_tail_bounded_arc"]


def test_rows_have_simulates_shape_and_everything_finishes(workload):
    # A GPU too small for the conversations' histories: next turns hit in the CPU tier.
    kw = {"gpu_tokens": 2048, "cpu_tokens": 16384, "policies": POLICIES, "bound": False}
    ours = simulate_vllm(workload, **kw)
    ref = simulate(workload, **kw)
    assert [r["policy"] for r in ours.rows] == POLICIES
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


def test_ample_gpu_gives_the_serving_loops_hits_exactly(workload):
    # Nothing is ever evicted and every turn waits for the previous one: both loops must see
    # the same prefix hits, token for token, and recompute nothing.
    kw = {"gpu_tokens": 1 << 18, "cpu_tokens": 1 << 18, "policies": ["no_cpu", "control"],
          "bound": False}
    for a, b in zip(simulate_vllm(workload, **kw).rows, simulate(workload, **kw).rows,
                    strict=True):
        assert (a["gpu_hit_tokens"], a["cpu_hit_tokens"], a["recomputed_tokens"]) == (
            b["gpu_hit_tokens"], b["cpu_hit_tokens"], b["recomputed_tokens"])
        assert a["recomputed_tokens"] == 0


def test_bad_input(workload):
    with pytest.raises(ValueError, match="integrity"):
        simulate_vllm(workload, integrity=True)
    with pytest.raises(ValueError, match="unknown policy"):
        simulate_vllm(workload, policies=["nope"])
    with pytest.raises(ValueError, match="Mamba"):
        simulate_vllm(workload, model="nemotron-h-8b")
