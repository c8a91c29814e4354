"""The serving loop (``kvtriton.sim.loop.ServingLoop``): the waiting-queue lookahead, and clean
ends.

Waiting-queue lookahead (``waiting``): the CPU copies of keys that a waiting request holds are
protected from eviction until that request is admitted. The scenario: request ``a`` computes a
prefix P, eight unrelated fillers queue behind it, then ``b`` (P plus one block) queues behind
them with one request running at a time. The fillers' stores push P out of an LRU tier before
``b`` is admitted; with lookahead P is still there. The setups without ``waiting`` are the
negative control: ``b`` must miss there.

Clean ends: a run steps on until the planner has nothing pending, and both pools end all free
(``ServingLoop.run`` checks it in every simulation, so every run checks it too).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.planner import OffloadPlanner
from kvtriton.setups import tier_setup
from kvtriton.sim import MOONCAKE_SYNTHETIC, agent_workload, data_path, load_trace, simulate
from kvtriton.sim.cost import CostModel
from kvtriton.sim.errors import UncleanEndError
from kvtriton.sim.keys import workload_keys
from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.sim.workloads import limit_workload
from kvtriton.specs import preset

# ---- waiting-queue lookahead ---------------------------------------------------------------------


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
                   setups=[store, f"{store}+waiting"], max_running=1, references=(),
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
    loop = ServingLoop(wl, keys, layout, tier_setup("eager+waiting"),
                       CostModel.named("llama3-8b", "H100"), gpu_blocks=64, cpu_blocks=64,
                       max_running=1)
    peak = 0
    while loop.step():
        peak = max(peak, loop._signals.queue.protected_blocks)
    assert peak == P_BLOCKS
    assert loop._signals.keys_held_waiting == 0 and not loop._signals.waiting_keys()
    assert loop._signals.queue.protected_blocks == 0


def test_the_protected_share_is_bounded():
    """``waiting:F`` protects at most F of the tier: with F = 1/8 of 64 blocks, 8 of P's 16
    blocks. They are protected tail first, so the overflow demotes P's tail and ``b`` hits
    P's first 8 blocks (protected head first, the head's blocks would be the ones demoted and
    ``b`` would hit nothing)."""
    res = simulate(queued_reuse(), gpu_tokens=64 * BLOCK, cpu_tokens=64 * BLOCK,
                   setups=["eager+waiting:0.125"], max_running=1, references=(),
                   bound=False)
    row = res.rows[0]
    assert row["protect_overflow"] == 8
    assert row["cpu_hit_tokens"] == 8 * BLOCK


# ---- clean ends ----------------------------------------------------------------------------------


def _loop(wl, setup: str, *, gpu_blocks: int, cpu_blocks: int, model: str = "llama3-8b"
          ) -> ServingLoop:
    layout = preset(model, block_size=wl.hash_block_size)
    keys, _ = workload_keys(layout, wl)
    return ServingLoop(wl, keys, layout, tier_setup(setup), CostModel.named(model, "H100"),
                       gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks)


def _assert_clean(loop: ServingLoop) -> None:
    assert not loop.planner.has_pending_work()
    assert loop.gpu.num_used_blocks == 0 and loop.cpu.num_used_blocks == 0
    assert not loop.planner.loads_in_flight() and not loop.planner.store_events_in_flight()
    loop.planner.check_invariants(idle=True)


MOONCAKE_20 = limit_workload(load_trace(data_path(MOONCAKE_SYNTHETIC), hash_block_size=16), 20)
SMALL_CPU_POOLS = [1, 2, 3, 8, 32]


@pytest.mark.parametrize("cpu_blocks", SMALL_CPU_POOLS, ids=[f"cpu{c}" for c in SMALL_CPU_POOLS])
def test_the_last_finish_flush_is_sent_and_both_pools_end_free(cpu_blocks):
    # kvtriton simulate --workload mooncake --limit 20 --cpu-blocks 1 (a GPU of 16,384 blocks),
    # and other small CPU pools: with few CPU blocks no store is in flight when the last request
    # finishes; the loop steps on until that request's finish flush is sent and completed.
    for setup in ("eager+restore+tail", "eager+restore:0.5+tail"):
        loop = _loop(MOONCAKE_20, setup, gpu_blocks=16384, cpu_blocks=cpu_blocks)
        m = loop.run()
        assert m.finished + m.rejected == len(MOONCAKE_20)
        _assert_clean(loop)


@pytest.mark.parametrize("cpu_blocks", SMALL_CPU_POOLS, ids=[f"cpu{c}" for c in SMALL_CPU_POOLS])
def test_agent_runs_with_small_cpu_pools_end_clean(cpu_blocks):
    wl = agent_workload(num_conversations=3, min_turns=2, max_turns=3, system_prompt_tokens=256,
                        seed=1)
    loop = _loop(wl, "eager+restore:0.5+tail", gpu_blocks=2048, cpu_blocks=cpu_blocks)
    loop.run()
    _assert_clean(loop)


def test_an_unclean_end_is_an_error(monkeypatch):
    # Negative control: a planner that hides its queued flush makes the loop stop with the
    # flush's blocks pinned in both pools.
    monkeypatch.setattr(OffloadPlanner, "has_pending_work", lambda self: False)
    loop = _loop(MOONCAKE_20, "eager+restore:0.5+tail", gpu_blocks=16384, cpu_blocks=1)
    with pytest.raises(UncleanEndError, match=r"setup 'eager\+restore:0\.5\+tail': the run ended "
                                              r"at step \d+ with .*1 of 1 CPU blocks still held"):
        loop.run()


# ---- queueing delay ------------------------------------------------------------------------------


def test_queueing_delay_is_the_wait_before_admission():
    # One request runs at a time: the second of two simultaneous arrivals waits for the first
    # to finish (its queueing delay is at least the first's TTFT); the first waits no step.
    wl = Workload([WorkloadRequest("a", 0.0, 64, 4, chain(1, 4)),
                   WorkloadRequest("b", 0.0, 64, 4, chain(2, 4))], BLOCK)
    row = simulate(wl, gpu_blocks=64, cpu_blocks=64, setups=["none"], bound=False,
                   max_running=1).rows[0]
    first_ttft = min(row["ttft_all_s"])
    assert row["queue_delay_p50_s"] == pytest.approx(row["queue_delay_mean_s"])
    assert row["queue_delay_mean_s"] >= first_ttft / 2  # (0 + at least first_ttft) / 2
    two = simulate(wl, gpu_blocks=64, cpu_blocks=64, setups=["none"], bound=False,
                   max_running=2).rows[0]
    assert two["queue_delay_mean_s"] == 0.0  # the negative control: nobody waits


# ---- a step that only preempts -------------------------------------------------------------------


def tight_pool(later: float | None = None) -> Workload:
    """24 GPU blocks: ``w`` leaves its prefix on the CPU, ``f`` pushes it off the GPU, ``a``
    decodes into the last free blocks, and ``b`` (``w``'s prefix and two more blocks) is admitted
    with a CPU hit whose load lands while ``a`` holds the room ``b`` needs next. When ``a``
    cannot grow it preempts itself, and that step, as in vLLM, skips the waiting phase: nothing
    runs, nothing is in flight, no request is still to arrive (``later``: one more, ``z``,
    arrives at that time)."""
    w = chain(1, 8)
    reqs = [WorkloadRequest("w", 0.0, 8 * BLOCK, 1, w),
            WorkloadRequest("f", 0.05, 22 * BLOCK, 1, chain(4, 22)),
            WorkloadRequest("a", 0.2, 12 * BLOCK, 160, chain(2, 22)),
            WorkloadRequest("b", 0.5805, 9 * BLOCK, 16, np.concatenate([w, chain(3, 2)]))]
    if later is not None:
        reqs.append(WorkloadRequest("z", later, 2 * BLOCK, 1, chain(5, 2)))
    return Workload(reqs, BLOCK, "tight pool")


@pytest.mark.parametrize("engine", ["kvtriton", "vllm"])
def test_a_step_that_only_preempts_is_not_a_deadlock(engine):
    """The step after it schedules ``b``'s landed load into the room ``a`` freed. Taking the
    empty step for idle, the loop found no event to wait for and raised a deadlock (it did so
    in the README's agent example at 32 conversations, for eager+nextuse)."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    res = simulate(tight_pool(), gpu_tokens=24 * BLOCK, cpu_tokens=64 * BLOCK,
                   setups=["eager"], bound=False, references=(), engine=engine)
    row = res.rows[0]
    assert row["finished"] == 4 and row["preemptions"] == 1
    assert row["cpu_hit_tokens"] == 8 * BLOCK  # b's load is the one the step had to wait out


@pytest.mark.parametrize("engine", ["kvtriton", "vllm"])
def test_a_step_that_only_preempts_does_not_wait_for_the_next_event(engine):
    """With ``z`` due at 100 s, the loop used to move the clock to it after the empty step, as
    if the engine idled: ``b`` waited 99 s for room it already had. vLLM's engine schedules
    again at once."""
    if engine == "vllm":
        pytest.importorskip("vllm")
    res = simulate(tight_pool(later=100.0), gpu_tokens=24 * BLOCK, cpu_tokens=64 * BLOCK,
                   setups=["eager"], bound=False, references=(), engine=engine)
    row = res.rows[0]
    assert row["finished"] == 5 and row["preemptions"] == 1
    ttft = dict(zip("wfabz", row["ttft_all_s"], strict=True))
    assert ttft["b"] < 1.0  # 99.4 s when the empty step waited for z
    assert row["makespan_s"] < 100.5
