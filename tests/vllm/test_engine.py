"""``KVTritonConnector`` in vLLM's whole engine (``LLM``), on CPU, with a tiny random model.

Both roles run: the scheduler side in the engine core, the worker side moving real KV bytes
between vLLM's KV cache and the CPU tier with kvtriton's ``TransferEngine``. Each case compares
the greedy outputs of a workload served with the CPU tier against the same workload served
without it (every token recomputed):

- tokens must be identical and logprobs equal to within ``LOGPROB_TOL``. Not bit for bit: a
  prompt whose prefix came from the CPU tier computes its suffix in other batch shapes than a
  recompute does, and fp32 GEMMs round differently with the shape. ``test_scheduling_noise``
  measures that rounding without any CPU tier (a larger KV cache, so other prefix hits and
  batches) and the tolerance sits above it;
- the negative control corrupts every load (valid KV in the wrong blocks) and must fail that
  comparison.

Each engine run takes a few seconds here (vLLM's CPU build, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
except in the multiprocess case).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.vllm.engine_run import EngineRun, run_turns, tiny_llama
from helpers.faults import inject

LOGPROB_TOL = 1e-4
BS = 32
BLOCK_BYTES = 2 * 2 * BS * 32 * 4 * 2  # K and V, 2 KV heads of 32, fp32, 2 layers: 32 KiB
TIER = {"cpu_bytes_per_rank": 1025 * BLOCK_BYTES}  # 1,024 CPU blocks: it never evicts


def conversations(seed: int = 0, n: int = 8, start: int = 300, turn: int = 100,
                  turns: int = 4) -> list[list[list[int]]]:
    """``turns`` batches of ``n`` conversations; each turn extends every prompt by ``turn``
    tokens, so a conversation's next prompt starts with its last one. ``n * (start + turns *
    turn)`` tokens exceed the 4,096-token KV cache: prefixes leave it between turns."""
    rng = random.Random(seed)
    convs = [[rng.randrange(1, 999) for _ in range(start)] for _ in range(n)]
    out = []
    for _ in range(turns):
        for c in convs:
            c += [rng.randrange(1, 999) for _ in range(turn)]
        out.append([list(c) for c in convs])
    return out


def max_logprob_diff(a: EngineRun, b: EngineRun) -> float:
    return max(abs(x - y) for ta, tb in zip(a.logprobs, b.logprobs, strict=True)
               for pa, pb in zip(ta, tb, strict=True) for x, y in zip(pa, pb, strict=True))


def same_outputs(a: EngineRun, b: EngineRun) -> bool:
    return a.tokens == b.tokens and max_logprob_diff(a, b) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def multi_turn(model_dir):
    turns = conversations()
    return {"recompute": run_turns(model_dir, turns, connector=None),
            "tier": run_turns(model_dir, turns, connector=TIER),
            # As on a GPU: every transfer reported LATE_POLLS polls after it finished.
            "tier_late": run_turns(model_dir, turns, connector=TIER,
                                   patch=lambda: inject("late_reports")),
            "corrupt": run_turns(model_dir, turns, connector=TIER,
                                 patch=lambda: inject("corrupt_loads")),
            "bigger_cache": run_turns(model_dir, turns, connector=None,
                                      kv_cache_memory_bytes=64 << 20)}


def test_scheduling_noise_is_below_the_tolerance(multi_turn):
    """Without a CPU tier, other prefix hits and batches (a 16x KV cache) change logprobs only
    by fp32 rounding, well below ``LOGPROB_TOL``; tokens are the same."""
    a, b = multi_turn["recompute"], multi_turn["bigger_cache"]
    assert a.tokens == b.tokens
    assert max_logprob_diff(a, b) <= LOGPROB_TOL / 10


@pytest.mark.parametrize("tier", ["tier", "tier_late"])
def test_cpu_tier_hits_give_the_recompute_outputs(multi_turn, tier):
    ref, run = multi_turn["recompute"], multi_turn[tier]
    stats, worker = run.connector_stats, run.worker_stats
    # The workload must exercise the tier: GPU evictions, then CPU loads of real bytes.
    assert stats["blocks_loaded"] >= 50 and stats["cpu_hit_tokens"] >= 50 * BS
    assert worker["blocks_loaded"] == stats["blocks_loaded"]
    assert worker["blocks_stored"] >= stats["blocks_stored"] > 0
    assert worker["failed_loads"] == worker["failed_stores"] == 0
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"


def test_negative_control_corrupted_loads_change_the_outputs(multi_turn):
    ref, bad = multi_turn["recompute"], multi_turn["corrupt"]
    assert bad.connector_stats["blocks_loaded"] == multi_turn["tier"].connector_stats[
        "blocks_loaded"]
    assert not same_outputs(ref, bad)


def test_same_step_loads_give_the_recompute_outputs(model_dir, multi_turn):
    """With ``sync_load_budget_bytes`` (1 MiB: 32 blocks a step) a CPU hit that fits is loaded
    before the forward pass of the step that schedules it and computed in that step; the rest
    wait for their load as before. Outputs are the recompute's. The negative control scrambles
    the CPU copy each same-step load reads (only while it reads it): outputs must change."""
    tier = {**TIER, "sync_load_budget_bytes": 1 << 20}
    ref = multi_turn["recompute"]
    run = run_turns(model_dir, conversations(), connector=tier)
    stats, worker = run.connector_stats, run.worker_stats
    assert stats["sync_loads"] > 0 and stats["sync_load_bytes"] > 0
    # Both kinds ran: the budget left some hits to asynchronous loads.
    assert 0 < worker["sync_loads_issued"] < worker["loads_issued"]
    assert worker["blocks_loaded"] == stats["blocks_loaded"] > 0
    assert worker["failed_loads"] == 0 and stats["failed_transfers"] == 0
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"
    bad = run_turns(model_dir, conversations(), connector=tier,
                    patch=lambda: inject("corrupt_sync_cpu"))
    assert bad.connector_stats["sync_loads"] == stats["sync_loads"]
    assert not same_outputs(ref, bad)


def restore_turns(seed: int = 1) -> list:
    """A (10 prompt blocks) decodes 150 tokens while four fresh prompts fill the 24-block CPU
    tier behind it, evicting A's blocks while A still runs. After A finished and the GPU prefix
    cache was reset, B = A's prompt + 64 tokens looks its prefix up in the CPU tier."""
    rng = random.Random(seed)
    a = [rng.randrange(1, 999) for _ in range(10 * BS)]
    fillers = [[rng.randrange(1, 999) for _ in range(10 * BS)] for _ in range(4)]
    b = a + [rng.randrange(1, 999) for _ in range(64)]
    return [[(a, 150), *[(f, 2) for f in fillers]], "reset_gpu", [(b, 4)]]


