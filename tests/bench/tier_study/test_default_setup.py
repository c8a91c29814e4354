"""The rule that picks the connector's default setup (``bench/tier_study/default_setup.py``)."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.common import RESULTS_DIR
from bench.tier_study import default_setup
from bench.tier_study.default_setup import candidate, cells, choose
from kvtriton.setups import DEFAULT_SETUP


def _cell(workload: str, gains: dict[str, float]) -> dict:
    return {"file": f"setups_{workload}.json", "workload": workload, "cpu_ratio": 1,
            "gain_points": {"eager": 0.0, **gains}}


def test_only_setups_needing_nothing_from_client_or_scheduler_are_candidates():
    assert candidate("eager+arc") and candidate("lazy") and candidate("eager+restore:0.5")
    for name in ("eager+hints", "lazy+hints", "lazy+hinted", "eager+waiting", "eager+nextuse",
                 "eager+inf", "none"):
        assert not candidate(name), name


def test_the_best_worst_case_wins_and_the_mean_breaks_ties():
    ev = [_cell("a", {"eager+arc": 1.0, "lazy": 9.0, "eager+tail": 0.5}),
          _cell("a", {"eager+arc": 0.2, "lazy": -2.0, "eager+tail": 0.2}),
          _cell("b", {"eager+arc": 0.3, "lazy": 5.0, "eager+tail": 0.2}),
          _cell("b", {"eager+arc": 0.2, "lazy": 1.0, "eager+tail": 0.4})]
    got = choose(ev)
    assert got["setup"] == "eager+arc"  # worst 0.2 as eager+tail, mean higher
    assert [r["setup"] for r in got["table"]][:3] == ["eager+arc", "eager+tail", "eager"]
    ev[1]["gain_points"]["eager+arc"] = -0.1  # one loss anywhere and the control is safer
    assert choose(ev)["setup"] == "eager+tail"


def test_a_setup_not_measured_on_every_workload_is_not_eligible():
    """The first rule asked for two workloads of evidence and chose a setup that lost on the
    others when measured there: every workload is asked for."""
    ev = [_cell(w, {"eager+arc": 1.0, "eager+tail": 0.1}) for w in ("a", "a", "b", "b")]
    ev += [_cell("c", {"eager+tail": 0.1}), _cell("c", {"eager+tail": 0.2})]
    got = choose(ev)
    assert got["setup"] == "eager+tail" and got["workloads"] == ["a", "b", "c"]
    assert not next(r for r in got["table"] if r["setup"] == "eager+arc")["eligible"]


def test_too_little_evidence_is_not_eligible():
    ev = [_cell("a", {"eager+arc": 5.0}), _cell("a", {"eager+arc": 5.0})]
    with pytest.raises(ValueError, match="no candidate was measured in 4 cells covering every"):
        choose(ev)
    ev += [_cell("b", {}), _cell("b", {})]
    got = choose(ev)
    assert got["setup"] == "eager"
    assert not next(r for r in got["table"] if r["setup"] == "eager+arc")["eligible"]


def test_cells_read_the_setup_json(tmp_path):
    rows = [{"composition": "eager", "token_hit_rate": 0.5},
            {"composition": "eager+arc", "token_hit_rate": 0.52}]
    doc = {"workload": "agent (quick)", "runs": [{"cpu_ratio": 4, "rows": rows}]}
    (tmp_path / "setups_agent.json").write_text(json.dumps(doc))
    got = cells(tmp_path)
    assert len(got) == 1 and got[0]["gain_points"]["eager+arc"] == pytest.approx(2.0)
    doc["runs"][0]["rows"] = rows[1:]
    (tmp_path / "setups_agent.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="has no 'eager' row"):
        cells(tmp_path)


def test_the_rule_reads_the_train_part_and_reports_the_test_part(tmp_path):
    def row(comp, whole, train, test):
        return {"composition": comp, "token_hit_rate": whole,
                "parts": {"train": {"token_hit_rate": train}, "test": {"token_hit_rate": test}}}

    for w in ("agent", "mooncake"):
        rows = [row("eager", 0.5, 0.5, 0.5), row("eager+arc", 0.6, 0.49, 0.6),
                row("eager+tail", 0.5, 0.51, 0.48)]
        doc = {"workload": w, "runs": [{"cpu_ratio": r, "rows": rows} for r in (1, 4)]}
        (tmp_path / f"setups_{w}.json").write_text(json.dumps(doc))
    legacy = {"workload": "cc_agentic", "runs": [{"cpu_ratio": 1, "rows": [
        {"composition": "eager", "token_hit_rate": 0.5}]}]}
    (tmp_path / "setups_cc_agentic_full.json").write_text(json.dumps(legacy))
    # On the whole run eager+arc gains 10 points; on the train part it loses: not chosen.
    assert choose(cells(tmp_path, "train"))["setup"] == "eager+tail"
    got = default_setup.choose_on_train(tmp_path)
    assert got["setup"] == "eager+tail" and got["skipped"] == ["setups_cc_agentic_full.json"]
    test = {t["setup"]: t for t in got["test"]}
    assert test["eager+tail"]["worst_points"] == pytest.approx(-2.0)
    assert test["eager+arc"]["mean_points"] == pytest.approx(10.0)
    assert [t["setup"] for t in got["test"]] == [r["setup"] for r in got["table"]]


def test_the_committed_results_choose_the_default(capsys, tmp_path):
    """What ``paper/build.py`` checks: the shipped results still pick ``DEFAULT_SETUP``, on
    their train parts, and the study writes that choice where the paper reads it."""
    assert default_setup.choose_on_train()["setup"] == DEFAULT_SETUP
    for name in default_setup.SETUP_FILES:
        if (RESULTS_DIR / name).exists():
            shutil.copy(RESULTS_DIR / name, tmp_path / name)
    assert default_setup.main(["--results-dir", str(tmp_path)]) == 0
    assert f"chosen {DEFAULT_SETUP!r}" in capsys.readouterr().out
    written = json.loads((tmp_path / "default_setup.json").read_text())
    assert written["setup"] == written["connector_default"] == DEFAULT_SETUP and written["agrees"]
    committed = json.loads((RESULTS_DIR / "default_setup.json").read_text())
    assert committed["setup"] == DEFAULT_SETUP
