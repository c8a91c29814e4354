"""A CPU tier must not cost the GPU prefix cache hits (``PlannerConfig.hold_finished``).

A request that finishes while stores of its blocks are in flight or queued (its finish flush)
would otherwise see those blocks join the GPU free queue only as the stores complete, after its
other blocks and head first, so GPU pressure evicts its chain's head first and its next turn
loses the whole GPU prefix hit it has without a tier (``bench/tier_study/finish_free_order.py``
traces it on the engine benchmark's workload). The scenario: ``a`` prefills 16 blocks in two
chunks (the second step stores the first chunk, the finish flush the second), an unrelated
filler then takes the 8 uncached GPU blocks and 4 of ``a``'s, and ``a``'s next turn comes back.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvtriton.setups import tier_setup
from kvtriton.sim.cost import CostModel
from kvtriton.sim.keys import workload_keys
from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import preset

BLOCK = 16
A_BLOCKS = 16
FILLER_BLOCKS = 12
GPU_BLOCKS = 24


def chain(seed: int, n: int) -> np.ndarray:
    return np.arange(seed * 1000 + 1, seed * 1000 + 1 + n, dtype=np.uint64)


def next_turn_after_pressure() -> Workload:
    prefix = chain(1, A_BLOCKS)
    return Workload([
        WorkloadRequest("a#0", 0.0, A_BLOCKS * BLOCK, 1, prefix, session="a"),
        WorkloadRequest("f", 1.0, FILLER_BLOCKS * BLOCK, 1, chain(2, FILLER_BLOCKS)),
        WorkloadRequest("a#1", 2.0, (A_BLOCKS + 1) * BLOCK, 1,
                        np.concatenate([prefix, chain(3, 1)]), session="a"),
    ], BLOCK, "next turn after pressure")


def gpu_hits(setup: str, hold: bool | None = None) -> dict[str, int]:
    wl = next_turn_after_pressure()
    layout = preset("llama3-8b", block_size=BLOCK)
    keys, _ = workload_keys(layout, wl)
    tier = tier_setup(setup)
    if hold is not None:
        tier = replace(tier, planner=replace(tier.planner, hold_finished=hold))
    # 128-token chunks: a's prompt takes two steps, the second storing the first chunk.
    loop = ServingLoop(wl, keys, layout, tier, CostModel.named("llama3-8b", "H100"),
                       gpu_blocks=GPU_BLOCKS, cpu_blocks=A_BLOCKS, token_budget=8 * BLOCK)
    m = loop.run()
    return {rid: t[1] for rid, t in m.tokens_by_request.items()}


@pytest.mark.parametrize("setup", ["eager", "eager+tail", "eager+s3fifo"])
def test_the_tier_keeps_the_gpu_prefix_hits_of_no_tier(setup):
    none = gpu_hits("none")
    # The filler's 12 blocks take the 8 uncached ones and 4 of a's: a's tail, without a tier.
    assert none["a#1"] == (A_BLOCKS - 4) * BLOCK
    assert gpu_hits(setup) == none


def test_released_store_by_store_the_head_goes_first():
    """The negative control: without the hold (vLLM's SimpleCPUOffloadConnector) the filler
    evicts a's head and its next turn hits nothing on the GPU."""
    assert gpu_hits("eager", hold=False)["a#1"] == 0
