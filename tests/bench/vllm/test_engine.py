"""``bench/vllm/engine.py`` at the tests' size on vLLM's CPU backend: every system serves every
request, the connector's systems use the tier, the step-time fit and the simulator's prediction
land in the JSON beside the measurement; bad arguments are one line with exit code 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from bench.vllm import engine, engine_prediction
from kvtriton.setups import DEFAULT_SETUP


def test_smoke_run_measures_and_predicts(tmp_path):
    systems = "none,default"
    assert engine.main(["--smoke", "--workloads", "agent", "--systems", systems,
                            "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "vllm_engine.json").read_text())
    run = doc["runs"]["agent"]
    rows = {r["system"]: r for r in run["measured"]}
    assert list(rows) == systems.split(",")
    for r in rows.values():
        assert r["requests"] == run["requests"] > 0 and r["ttft_p50_s"] > 0
        assert 0 < r["token_hit_rate"] < 1 and r["output_tokens"] > 0
    assert rows["none"]["stored_blocks"] == 0 and rows["none"]["cpu_blocks"] == 0
    assert rows["default"]["stored_blocks"] > 0 and rows["default"]["cpu_blocks"] > 0
    assert rows["default"]["setup"] == doc["conditions"]["default_setup"] == DEFAULT_SETUP
    fit = run["cost_fit"]
    # The fit keeps its terms non-negative: under a loaded CI run (other engines beside it on 2
    # cores) it once zeroed the prefill term of this smoke run's few steps (CI at 02759f1); the
    # quiet benchmark run is where the fit's figures are read.
    assert fit["kind"] == "measured" and fit["samples"] > 10 and fit["prefill_s_per_token"] >= 0
    assert set(run["predicted"]) == set(rows) and len(run["rows"]) == 2
    assert set(run["targets"]) == {"hit_rate_within_1_point", "ttft_p50_same_order",
                                   "ttft_p50_within_20pct"}
    assert "machine" in doc and doc["conditions"]["backend"] == "cpu"


@pytest.mark.parametrize("argv", [["--systems", "none,nope"], ["--workloads", "x"],
                                  ["--model", "/no/such/folder"], ["--systems", "eager+bogus"]])
def test_bad_arguments_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        engine.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err


def test_repeats_combine_into_a_mean_with_the_engines_range():
    reps = [{"system": "eager", "token_hit_rate": h, "cpu_hit_tokens": c, "ttft_p50_s": t,
             "ttft_p90_s": 2 * t, "ttft_mean_s": t, "output_tokens_per_s": 10.0,
             "stored_blocks": 4, "loaded_blocks": 1, "_steps": [([(5, 0, 5)], t)]}
            for h, c, t in ((0.4, 100, 0.2), (0.5, 300, 0.4))]
    row = engine_prediction.combine_repeats(reps)
    assert row["token_hit_rate"] == pytest.approx(0.45) and row["cpu_hit_tokens"] == 200
    assert row["token_hit_rate_range"] == [0.4, 0.5] and row["ttft_p50_s_range"] == [0.2, 0.4]
    assert row["repeats"] == 2 and len(row["_steps"]) == 2
    assert engine_prediction.combine_repeats(reps[:1]) is reps[0]
