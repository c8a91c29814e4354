"""``bench/kernels/bandwidth.py``: without a GPU it says so and writes nothing; ``--dry-run`` writes
its JSON document on the CPU (interpreted kernel), every method and direction present and no
target judged.
"""

from __future__ import annotations

import json
import math

import pytest
import torch


@pytest.fixture
def bandwidth(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    from bench.kernels import bandwidth

    return bandwidth


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_says_so_and_exits_0(bandwidth, capsys, tmp_path):
    assert bandwidth.main(["--results-dir", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_bench_dry_run_writes_json(bandwidth, tmp_path):
    from bench.kernels.targets import TARGETS

    assert bandwidth.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "cpu-dry-run"
    methods = {(r["scenario"], r["method"], r["direction"]) for r in doc["results"]}
    for method in ("kernel", "loop", "batched", "ceiling"):
        for direction in ("d2h", "h2d"):
            assert ("nemotron-h-8b", method, direction) in methods
    assert all(math.isfinite(r["gbps_median"]) and r["gbps_median"] > 0 for r in doc["results"])
    assert set(doc["targets"]) == set(TARGETS)
    assert all(t["met"] is None for t in doc["targets"].values()), "a dry run judges no target"
