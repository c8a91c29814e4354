"""Bounded memory through the connector: key ids recycled in vLLM's real scheduler.

A soak (``bench.conformance.connector_soak_run``) makes over ten times more distinct blocks than the
GPU and CPU pools hold together. With recycling the connector's key ids and the planner's per-key
slots stay flat; the control (recycling off) shows they would grow with every distinct block.
Recycling changes ids only: the hashes stored and loaded step by step are those of the control run,
and a recycler that misses a holder of ids (the GPU prefix cache) is caught by that comparison.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.conformance.connector_soak_run import ConnectorSoak

GPU, CPU = 64, 128
REQUESTS = 700  # about 4,800 distinct blocks: 25x the pools, past the planner's first 4,096 slots


def soak(model_config_dir, **kw) -> ConnectorSoak:
    return ConnectorSoak(model_config_dir, gpu_blocks=GPU, cpu_blocks=CPU, **kw)


@pytest.fixture(scope="module")
def runs(model_config_dir):
    out = {}
    for recycle in (True, False):
        s = soak(model_config_dir, recycle=recycle, record=True)
        out[recycle] = (s, s.run(REQUESTS, sample_every=100, check_every=25))
    return out


def test_ids_and_planner_slots_stay_flat_with_recycling(runs):
    s, samples = runs[True]
    last = samples[-1]
    assert last.distinct_blocks >= 10 * (GPU + CPU)
    # Live ids: at most what both pools and the running requests hold, twice over (a sweep
    # runs when the bound ids doubled since the last one).
    running = s.concurrency * (s.prompt_blocks + s.output_tokens // s.block_size)
    bound = 2 * (2 * (GPU + CPU) + running)
    assert max(x.key_ids_bound for x in samples) <= bound
    assert max(x.key_id_capacity for x in samples) <= bound
    # Flat: while the distinct blocks seen grow threefold after warm-up, the capacity moves only
    # as far as a new peak of ids alive at once, and the planner's slots not at all.
    warm = samples[1]
    assert last.distinct_blocks >= 3 * warm.distinct_blocks
    assert last.key_id_capacity <= 1.05 * warm.key_id_capacity
    assert last.planner_key_slots == warm.planner_key_slots
    assert last.recycled > last.distinct_blocks // 2 and last.sweeps >= 5
    s.side.planner.check_invariants(idle=True)
    assert s.side.keys.num_reserved() == 0


def test_without_recycling_ids_grow_with_every_distinct_block(runs):
    s, samples = runs[False]
    last = samples[-1]
    assert last.sweeps == 0 and last.recycled == 0
    assert last.key_ids_bound >= last.distinct_blocks - s.concurrency
    assert last.key_id_capacity > 10 * (GPU + CPU)
    assert last.planner_key_slots > samples[0].planner_key_slots


def test_recycling_changes_ids_only(runs):
    on, off = runs[True][0].recorder.steps, runs[False][0].recorder.steps
    assert len(on) == len(off)
    assert sum(len(st) for st, _ in on) > 0 and sum(len(ld) for _, ld in on) > 0
    assert on == off


def test_a_recycler_that_misses_the_cpu_tier_is_caught(model_config_dir, runs, monkeypatch):
    """Negative control: a sweep that forgets the CPU tier holds ids recycles them while CPU
    blocks are cached under them, so a new hash given such an id looks cached: the hashes
    moved part from the control run's (or the planner's books break)."""
    broken = soak(model_config_dir, recycle=True, record=True)
    monkeypatch.setattr(broken.side.cpu_pool, "referenced_keys", lambda: [])
    try:
        broken.run(REQUESTS, sample_every=REQUESTS, check_every=5)
    except (AssertionError, ValueError, KeyError):
        return  # the invariant checks (or the planner's own checks) caught it
    assert broken.recorder.steps != runs[False][0].recorder.steps


def test_sweeping_every_step_changes_nothing(model_config_dir, runs, monkeypatch):
    """A sweep after every step, with requests waiting on a looked-up CPU hit, loads and
    stores in flight, and re-stores queued: the same hashes move as in the control run."""
    s = soak(model_config_dir, recycle=True, record=True)
    side = s.side
    build = side.build_connector_meta

    def build_and_sweep(so):
        meta = build(so)
        side.recycle_keys()
        return meta

    monkeypatch.setattr(side, "build_connector_meta", build_and_sweep)
    s.run(REQUESTS, sample_every=REQUESTS, check_every=5)
    assert s.recorder.steps == runs[False][0].recorder.steps
    assert side.sweeps >= len(s.recorder.steps) - 1
    # Idle and swept: only the ids of blocks cached in a pool (or ghost-listed) are left.
    side.recycle_keys()
    cached = set(side.cpu_pool.referenced_keys()) | set(side.gpu_pool.referenced_keys())
    assert side.keys.num_bound == len(cached)
