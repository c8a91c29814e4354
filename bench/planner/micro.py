"""Micro-benchmarks of the hot paths, written for pytest-benchmark (its ``benchmark`` fixture does
the warm-up, rounds and statistics): ``python -m bench.planner.micro`` (the harness's ``micro``
study) runs them into ``bench/results/micro.json``; extra arguments go to pytest.

They time and do not check, so they are not part of the test suite: the file name keeps them out
of ``tests/`` collection, and pytest collects a file named on its command line whatever its name.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.planner.scenarios import VARIANTS, Scenario
from kvtriton.engine import TransferEngine
from kvtriton.engine.descriptors import allocate_kv_caches
from kvtriton.hashing import chain_hashes
from kvtriton.lookup import find_longest_hit
from kvtriton.planner import PlannerMeta, Transfer
from kvtriton.pool import BlockPool
from kvtriton.specs import preset


@pytest.mark.parametrize("variant", ["fused_restore", "loop_restore", "loop_control"])
def test_select_128x2048_steady(benchmark, variant):
    """One selection pass at 128 running requests x 2,048 stored blocks in the steady state
    (one new block per request, nothing evicted since the last pass; ``bench_planner`` times the
    passes that follow evictions)."""
    sc = Scenario(VARIANTS[variant], 128, 2048, steps=40, evict_fraction=0.01, seed=0)
    sc.step()
    sel = sc.planner.selector
    rows = list(range(128))
    ready = np.full((128, 1), 2049, dtype=np.int64)

    def one_pass():
        # A budget of 0 selects nothing, so every round sees the same state and classifies the
        # same candidates (the part of the pass whose cost depends on the selector).
        return sel.select(rows, ready, 0, None)

    benchmark.pedantic(one_pass, rounds=20, warmup_rounds=2)


def test_pool_allocate_and_free_4096(benchmark):
    pool = BlockPool(65_536)

    def cycle():
        blocks = pool.get_new_blocks(4096)
        pool.free_blocks(blocks[::-1])

    benchmark(cycle)


def test_lookup_2500_blocks(benchmark):
    layout = preset("llama3-8b")
    pool = BlockPool(4096)
    keys = list(range(1, 2501))
    for k, b in zip(keys, pool.get_new_blocks(2500), strict=True):
        pool.cache_block(b, k)
    benchmark(find_longest_hit, layout, pool, [keys], 2500 * 16)


def test_chain_hashes_32k_tokens(benchmark):
    tokens = np.arange(32_768)
    benchmark(chain_hashes, tokens, 16)


@pytest.mark.parametrize("backend", ["torch"])
def test_engine_store_64_blocks(benchmark, backend):
    """A 64-block store of a Llama-3-8B-shaped group with 4 layers (CPU tensors)."""
    import dataclasses

    base = preset("llama3-8b")
    layout = type(base)([dataclasses.replace(base.groups[0], num_layers=4)], 16)
    kv = allocate_kv_caches(layout, 128)
    engine = TransferEngine(layout, kv, 128, backend=backend)
    meta = PlannerMeta(Transfer(0, list(range(1, 65)), list(range(64)), [0] * 64), Transfer(), {})
    torch.manual_seed(0)

    def store():
        engine.execute(meta)
        engine.poll()

    benchmark(store)


def main(argv: list[str] | None = None) -> int:
    """Run this file's benchmarks under pytest into ``micro.json`` in the results folder."""
    from bench import common

    out = common.RESULTS_DIR / "micro.json"
    rc = pytest.main([str(Path(__file__)), "-q", "-p", "no:cacheprovider",
                      f"--benchmark-json={out}", "--benchmark-columns=min,median,max,rounds",
                      *(argv or [])])
    if rc != 0:
        raise SystemExit(f"micro-benchmarks failed (pytest exit code {rc})")
    common.record_output(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
