"""Integrity mode (``kvtriton.sim.integrity``): real KV bytes move through the real
``TransferEngine`` during a simulation, and every block is checked.

A CPU hit writes only some positions of a hybrid request's tables: the sliding window before the
hit's end, the Mamba state at its boundary. The positions before get null pages (as in vLLM), so
nothing is registered that no load wrote. Integrity mode checks every block at the moment it is
registered under a key, in the GPU prefix cache and in the CPU tier, besides every load as it
lands, so ``registrations_checked`` accounts for every block computed, loaded or stored. The
cases: random agent workloads, two hybrid configurations whose hits write only some positions,
the shipped coding-agent traces, lazy offload on hybrid models (stores from the GPU free queue,
each named with its block's group), seeded random hybrid configurations, every in-loop reference at
its own size, and negative controls that corrupt or skip one write, or name the wrong group, and
must fail.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtriton.sim.loop as loop_module
from kvtriton.hashing import chain_hashes
from kvtriton.pool import BlockPool
from kvtriton.sim import (
    CC_AGENTIC_SAMPLE,
    Workload,
    WorkloadRequest,
    agent_workload,
    data_path,
    load_trace,
    simulate,
)
from kvtriton.sim.batch_scheduler import BatchScheduler
from kvtriton.sim.errors import IntegrityError
from kvtriton.sim.integrity import IntegrityChecker
from kvtriton.specs import preset


def _limit(wl, n: int):
    """The first ``n`` requests of ``wl`` whose predecessors are kept (as ``--limit``)."""
    from kvtriton.sim.workloads import limit_workload

    return limit_workload(wl, n)


def _check_row(row: dict, n_requests: int) -> None:
    """Every request finished or was rejected; every block loaded was checked as it landed, and
    every block computed, loaded or stored was checked as it was registered under its key."""
    assert row["finished"] + row["rejected"] == n_requests
    assert row["integrity_blocks_checked"] == row["loaded_blocks"]
    assert row["integrity_registrations_checked"] == (
        row["integrity_blocks_filled"] + row["loaded_blocks"] + row["stored_blocks"])


B = 16


def _req(rid: str, prefix: int, prompt: int, output: int = 1, *, after: str | None = None,
         arrival: float = 0.0) -> WorkloadRequest:
    tokens = np.arange(prefix * 10_000, prefix * 10_000 + prompt + output)
    hashes = np.array(chain_hashes(tokens, B), dtype=np.uint64)
    return WorkloadRequest(rid, arrival, prompt, output, hashes, session="s", after=after)


# ---- random workloads, every group of a hybrid model ---------------------------------------------


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 10_000), gpu=st.sampled_from([768, 1024, 2048]),
       cpu=st.sampled_from([256, 1024, 4096]))
def test_integrity_mode_over_random_workloads(seed, gpu, cpu):
    wl = agent_workload(num_conversations=3, min_turns=2, max_turns=4, system_prompt_tokens=128,
                        first_user_tokens=96, user_tokens=48, output_tokens=24, seed=seed)
    res = simulate(wl, gpu_tokens=gpu, cpu_tokens=cpu, integrity=True, bound=False,
                   setups=["eager", "eager+restore+tail"])
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
                   setups=["eager+restore+tail"], bound=False)
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
            simulate(wl, gpu_blocks=6, cpu_blocks=16, setups=["eager+restore+tail"],
                     integrity=True, bound=False)
    finally:
        IntegrityChecker.execute = original


# ---- hybrid configurations where a hit writes only some positions --------------------------------


HYBRID_CASES = {
    # kvtriton simulate --model gemma3-12b --conversations 16 --turns 2 8 --system-prompt 1024
    #   --think-s 2 --seed 317 --gpu-tokens 16384 --cpu-tokens 32768
    #   --setups eager+restore:0.5+tail --token-budget 8192 --max-running 4 --integrity
    "gemma3-12b": (dict(num_conversations=16, min_turns=2, max_turns=8, system_prompt_tokens=1024,
                        think_s_mean=2.0, seed=317),
                   dict(gpu_tokens=16384, cpu_tokens=32768, setups=["eager+restore:0.5+tail"],
                        token_budget=8192, max_running=4)),
    # kvtriton simulate --model nemotron-h-8b --conversations 16 --turns 4 6 --system-prompt 2048
    #   --think-s 8 --seed 614 --gpu-tokens 24576 --cpu-tokens 65536 --setups eager+restore+tail
    #   --max-running 16 --integrity
    "nemotron-h-8b": (dict(num_conversations=16, min_turns=4, max_turns=6,
                           system_prompt_tokens=2048, think_s_mean=8.0, seed=614),
                      dict(gpu_tokens=24576, cpu_tokens=65536, setups=["eager+restore+tail"],
                           max_running=16)),
}


def _real_blocks(*args, **kwargs) -> BatchScheduler:
    """The serving loop's scheduler with a real block at every position a hit covers (no null
    pages)."""
    kwargs["null_out_of_window"] = False
    return BatchScheduler(*args, **kwargs)


@pytest.mark.parametrize("model", list(HYBRID_CASES))
def test_hybrid_configurations_pass_with_registration_checks(model):
    wl_args, sim_args = HYBRID_CASES[model]
    wl = agent_workload(**wl_args)
    row = simulate(wl, model=model, integrity=True, bound=False, **sim_args).rows[0]
    _check_row(row, len(wl))
    assert row["cpu_hit_tokens"] > 0 and row["loaded_blocks"] > 0
    assert (row["handoff_stored"] > 0) == (model == "nemotron-h-8b")


@pytest.mark.parametrize("model", list(HYBRID_CASES))
def test_real_blocks_where_a_hit_writes_nothing_fail_at_registration(model, monkeypatch):
    # Negative control: an allocation that gives a real block to every position a CPU hit
    # covers registers blocks no load wrote; the first one registered stops the run.
    monkeypatch.setattr(loop_module, "BatchScheduler", _real_blocks)
    wl_args, sim_args = HYBRID_CASES[model]
    with pytest.raises(IntegrityError, match=r"step \d+: GPU block \d+ registered under key \d+, "
                                             r"but no computation, load or store wrote it"):
        simulate(agent_workload(**wl_args), model=model, integrity=True, bound=False,
                 **sim_args)


@pytest.mark.parametrize("model", ["gemma3-12b", "nemotron-h-8b"])
def test_shipped_coding_agent_traces_on_hybrid_models(model):
    # The sample's first 16 requests (the first turns of its sessions and what follows them),
    # 64-token hash blocks; the GPU is too small for a few of them, which are rejected.
    wl = _limit(load_trace(data_path(CC_AGENTIC_SAMPLE), hash_block_size=64), 16)
    row = simulate(wl, model=model, gpu_tokens=98_304, cpu_tokens=262_144, integrity=True,
                   bound=False, setups=["eager+restore:0.5+tail"]).rows[0]
    _check_row(row, len(wl))
    assert row["cpu_hit_tokens"] > 0 and row["rejected"] > 0


# ---- lazy offload on hybrid models ---------------------------------------------------------------


# Smaller runs of the hybrid configurations: turns that come back after their prefix left the GPU.
LAZY_CASES = {
    "gemma3-12b": (dict(num_conversations=8, min_turns=2, max_turns=4, system_prompt_tokens=1024,
                        think_s_mean=2.0, seed=317),
                   dict(gpu_tokens=16384, cpu_tokens=32768, token_budget=8192, max_running=4)),
    "nemotron-h-8b": (dict(num_conversations=8, min_turns=3, max_turns=4,
                           system_prompt_tokens=2048, think_s_mean=8.0, seed=614),
                      dict(gpu_tokens=24576, cpu_tokens=65536, max_running=16)),
}


def _simulate_lazy(model: str):
    wl_args, sim_args = LAZY_CASES[model]
    wl = agent_workload(**wl_args)
    return wl, simulate(wl, model=model, integrity=True, bound=False, setups=["lazy"],
                        **sim_args).rows[0]


@pytest.mark.parametrize("model", list(LAZY_CASES))
def test_lazy_offload_on_hybrid_models_serves_hits_of_every_group(model, monkeypatch):
    """Lazy mode (the free-queue walk) on full attention + sliding window and on full attention
    + Mamba: its stores name each block's group, so every CPU block registered holds its key's
    bytes in its key's group, and the hits load blocks of every group, checked as they land."""
    load_groups: set[int] = set()
    real = IntegrityChecker.execute

    def execute(self, meta):
        load_groups.update(meta.load.groups)
        real(self, meta)

    monkeypatch.setattr(IntegrityChecker, "execute", execute)
    wl, row = _simulate_lazy(model)
    _check_row(row, len(wl))
    assert row["cpu_hit_tokens"] > 0 and row["stored_blocks"] > 0
    assert row["handoff_stored"] == 0  # Mamba states too come from the free queue
    assert load_groups == set(range(preset(model).num_groups))


