"""Waiting-queue lookahead (``waiting``): the CPU copies of keys that a waiting request holds are
protected from eviction until that request is admitted.

The scenario: request ``a`` computes a prefix P, eight unrelated fillers queue behind it, then
``b`` (P plus one block) queues behind them with one request running at a time. The fillers'
stores push P out of an LRU tier before ``b`` is admitted; with lookahead P is still there. The
setups without ``waiting`` are the negative control: ``b`` must miss there."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.setups import parse_policy, tier_policy
from kvtriton.sim import simulate
from kvtriton.sim.cost import CostModel
from kvtriton.sim.keys import workload_keys
from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import preset

BLOCK = 16
P_BLOCKS = 16


def chain(seed: int, n: int) -> np.ndarray:
    return np.arange(seed * 1000 + 1, seed * 1000 + 1 + n, dtype=np.uint64)


def queued_reuse(fillers: int = 8) -> Workload:
    prefix = chain(1, P_BLOCKS)
    reqs = [WorkloadRequest("a", 0.0, P_BLOCKS * BLOCK, 1, prefix)]
    reqs += [WorkloadRequest(f"f{j}", 0.001 + j * 1e-4, P_BLOCKS * BLOCK, 1, chain(10 + j, 16))
             for j in range(fillers)]
    reqs.append(WorkloadRequest("b", 0.002, (P_BLOCKS + 1) * BLOCK, 1,
                                np.concatenate([prefix, chain(99, 1)])))
    return Workload(reqs, BLOCK, "queued reuse")


@pytest.mark.parametrize("store", ["eager", "lazy"])
def test_a_waiting_requests_prefix_survives_the_queue(store):
    res = simulate(queued_reuse(), gpu_tokens=64 * BLOCK, cpu_tokens=64 * BLOCK,
                   policies=[store, f"{store}+waiting"], max_running=1, in_loop_bounds=(),
                   bound=False)
    plain, lookahead = res.rows[:2]
    assert plain["cpu_hit_tokens"] == 0  # control: the fillers evicted P
    assert lookahead["cpu_hit_tokens"] == P_BLOCKS * BLOCK
    assert lookahead["gpu_hit_tokens"] == plain["gpu_hit_tokens"] == 0


def test_protection_ends_when_the_queue_empties():
    """Counts return to zero and nothing stays protected: the lookahead holds no state for
    requests that left the queue (a server running for days keeps it bounded)."""
    wl = queued_reuse()
    layout = preset("llama3-8b", block_size=BLOCK)
    keys, _ = workload_keys(layout, wl)
    loop = ServingLoop(wl, keys, layout, tier_policy("eager+waiting"),
                       CostModel.named("llama3-8b", "H100"), gpu_blocks=64, cpu_blocks=64,
                       max_running=1)
    peak = 0
    while loop.step():
        peak = max(peak, loop._hinted.protected_blocks)
    assert peak == P_BLOCKS
    assert not loop._waiting.any()
    assert loop._hinted.protected_blocks == 0


def test_the_protected_share_is_bounded():
    """``waiting:F`` protects at most F of the tier: with F = 1/8 of 64 blocks, 8 of P's 16
    blocks. They are protected tail first, so the overflow demotes P's tail and ``b`` hits
    P's first 8 blocks (protected head first, the head's blocks would be the ones demoted and
    ``b`` would hit nothing)."""
    res = simulate(queued_reuse(), gpu_tokens=64 * BLOCK, cpu_tokens=64 * BLOCK,
                   policies=["eager+waiting:0.125"], max_running=1, in_loop_bounds=(),
                   bound=False)
    row = res.rows[0]
    assert row["protect_overflow"] == 8
    assert row["cpu_hit_tokens"] == 8 * BLOCK


def test_lookahead_composition():
    p = parse_policy("waiting:0.25+lazy")
    assert p.composition == "lazy+waiting:0.25" and p.lookahead and not p.hints
    assert parse_policy("eager+waiting").waiting_protect_share == 0.5