@pytest.mark.parametrize("restore, late", [(True, False), (False, False), (True, True)])
def test_restore_through_the_engine(model_dir, restore, late):
    """``late``: every transfer reported late, as on a GPU (``inject("late_reports")``)."""
    turns = restore_turns()
    small = {"cpu_bytes_per_rank": 25 * BLOCK_BYTES,
             "setup": "eager+restore+tail" if restore else "eager+tail"}
    ref = run_turns(model_dir, turns, connector=None)
    run = run_turns(model_dir, turns, connector=small,
                    patch=(lambda: inject("late_reports")) if late else None)
    first, second = run.stats_by_turn
    b_hit = second["cpu_hit_tokens"] - first["cpu_hit_tokens"]
    assert first["running_evictions"] > 0  # A's blocks left the tier while A ran
    if restore:
        assert first["scan_restored"] > 0
        assert b_hit == 10 * BS  # every block of A's prompt
    else:
        assert first["scan_restored"] == 0
        assert b_hit < 10 * BS  # cut at the hole
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"


def test_reset_with_transfers_pending(model_dir):
    """``reset_prefix_cache(reset_connector=True)`` between turns while the finish flush of the
    last step is still queued (every prompt plus 7 computed output tokens ends on a block
    boundary, so each request's last block is left to its flush): the tier drops it, and later
    turns still give the recompute's outputs, with CPU hits of what was stored after the reset.
    Recomputed from scratch, every turn must match: a block the reset should have dropped but
    served later would show.
    (On CPU a worker's copies complete within their step, so a store issued and not yet
    reported cannot be caught between steps here; that case runs in vLLM's real scheduler in
    ``tests/vllm/test_scheduler_side.py::test_reset_with_transfers_in_flight``.)"""
    turns = conversations(seed=2, start=281, turn=96)
    assert all((len(p) + 7) % BS == 0 for batch in turns for p in batch)
    turns = [turns[0], "reset_all", turns[1], "reset_all", *turns[2:]]
    ref = run_turns(model_dir, turns, connector=None)
    run = run_turns(model_dir, turns, connector=TIER)
    # vLLM resets its GPU prefix cache before the connector, while the queued flush still pins
    # the GPU blocks it will copy, so the GPU reset (and so the call) reports False; the
    # connector's own reset then drops the flush and its pins.
    assert run.resets == [(True, False), (True, False)]
    assert run.stats_by_turn[-1]["blocks_loaded"] > run.stats_by_turn[1]["blocks_loaded"]
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"