def test_lazy_stores_with_the_wrong_group_fail_at_registration(monkeypatch):
    """Negative control: a GPU pool that names group 0 for every block makes a window page's
    store read the full-attention tensors; the CPU block is registered as group 0 under a key
    computed in group 1, and the run stops there."""
    monkeypatch.setattr(BlockPool, "block_group",
                        lambda self, b: None if self.block_hash(b) is None else 0)
    with pytest.raises(IntegrityError, match=r"CPU block \d+ registered under key \d+ as group 0, "
                                             r"but the key was computed in group 1"):
        _simulate_lazy("gemma3-12b")


# ---- random hybrid configurations ----------------------------------------------------------------


_MODELS = ("gemma3-12b", "nemotron-h-8b")
_SETUPS = ("eager", "restore", "eager+restore+tail", "eager+restore:0.5+tail",
             "eager+restore:0.5+tail+arc", "eager+restore:0.5+tail+s3fifo")


def _random_config(seed: int) -> tuple[dict, dict]:
    """A small hybrid run: workload and simulate() arguments, drawn from ``seed``. Requests stay
    under half the GPU, so none is rejected; copies alternate between the torch and copy-engine
    backends."""
    rng = np.random.default_rng(1000 + seed)
    gpu = int(rng.choice([6144, 8192]))
    wl = dict(num_conversations=int(rng.integers(10, 15)), min_turns=3,
              max_turns=int(rng.integers(4, 7)), system_prompt_tokens=int(rng.choice([512, 1024])),
              first_user_tokens=int(rng.choice([512, 1024])),
              user_tokens=int(rng.choice([128, 256])), output_tokens=int(rng.choice([32, 128])),
              think_s_mean=float(rng.choice([1.0, 4.0])), max_context_tokens=gpu // 2 - 256,
              seed=seed)
    sim = dict(model=_MODELS[seed % 2], gpu_tokens=gpu,
               cpu_tokens=int(rng.choice([8192, 16384, 65536])),
               setups=[str(rng.choice(_SETUPS))],
               token_budget=int(rng.choice([512, 2048, 8192])),
               max_running=int(rng.choice([2, 4, 16])),
               integrity_backend=("torch", "copy_engine")[seed // 2 % 2])
    return wl, sim


RANDOM_SEEDS = list(range(10))


@cache
def _random_run(seed: int) -> tuple[dict, int]:
    """The row of random configuration ``seed`` in integrity mode, and its request count."""
    wl_args, sim_args = _random_config(seed)
    wl = agent_workload(**wl_args)
    return simulate(wl, integrity=True, bound=False, **sim_args).rows[0], len(wl)


@pytest.mark.parametrize("seed", RANDOM_SEEDS, ids=[f"seed{s}" for s in RANDOM_SEEDS])
def test_random_hybrid_configurations(seed):
    row, n = _random_run(seed)
    _check_row(row, n)
    assert row["rejected"] == 0


def test_random_configurations_cover_both_models_backends_and_the_cpu_tier():
    draws = [_random_config(s)[1] for s in RANDOM_SEEDS]
    assert {sim["model"] for sim in draws} == set(_MODELS)
    assert {sim["integrity_backend"] for sim in draws} == {"torch", "copy_engine"}
    rows = [_random_run(s)[0] for s in RANDOM_SEEDS]  # cached: the runs above
    assert sum(r["cpu_hit_tokens"] > 0 for r in rows) >= 8
    assert sum(r["handoff_stored"] > 0 and r["cpu_hit_tokens"] > 0 for r in rows) >= 4


# ---- every in-loop reference at its own size -------------------------------------------------


@pytest.mark.parametrize("setups", [["eager"], ["eager+inf"]])
def test_integrity_checks_every_in_loop_bound_at_its_own_size(setups):
    # The unbounded bound's tier holds every key, more than the sized tier: each run's checker
    # is sized for that run's own tier, not for the chosen one.
    wl = agent_workload(num_conversations=6, min_turns=2, max_turns=4, system_prompt_tokens=512,
                        seed=0)
    res = simulate(wl, gpu_tokens=16_384, cpu_tokens=16_384, setups=setups, integrity=True)
    inf = next(r for r in res.rows + res.bounds if r["composition"] == "eager+inf")
    assert inf["cpu_blocks"] > res.conditions["cpu_blocks"]
    assert all(r["integrity_registrations_checked"] > 0 for r in res.rows + res.bounds)


# ---- negative controls: one write wrong or missing must fail -------------------------------------


_SMALL = (dict(num_conversations=12, min_turns=3, max_turns=4, system_prompt_tokens=512,
               first_user_tokens=512, user_tokens=128, output_tokens=32, think_s_mean=1.0,
               max_context_tokens=2816, seed=2),
          dict(model="gemma3-12b", gpu_tokens=6144, cpu_tokens=16384,
               setups=["eager+restore+tail"],
               token_budget=2048, max_running=4))


def _run_small() -> dict:
    wl_args, sim_args = _SMALL
    return simulate(agent_workload(**wl_args), integrity=True, bound=False, **sim_args).rows[0]


def test_negative_controls_pass_unchanged():
    row = _run_small()
    assert row["cpu_hit_tokens"] > 0 and row["stored_blocks"] > 0


def _once(original, corrupt):
    """``original`` with ``corrupt`` applied to its first call only."""
    done = [False]

    def wrapped(self, *args):
        if done[0]:
            return original(self, *args)
        done[0] = True
        return corrupt(self, *args)

    return wrapped


def test_a_fill_with_the_wrong_key_fails(monkeypatch):
    fill = IntegrityChecker.fill
    monkeypatch.setattr(IntegrityChecker, "fill", _once(
        fill, lambda self, g, b, key: fill(self, g, b, key + 1)))
    with pytest.raises(IntegrityError, match=r"GPU block \d+ registered under key (\d+), but the "
                                             r"last write into it was for key \d+"):
        _run_small()


def test_wrong_bytes_under_the_right_key_fail(monkeypatch):
    fill = IntegrityChecker.fill

    def flipped(self, g, b, key):
        fill(self, g, b, key)
        view, _ = self.engine.segments[g][0]
        view[b, 0] ^= 0xFF

    monkeypatch.setattr(IntegrityChecker, "fill", _once(fill, flipped))
    with pytest.raises(IntegrityError, match=r"GPU block \d+ registered under key \d+ \(group 0, "
                                             r"segment 0\) does not hold its bytes"):
        _run_small()


def test_a_block_registered_without_a_fill_fails(monkeypatch):
    monkeypatch.setattr(IntegrityChecker, "fill", _once(IntegrityChecker.fill,
                                                        lambda self, g, b, key: None))
    with pytest.raises(IntegrityError, match=r"GPU block \d+ registered under key \d+, but no "
                                             r"computation, load or store wrote it"):
        _run_small()


def _on_first_store(monkeypatch, before, after) -> None:
    """Run ``before(checker, meta)`` and ``after(checker, meta)`` around the copies of the first
    step that stores."""
    execute = IntegrityChecker.execute
    done = [False]

    def wrapped(self, meta):
        first = not done[0] and len(meta.store) > 0
        if first:
            done[0] = True
            before(self, meta)
        execute(self, meta)
        if first:
            after(self, meta)

    monkeypatch.setattr(IntegrityChecker, "execute", wrapped)


def _nothing(checker, meta) -> None:
    pass


def test_a_store_that_corrupts_its_cpu_block_fails_at_registration(monkeypatch):
    def corrupt(checker, meta):
        checker.engine.cpu_pool[meta.store.cpu_blocks[0], 0] ^= 0xFF

    _on_first_store(monkeypatch, _nothing, corrupt)
    with pytest.raises(IntegrityError, match=r"CPU block \d+ registered under key \d+ \(group \d, "
                                             r"segment 0\) does not hold its bytes"):
        _run_small()


def test_a_store_from_an_unregistered_gpu_block_fails(monkeypatch):
    # The store copies a GPU block whose key the checker never confirmed: its CPU copy cannot
    # be registered under any key.
    def forget(checker, meta):
        checker._gpu.holds[meta.store.gpu_blocks[0]] = -1

    _on_first_store(monkeypatch, forget, _nothing)
    with pytest.raises(IntegrityError, match=r"CPU block \d+ registered under key \d+, but no "
                                             r"computation, load or store wrote it"):
        _run_small()


def test_key_patterns_differ_by_key_segment_and_offset():
    # The bytes a block must hold depend on its key, its segment and each 8-byte position: a
    # copy from another key, another segment or a shifted offset cannot pass for the right one.
    from kvtriton.sim.integrity import _pattern

    p = _pattern(7, 0, 1024)
    assert len(p) == 1024 and len(_pattern(7, 0, 20)) == 20
    assert p != _pattern(8, 0, 1024) and p != _pattern(7, 1, 1024)
    for shift in (1, 8, 64):
        assert p[shift:] != p[:-shift]
