"""The serving-loop simulator: hand-computed scenarios, integrity mode, the command line."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.cli import main
from kvtriton.hashing import chain_hashes
from kvtriton.sim import Workload, WorkloadRequest, agent_workload, replay, simulate
from kvtriton.sim.integrity import IntegrityChecker, IntegrityError

B = 16


def _req(rid: str, prefix: int, prompt: int, output: int = 1, *, after: str | None = None,
         arrival: float = 0.0) -> WorkloadRequest:
    tokens = np.arange(prefix * 10_000, prefix * 10_000 + prompt + output)
    hashes = np.array(chain_hashes(tokens, B), dtype=np.uint64)
    return WorkloadRequest(rid, arrival, prompt, output, hashes, session="s", after=after)


def _row(result, policy: str) -> dict:
    return next(r for r in result.rows if r["policy"] == policy)


def test_repeat_prompt_hits_the_gpu_prefix_cache():
    # B repeats A's 64-token prompt after A finished: 3 blocks hit (the last token is always
    # recomputed, so the 4th block is prefilled again, and counts as recomputed).
    wl = Workload([_req("a", 1, 64), _req("b", 1, 64, after="a")], B)
    res = simulate(wl, gpu_blocks=64, cpu_blocks=64, policies=["no_cpu"], bound=False)
    row = _row(res, "no_cpu")
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
    res = simulate(wl, gpu_blocks=6, cpu_blocks=16, policies=["no_cpu", "restore_tail"],
                   bound=False)
    row = _row(res, "restore_tail")
    assert (row["gpu_hit_tokens"], row["cpu_hit_tokens"]) == (32, 16)
    assert row["stored_blocks"] == 8  # A's and C's four blocks each, by finish flushes
    assert row["loaded_blocks"] == 1
    assert row["recomputed_tokens"] == 16
    base = _row(res, "no_cpu")
    assert (base["gpu_hit_tokens"], base["cpu_hit_tokens"]) == (32, 0)
    assert base["recomputed_tokens"] == 32


def test_preemption_when_the_gpu_runs_out():
    # Two 64-token prompts decoding 40 tokens each in 9 GPU blocks: together they need 2 x 7
    # blocks by the end, so the newer one is preempted (recompute) and runs after the first.
    wl = Workload([_req("a", 1, 64, 40), _req("b", 2, 64, 40)], B)
    res = simulate(wl, gpu_blocks=9, cpu_blocks=32, policies=["no_cpu"], bound=False)
    row = _row(res, "no_cpu")
    assert row["finished"] == 2
    assert row["preemptions"] >= 1
    assert row["recomputed_tokens"] > 0


def test_a_request_larger_than_the_gpu_is_rejected_not_fatal():
    wl = Workload([_req("big", 1, 200), _req("small", 2, 32)], B)
    res = simulate(wl, gpu_blocks=8, cpu_blocks=8, policies=["no_cpu"], bound=False)
    row = _row(res, "no_cpu")
    assert (row["rejected"], row["finished"]) == (1, 1)


def test_hit_rates_and_the_bound_cover_the_same_requests():
    # "big" (13 blocks) cannot fit 8 GPU blocks. "again" repeats its prompt, so a bound over
    # every request would count a hit no run could have; the bound leaves "big" out as the
    # runs do, and "again" no longer waits for it. "small" and "small2" share 32 tokens.
    wl = Workload([_req("big", 1, 200), _req("again", 1, 64, after="big"),
                   _req("small", 2, 48), _req("small2", 2, 48, after="small")], B)
    res = simulate(wl, gpu_blocks=8, cpu_blocks=8, policies=["no_cpu", "restore_tail"])
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
    assert header.split()[:2] == ["policy", "rejected"]
    assert [line.split()[:2] for line in lines] == [
        ["no_cpu", "1"], ["restore_tail", "1"], ["eager", "1"], ["eager+nextuse", "1"],
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


def test_restore_policies_are_reported_side_by_side():
    wl = agent_workload(num_conversations=4, min_turns=3, max_turns=4, system_prompt_tokens=256,
                        first_user_tokens=128, user_tokens=64, output_tokens=32, seed=2)
    res = simulate(wl, gpu_tokens=2048, cpu_tokens=4096)
    # The default setups are named by composition, in the presets' order.
    assert [r["policy"] for r in res.rows] == [
        "none", "eager", "eager+restore", "eager+restore+tail", "eager+restore:0.5+tail",
        "eager+restore:0.5+tail+arc", "eager+restore:0.5+tail+s3fifo"]
    for r in res.rows:
        assert r["finished"] == len(wl)
        assert 0 <= r["token_hit_rate"] <= res.bound["hit_rate"] + 1e-9
    assert _row(res, "none")["cpu_hit_tokens"] == 0
    assert _row(res, "eager")["restored_blocks"] == 0


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), gpu=st.sampled_from([768, 1024, 2048]),
       cpu=st.sampled_from([256, 1024, 4096]))
def test_integrity_mode_over_random_workloads(seed, gpu, cpu):
    wl = agent_workload(num_conversations=3, min_turns=2, max_turns=4, system_prompt_tokens=128,
                        first_user_tokens=96, user_tokens=48, output_tokens=24, seed=seed)
    res = simulate(wl, gpu_tokens=gpu, cpu_tokens=cpu, integrity=True, bound=False,
                   policies=["control", "restore_tail"])
    for r in res.rows:
        assert r["finished"] + r["rejected"] == len(wl)
        assert r["integrity_blocks_checked"] == r["loaded_blocks"]
        assert r["integrity_registrations_checked"] == (
            r["integrity_blocks_filled"] + r["loaded_blocks"] + r["stored_blocks"])


@pytest.mark.parametrize("model", ["nemotron-h-8b", "gemma3-12b"])
def test_hybrid_models_store_and_load_every_group_with_integrity(model):
    # Full attention + Mamba (states handed off at 256-token boundaries) and full attention +
    # sliding window: CPU hits happen, land on the scheduler block, and every loaded block of
    # every group holds the bytes of its key.
    wl = agent_workload(num_conversations=4, min_turns=3, max_turns=5, system_prompt_tokens=512,
                        first_user_tokens=256, user_tokens=128, output_tokens=64, seed=3)
    res = simulate(wl, model=model, gpu_blocks=150, cpu_blocks=800, integrity=True,
                   policies=["restore_tail"], bound=False)
    row = res.rows[0]
    sched = {"nemotron-h-8b": 256, "gemma3-12b": 16}[model]
    assert row["cpu_hit_tokens"] > 0 and row["cpu_hit_tokens"] % sched == 0
    assert row["integrity_blocks_checked"] == row["loaded_blocks"] > 0
    assert (row["handoff_stored"] > 0) == (model == "nemotron-h-8b")


def test_integrity_mode_catches_a_corrupted_load():
    wl = Workload([_req("a", 1, 64), _req("c", 2, 64, after="a"), _req("b", 1, 64, after="c")],
                  B)
    original = IntegrityChecker.execute

    def corrupting(self, meta):
        original(self, meta)
        for b in meta.load.gpu_blocks:  # flip a byte of every block just loaded
            view, _ = self.engine.segments[0][0]
            view[b, 0] ^= 0xFF

    IntegrityChecker.execute = corrupting
    try:
        with pytest.raises(IntegrityError, match=r"step \d+: request 'b': GPU block \d+"):
            simulate(wl, gpu_blocks=6, cpu_blocks=16, policies=["restore_tail"], integrity=True,
                     bound=False)
    finally:
        IntegrityChecker.execute = original


# ---- the command line ---------------------------------------------------------------------------

def test_cli_simulate_writes_json_and_table(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["simulate", "--conversations", "3", "--turns", "2", "3", "--gpu-tokens", "4096",
               "--cpu-tokens", "8192", "--policies", "control,restore_tail", "--json", str(out),
               "--quiet"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "restore_tail" in text and "hit rate" in text
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["rows"]] == ["control", "restore_tail"]


def test_cli_shows_rejected_requests(tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert main(["simulate", "--conversations", "3", "--turns", "2", "3", "--gpu-blocks", "230",
                 "--cpu-blocks", "1000", "--policies", "control", "--quiet", "--json",
                 str(out)]) == 0
    text = capsys.readouterr().out
    assert "9 requests (8 rejected: larger than the GPU; hit rates and the bound cover the " \
           "others)" in text
    doc = json.loads(out.read_text())
    assert doc["conditions"]["rejected"] == doc["rows"][0]["rejected"] == 8
    assert (doc["bound"]["requests"], doc["bound"]["rejected"]) == (1, 8)


@pytest.mark.parametrize("argv, message", [
    (["simulate", "--gpu-tokens", "0"], "--gpu-tokens: '0' must be positive"),
    (["simulate", "--gpu-tokens", "x"], "is not an integer"),
    (["simulate", "--policies", "nope"], "unknown policy 'nope'"),
    (["simulate", "--model", "gpt5"], "invalid choice"),
    (["simulate", "--gpu-tokens", "8", "--gpu-gib", "1"], "give one of"),
    (["simulate", "--workload", "/no/such/trace.jsonl"], "no such file"),
    (["replay", "--evictions", "fifo"], "fifo"),
    (["trace-stats", "/no/such/file"], "no such file"),
    ([], "required: command"),
], ids=["zero", "not-int", "policy", "model", "two-units", "missing-file", "replay-eviction",
        "stats-missing", "no-command"])
def test_cli_errors_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtriton: error:")
    assert message in err


@pytest.mark.parametrize("name, content, where", [
    ("t.jsonl", "", "empty"),
    ("t.jsonl", '{"timestamp": 0, "input_length": 10, "output_length": 1}\n', ":1:"),
    ("t.jsonl", '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [2]}\n', ":2:"),
    ("t.jsonl", '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}\n',
     ":1:"),
    ("t.jsonl", "not json at all\n", ":1: bad JSON"),
    ("t.txt", "not json at all\n", "not a Mooncake"),
], ids=["empty", "missing-field", "time-goes-back", "negative-length", "bad-json",
        "wrong-format"])
def test_cli_bad_trace_names_file_and_line(tmp_path, capsys, name, content, where):
    path = tmp_path / name
    path.write_text(content)
    assert main(["trace-stats", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and where in err
