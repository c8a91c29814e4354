"""The same-step load study (``bench/tier_study/sync_loads.py``) on a tiny workload: the budget is
chosen by the train part's TTFT only, and reported on the test part beside budget 0."""

from __future__ import annotations

import pytest

from bench.tier_study import sync_loads
from kvtriton.sim import agent_workload, without_closes


def test_the_budget_is_chosen_on_train_and_reported_on_test(monkeypatch, tmp_path):
    wl = without_closes(agent_workload(num_conversations=6, min_turns=3, max_turns=5, seed=4))
    monkeypatch.setattr(sync_loads, "workloads", lambda quick: {"agent": (wl, 4096, None)})
    doc = sync_loads.main(["--workloads", "agent", "--quiet", "--json",
                           str(tmp_path / "s.json")])
    (cell,) = doc["cells"]
    grid = {g["budget_bytes"]: g for g in cell["grid"]}
    assert sorted(grid) == [b["budget_bytes"] for b in doc["budgets"]] and 0 in grid
    assert grid[0]["sync_loads"] == 0
    fair = [g for g in cell["grid"] if g["ttft_ok_train"]]
    best = min(g["train"]["ttft_p50_s"] for g in fair)
    chosen = grid[cell["chosen_budget_bytes"]]
    assert chosen["ttft_ok_train"] and chosen["train"]["ttft_p50_s"] == best
    assert cell["test_chosen"] == chosen["test"] and cell["test_budget_0"] == grid[0]["test"]
    assert cell["test_ttft_p50_change_s"] == pytest.approx(
        chosen["test"]["ttft_p50_s"] - grid[0]["test"]["ttft_p50_s"])
    assert doc["overall"]["budget_bytes"] in grid
    assert (tmp_path / "s.json").exists()


def test_bad_workload_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        sync_loads.main(["--workloads", "nope"])
    assert e.value.code == 2
    assert "unknown 'nope'" in capsys.readouterr().err
