"""The share-tuning study (``bench/tier_study/tune_shares.py``) on a tiny workload: the share is
chosen by the train part's figures only, and reported on the test part."""

from __future__ import annotations

import pytest

from bench.tier_study import tune_shares
from kvtriton.sim import agent_workload, without_closes


def test_the_share_is_chosen_on_train_and_reported_on_test(monkeypatch, tmp_path):
    wl = without_closes(agent_workload(num_conversations=6, min_turns=2, max_turns=4, seed=2))
    monkeypatch.setattr(tune_shares, "workloads", lambda quick: {"agent": (wl, 4096, None)})
    monkeypatch.setitem(tune_shares.TUNED, "agent", ("lazy+hints",))
    doc = tune_shares.main(["--workloads", "agent", "--quiet", "--json",
                            str(tmp_path / "t.json")])
    (res,) = doc["workloads"]["agent"]["setups"]
    grid = {g["share"]: g for g in res["grid"]}
    assert sorted(grid) == list(tune_shares.SHARES)
    fair = [g for g in res["grid"] if g["ttft_ok_train"]] or res["grid"]
    assert grid[res["chosen_share"]]["train_points"] == max(g["train_points"] for g in fair)
    assert res["chosen_test_points"] == grid[res["chosen_share"]]["test_points"]
    assert res["tuning_gain_test_points"] == pytest.approx(
        res["chosen_test_points"] - grid[0.5]["test_points"])
    assert (tmp_path / "t.json").exists()


def test_bad_workload_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        tune_shares.main(["--workloads", "nope"])
    assert e.value.code == 2
    assert "unknown 'nope'" in capsys.readouterr().err
