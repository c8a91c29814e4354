"""The fleet study (``bench.fleet``): a small sweep gives the same rows on local processes and
on a local Ray instance, the choice is made on train and reported on test, and the target's
figure is the share of the split's loss the choice recovers."""

from __future__ import annotations

import json

import pytest

from bench.fleet import study
from bench.fleet.cells import Cell
from bench.fleet.executors import run_cells

CELLS = [Cell("agent", 2, "eager", "round_robin", limit=40),
         Cell("agent", 2, "eager+shared", "prefix", limit=40),
         Cell("agent", 2, "eager", "round_robin", "pooled", limit=40)]


def _modeled(rows):
    return json.dumps([{k: v for k, v in r.items() if k != "wall_s"} for r in rows],
                      sort_keys=True)


def test_ray_and_local_processes_give_the_same_rows():
    pytest.importorskip("ray")
    local = run_cells(CELLS, jobs=2, quiet=True)
    on_ray = run_cells(CELLS, ray_address="local", quiet=True)
    assert _modeled(local) == _modeled(on_ray)
    assert [r["cell"] for r in local] == [c.as_dict() for c in CELLS]
    assert all(set(r["parts"]) == {"train", "test"} for r in local)


def _row(setup, router, kind, train, test, p90=1.0):
    part = lambda hit: {"token_hit_rate": hit, "ttft_p50_s": 0.5, "ttft_p90_s": p90,
                        "queue_delay_p50_s": 0.1}
    return {"cell": Cell("cc_agentic", 4, setup, router, kind).as_dict(),
            "parts": {"train": part(train), "test": part(test)}}


def test_the_choice_is_made_on_train_and_its_test_share_is_the_target():
    rows = [_row("eager", "round_robin", "fleet", 0.40, 0.30),
            _row("eager", "prefix", "fleet", 0.50, 0.34),  # best on train
            _row("eager+shared", "prefix", "fleet", 0.45, 0.60),  # best on test: not chosen
            _row("eager+lfu:64", "session", "fleet", 0.70, 0.70, p90=9.0),  # slower: out
            _row("eager", "round_robin", "pooled", 0.6, 0.40),
            _row("eager", "round_robin", "unbounded", 0.9, 0.9),
            _row("eager+nextuse", "round_robin", "nextuse", 0.5, 0.5)]
    out = study.summarize(rows)
    cell = out["table"]["cc_agentic"]["4"]
    assert cell["chosen"] == "eager / prefix"
    assert cell["recovered_share"] == pytest.approx(0.4)  # (0.34 - 0.30) / (0.40 - 0.30)
    target = out["recovered_share"]
    assert target["value"] == pytest.approx(0.4) and not target["met"]


def test_bad_arguments_are_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        study.main(["--replicas", "0"])
    assert e.value.code == 2
    assert "--replicas must be positive" in capsys.readouterr().err
