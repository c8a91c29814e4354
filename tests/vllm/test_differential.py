"""kvtriton's scheduler side against vLLM's own ``SimpleCPUOffloadScheduler``, step for step
(``bench.differential``: the connector that feeds both, the schedules, the recognised
differences and their evidence), and the negative control: known bug classes, each applied by
monkeypatch, must each be caught within the seeds CI runs.

``KVTRITON_DIFF_SEEDS`` sets the seed count (CI: ``SEEDS``); ``python -m bench.differential``
runs thousands and records the outcome counts.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.differential import MUTATIONS, first_caught, run_seed, summarise
from kvtriton.sim.vllm_scheduler import tiny_model_dir

SEEDS = int(os.environ.get("KVTRITON_DIFF_SEEDS", "100"))
#: Each mutation must be caught within this many seeds.
MUTATION_SEEDS = 60


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), 8192)


def test_same_blocks_as_vllms_manager_on_random_schedules(model_dir):
    records = [run_seed(model_dir, seed) for seed in range(SEEDS)]
    out = summarise(records)
    t = out["totals"]
    print(f"\n{SEEDS} seeds: {out['outcomes']}, recognised {out['differences_by_class']}; "
          f"{t['steps_compared']} steps compared in step, {t['steps_apart']} apart "
          f"({out['seeds_resynced']} seeds back in step, {out['seeds_apart_at_end']} apart at "
          f"the end); loads in {out['seeds_with_loads']} seeds; {t['lookups']} lookups, "
          f"{t['stores']} stores, {t['loads']} loads; {t['gaps_opened']} cursor gaps")
    assert not out["unrecognised"], "\n".join(out["unrecognised"][:10])
    # The schedules must exercise what they are meant to: loads in most seeds, CPU evictions
    # during allocation, and comparison past the recognised differences.
    assert out["seeds_with_loads"] > SEEDS // 2
    assert t["exhausted_steps"] > 0 and t["steps_apart"] > 0


def test_the_known_difference_after_a_cursor_gap_is_recognised(model_dir):
    # Seed 1341: a cursor gap opens (kvtriton passed positions as cached that the step's
    # allocation evicted), then the request is aborted and the two finish flushes start from
    # different cursors.
    rec = run_seed(model_dir, 1341)
    assert not rec.unknown, rec.unknown
    assert rec.differences["per_request_allocation"] >= 1


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_known_bug_is_caught(model_dir, mutation):
    caught = first_caught(model_dir, mutation, MUTATION_SEEDS)
    assert caught is not None, f"{mutation} passed {MUTATION_SEEDS} seeds"
    print(f"\n{mutation}: caught at seed {caught[0]}: {caught[1]}")
