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
    # Out of sample: the tier predicted on a clock fitted to the `none` runs alone, judged on
    # the tier's rows only (the runs it was not fitted to).
    oos = run["out_of_sample"]["fit_on_none"]
    assert oos["fitted_on"] == ["none"] and [r["system"] for r in oos["rows"]] == ["default"]
    assert oos["cost_fit"]["samples"] < fit["samples"]  # the none runs' steps alone
    assert doc["findings"]["runs"]["agent"]["out_of_sample"]["fit_on_none"]["systems"] == \
        ["default"]


def test_out_of_sample_fits_on_other_runs_than_it_judges(monkeypatch):
    """Each out-of-sample clock is fitted to the runs it names and to no run it judges; a fit
    with too few steps is skipped with its reason, not fitted to noise."""
    from types import SimpleNamespace

    fitted = []
    monkeypatch.setattr(engine, "predict", lambda wl, systems, cost, **kw: {
        s: {"token_hit_rate": 0.5, "ttft_p50_s": 1.0} for s in systems})

    def row(system, steps):
        return {"system": system, "token_hit_rate": 0.5, "ttft_p50_s": 1.1,
                "_steps": [([(1, 0, 1)], 0.1)] * steps}

    a = {"name": "a", "wl": None, "sizes": {}, "measured": [row("none", 40), row("eager", 40)]}
    b = {"name": "b", "wl": None, "sizes": {}, "measured": [row("none", 10), row("eager", 10)]}
    monkeypatch.setattr(engine, "prefill_ms_per_1k", lambda cost: 1.0)
    monkeypatch.setattr(engine, "MIN_FIT_STEPS", 30)
    args = SimpleNamespace(cuda=False)

    class Clock:
        def conditions(self):
            return {}

    monkeypatch.setattr(engine, "_fit", lambda rows, args: fitted.append(rows) or Clock())
    out = engine.out_of_sample(a, [b], args)
    assert [r["system"] for r in out["fit_on_none"]["rows"]] == ["eager"]
    assert fitted[0] == [a["measured"][0]]
    assert out["fit_on_b"] == {"skipped": "20 timed steps to fit, under 30"}
    out = engine.out_of_sample(b, [a], args)
    assert "skipped" in out["fit_on_none"]
    assert fitted[-1] == a["measured"] and out["fit_on_a"]["fitted_workload"] == "a"
    assert [r["system"] for r in out["fit_on_a"]["rows"]] == ["none", "eager"]


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
