"""``simulate()`` (``kvtriton.sim.simulate``): hand-computed scenarios of the serving loop, the
bound and the rows it covers, refusals before any run, the default setups side by side,
compositions with the references run in the same loop (their arithmetic:
``test_references.py``).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from kvtriton.hashing import chain_hashes
from kvtriton.sim import Workload, WorkloadRequest, agent_workload, replay, simulate
from kvtriton.sim.integrity import IntegrityChecker

B = 16


def _req(rid: str, prefix: int, prompt: int, output: int = 1, *, after: str | None = None,
         arrival: float = 0.0) -> WorkloadRequest:
    tokens = np.arange(prefix * 10_000, prefix * 10_000 + prompt + output)
    hashes = np.array(chain_hashes(tokens, B), dtype=np.uint64)
    return WorkloadRequest(rid, arrival, prompt, output, hashes, session="s", after=after)


def _row(result, setup: str) -> dict:
    return next(r for r in result.rows if r["setup"] == setup)


def test_repeat_prompt_hits_the_gpu_prefix_cache():
    # B repeats A's 64-token prompt after A finished: 3 blocks hit (the last token is always
    # recomputed, so the 4th block is prefilled again, and counts as recomputed).
    wl = Workload([_req("a", 1, 64), _req("b", 1, 64, after="a")], B)
    res = simulate(wl, gpu_blocks=64, cpu_blocks=64, setups=["none"], bound=False)
    row = _row(res, "none")
    assert row["prompt_tokens"] == 128
    assert row["gpu_hit_tokens"] == 48
    assert row["cpu_hit_tokens"] == 0
    assert row["prefill_tokens"] == 80
    assert row["recomputed_tokens"] == 16
    assert row["preemptions"] == 0
    assert row["finished"] == 2


def test_cpu_tier_serves_what_the_gpu_evicted():
    # 6 GPU blocks. A (4 blocks) finishes and is flushed to the CPU; C (4 other blocks) evicts
    # A's two tail blocks from the GPU (freed tail first, so they are the LRU head); B repeats A:
    # blocks 0-1 hit the GPU, block 2 the CPU, block 3 holds the last token and is recomputed.
    wl = Workload([_req("a", 1, 64), _req("c", 2, 64, after="a"), _req("b", 1, 64, after="c")],
                  B)
    res = simulate(wl, gpu_blocks=6, cpu_blocks=16, setups=["none", "eager+restore+tail"],
                   bound=False)
    row = _row(res, "eager+restore+tail")
    assert (row["gpu_hit_tokens"], row["cpu_hit_tokens"]) == (32, 16)
    assert row["stored_blocks"] == 8  # A's and C's four blocks each, by finish flushes
    assert row["loaded_blocks"] == 1
    assert row["recomputed_tokens"] == 16
    base = _row(res, "none")
    assert (base["gpu_hit_tokens"], base["cpu_hit_tokens"]) == (32, 0)
    assert base["recomputed_tokens"] == 32


def test_preemption_when_the_gpu_runs_out():
    # Two 64-token prompts decoding 40 tokens each in 9 GPU blocks: together they need 2 x 7
    # blocks by the end, so the newer one is preempted (recompute) and runs after the first.
    wl = Workload([_req("a", 1, 64, 40), _req("b", 2, 64, 40)], B)
    res = simulate(wl, gpu_blocks=9, cpu_blocks=32, setups=["none"], bound=False)
    row = _row(res, "none")
    assert row["finished"] == 2
    assert row["preemptions"] >= 1
    assert row["recomputed_tokens"] > 0


def test_a_request_larger_than_the_gpu_is_rejected_not_fatal():
    wl = Workload([_req("big", 1, 200), _req("small", 2, 32)], B)
    res = simulate(wl, gpu_blocks=8, cpu_blocks=8, setups=["none"], bound=False)
    row = _row(res, "none")
    assert (row["rejected"], row["finished"]) == (1, 1)


def test_hit_rates_and_the_bound_cover_the_same_requests():
    # "big" (13 blocks) cannot fit 8 GPU blocks. "again" repeats its prompt, so a bound over
    # every request would count a hit no run could have; the bound leaves "big" out as the
    # runs do, and "again" does not wait for it. "small" and "small2" share 32 tokens.
    wl = Workload([_req("big", 1, 200), _req("again", 1, 64, after="big"),
                   _req("small", 2, 48), _req("small2", 2, 48, after="small")], B)
    res = simulate(wl, gpu_blocks=8, cpu_blocks=8, setups=["none", "eager+restore+tail"])
    assert res.conditions["rejected"] == 1
    for r in res.rows + res.bounds:
        assert (r["rejected"], r["finished"], r["prompt_tokens"]) == (1, 3, 64 + 48 + 48)
    for r in res.rows:
        assert r["token_hit_rate"] <= res.bound["hit_rate"] + 1e-9
    admitted = Workload([_req("again", 1, 64), _req("small", 2, 48),
                         _req("small2", 2, 48, after="small")], B)
    expect = replay(admitted, res.bound["capacity_tokens"], eviction="belady")
    assert (res.bound["hit_rate"], res.bound["requests"], res.bound["rejected"]) == (
        expect.hit_rate, 3, 1)
    header, _, *lines = res.table().splitlines()
    assert header.split()[:2] == ["setup", "rejected"]
    assert [line.split()[:2] for line in lines] == [
        ["none", "1"], ["eager+restore+tail", "1"], ["eager", "1"], ["eager+nextuse", "1"],
        ["lazy+nextuse", "1"], ["eager+inf", "1"]]


def test_every_request_rejected_is_an_error_not_a_table():
    wl = Workload([_req("a", 1, 64), _req("b", 2, 32)], B)
    with pytest.raises(ValueError, match=r"every request would be rejected \(2 of 2\): the "
                                         r"smallest needs 3 GPU blocks, the GPU holds 2"):
        simulate(wl, gpu_blocks=2, cpu_blocks=8)


def test_capacities_beyond_this_machine_are_refused_before_allocating(monkeypatch):
    # The module, not the function kvtriton.sim exports under the same name.
    sim_module = importlib.import_module("kvtriton.sim.simulate")

    def refuse(*args, **kwargs):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr(IntegrityChecker, "__init__", refuse)
    monkeypatch.setattr(sim_module.ServingLoop, "__init__", refuse)
    monkeypatch.setattr(sim_module, "machine_memory_bytes", lambda: 64 << 30)
    wl = Workload([_req("a", 1, 64)], B)
    with pytest.raises(ValueError, match=r"GPU 300,000,000 blocks, CPU 8 blocks: the simulator's "
                                         r"block pools and integrity tensors need about "
                                         r"[\d,.]+ GiB, more than this machine's 64.0 GiB"):
        simulate(wl, gpu_blocks=300_000_000, cpu_blocks=8, integrity=True)
    with pytest.raises(ValueError, match=r"CPU 1,000,000,000,000 blocks: the simulator's block "
                                         r"pools need"):
        simulate(wl, gpu_blocks=8, cpu_blocks=10**12)


def test_an_lfu_sketch_beyond_this_machine_is_refused_naming_the_setup(monkeypatch):
    """The simulator counts the ``lfu:W`` sketch of its CPU tier (issue 36, item 7): a sketch
    that does not fit beside the pools is one error naming the setup, before any run."""
    sim_module = importlib.import_module("kvtriton.sim.simulate")

    def refuse(*args, **kwargs):
        raise AssertionError("allocated before the memory check")

    monkeypatch.setattr(sim_module.ServingLoop, "__init__", refuse)
    monkeypatch.setattr(sim_module, "machine_memory_bytes", lambda: 64 << 30)
    wl = Workload([_req("a", 1, 64)], B)
    with pytest.raises(ValueError, match=r"^setup 'eager\+lfu:1000000': its LFU sketch for the "
                                         r"CPU tier of 262,143 blocks takes 1,024.0 GiB, which "
                                         r"with the simulator's block pools need about 0.0 GiB "
                                         r"is more than this machine's 64.0 GiB of memory; use "
                                         r"a smaller window W"):
        simulate(wl, gpu_blocks=8, cpu_blocks=262_143, setups=["eager", "eager+lfu:1000000"])
    # A moderate window's sketch is counted too: 4 rows of 64 x 1,000 counters, rounded up to
    # 2^16, beside the pools it must fit with.
    pools = sim_module.ServingLoop.bytes_needed(8, 1000)
    sketch = 4 << 16
    monkeypatch.setattr(sim_module, "machine_memory_bytes", lambda: pools + sketch - 1)
    with pytest.raises(ValueError, match=r"^setup 'eager\+lfu:64\+waiting': its LFU sketch"):
        simulate(wl, gpu_blocks=8, cpu_blocks=1000, setups=["eager", "eager+lfu:64+waiting"],
                 check_only=True)
    monkeypatch.setattr(sim_module, "machine_memory_bytes", lambda: pools + sketch)
    simulate(wl, gpu_blocks=8, cpu_blocks=1000, setups=["eager+lfu:64+waiting"],
             check_only=True)


def test_a_setup_with_tiny_or_huge_numbers_is_printed_as_written():
    """The names the simulator's rows and table print parse back to the setups that ran (issue
    36, item 6: ``restore:1e-05`` and ``lfu:1e+06`` did not)."""
    from kvtriton.setups import tier_setup
    from kvtriton.sim.metrics import format_table

    wl = Workload([_req("a", 1, 64), _req("b", 1, 64, after="a")], B)
    names = ["eager+restore:0.00001", "eager+lfu:1000000"]
    res = simulate(wl, gpu_blocks=8, cpu_blocks=8, setups=names, bound=False)
    assert [r["setup"] for r in res.rows] == names
    assert [r["composition"] for r in res.rows] == names
    table = format_table(res.rows)
    for name in names:
        assert name in table and tier_setup(name).composition == name


def test_restore_setups_are_reported_side_by_side():
    wl = agent_workload(num_conversations=4, min_turns=3, max_turns=4, system_prompt_tokens=256,
                        first_user_tokens=128, user_tokens=64, output_tokens=32, seed=2)
    res = simulate(wl, gpu_tokens=2048, cpu_tokens=4096)
    # The default setups are named by composition, in the presets' order.
    assert [r["setup"] for r in res.rows] == [
        "none", "eager", "eager+restore", "eager+restore+tail", "eager+restore:0.5+tail",
        "eager+restore:0.5+tail+arc", "eager+restore:0.5+tail+s3fifo"]
    for r in res.rows:
        assert r["finished"] == len(wl)
        assert 0 <= r["token_hit_rate"] <= res.bound["hit_rate"] + 1e-9
    assert _row(res, "none")["cpu_hit_tokens"] == 0
    assert _row(res, "eager")["restored_blocks"] == 0


# ---- compositions and the references ----------------------------------------------------


def test_simulate_runs_compositions_and_the_references():
    wl = agent_workload(num_conversations=4, min_turns=3, max_turns=4, seed=3)
    res = simulate(wl, gpu_tokens=8192, cpu_tokens=8192, setups=["lazy+hints", "eager+arc"])
    names = [r["setup"] for r in res.rows + res.bounds]
    assert names == ["lazy+hints", "eager+arc", "eager", "eager+nextuse", "lazy+nextuse",
                     "eager+inf"]
    every = res.rows + res.bounds
    assert all(r["finished"] == len(wl) for r in every)
    inf = next(r for r in res.bounds if r["composition"] == "eager+inf")
    assert inf["cpu_blocks"] > res.conditions["cpu_blocks"]
    assert inf["running_evictions"] == 0
    hinted = res.rows[0]
    assert sum(hinted["hints_applied"].values()) == len(wl)
    assert hinted["lazy_stored"] > 0 and hinted["stored_blocks"] > 0
    assert "headroom" in res.table().splitlines()[0]
    refs = res.references
    assert refs["oracle_reference"]["setup"] in ("eager+nextuse", "lazy+nextuse")
    assert refs["upper_bound"]["token_hit_rate"] == min(inf["token_hit_rate"],
                                                        res.bound["hit_rate"])
    for r in every:
        assert r["headroom_share"] is None or r["headroom_share"] <= 1 + 1e-9
    off = simulate(wl, gpu_tokens=8192, cpu_tokens=8192, setups=["eager+arc"], bound=False)
    assert [r["setup"] for r in off.rows] == ["eager+arc"] and off.bounds == []


def test_a_measured_cost_runs_the_clock():
    """``cost=``: the clock charges the given model (a request alone: TTFT is one step of its
    prompt, by hand), and the result records it."""
    from kvtriton.sim.cost import MeasuredCost

    cost = MeasuredCost(step_overhead_s=0.01, prefill_s_per_token=1e-3, prefill_s_per_attended=0.0,
                        decode_s_per_seq=0.0, decode_s_per_context_token=0.0,
                        h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    wl = Workload([_req("a", 1, 64)], B)
    res = simulate(wl, gpu_blocks=64, cpu_blocks=64, setups=["eager"], bound=False, cost=cost)
    assert _row(res, "eager")["ttft_p50_s"] == pytest.approx(0.01 + 64e-3)
    assert res.conditions["cost_model"]["kind"] == "measured"
    default = simulate(wl, gpu_blocks=64, cpu_blocks=64, setups=["eager"], bound=False)
    assert _row(default, "eager")["ttft_p50_s"] != pytest.approx(0.01 + 64e-3)