def test_failed_loads_are_recomputed(model_dir, multi_turn):
    """Every load writes garbage and then fails: the worker reports it failed (never done),
    vLLM (``kv_load_failure_policy="recompute"``) recomputes those blocks, and the outputs are
    the recompute's; the failures are counted on both sides."""
    run = run_turns(model_dir, conversations(), connector=TIER, patch=lambda: inject("fail_loads"))
    # Counted per request on both sides; not one load counted as done.
    assert run.worker_stats["loads_issued"] > 0 and run.worker_stats["failed_loads"] > 0
    assert run.connector_stats["failed_transfers"] == run.worker_stats["failed_loads"]
    assert run.connector_stats["blocks_loaded"] == 0
    ref = multi_turn["recompute"]
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"


def test_multiprocess_engine(model_dir, tmp_path, multi_turn):
    """vLLM's default process layout: the scheduler side in the engine-core process, the worker
    side in a worker process, the metadata and the workers' reports crossing between them
    (pickled). Same outputs as the in-process recompute, on the whole multi-turn workload."""
    import json
    import subprocess
    import sys

    turns = conversations()
    spec = tmp_path / "spec.json"
    out = tmp_path / "out.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "turns": turns,
                                "connector": TIER, "multiprocess": True}))
    import bench

    root = Path(bench.__file__).resolve().parent.parent  # where `-m bench.vllm.engine_run` resolves
    proc = subprocess.run([sys.executable, "-m", "bench.vllm.engine_run", str(spec), str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = EngineRun(**json.loads(out.read_text()))
    ref = multi_turn["recompute"]
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"
    assert "KVTritonConnector worker:" in proc.stderr + proc.stdout  # the worker's start-up line


def test_sliding_window_model(tmp_path_factory):
    """A Mistral whose layers all use a 512-token sliding window: one sliding-window KV cache
    group, whose lookups need the window's blocks and whose stores recover blocks that left the
    window from the GPU prefix cache. (A full-attention plus sliding-window hybrid cannot run on
    vLLM's CPU platform, which turns the hybrid allocator off; it runs in vLLM's scheduler in
    ``tests/vllm/test_scheduler_side.py::test_hybrid_full_and_sliding_window_round_trip``.)"""
    model = tiny_llama(tmp_path_factory.mktemp("tiny-mistral-weights"), sliding_window=512)
    turns = conversations()
    ref = run_turns(model, turns, connector=None)
    run = run_turns(model, turns, connector=TIER)
    assert "sliding_window" in run.layout and "full" not in run.layout
    assert run.connector_stats["blocks_loaded"] >= 50
    assert same_outputs(ref, run), f"max logprob diff {max_logprob_diff(ref, run)}"
