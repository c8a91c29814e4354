"""``bench/bench_vllm.py`` as a smoke test on CPU: every system that runs here runs, the CPU tier
is used, the JSON says what ran (and that CPU timings mean nothing); bad arguments are one line
with exit code 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from bench import bench_vllm


def test_quick_run_on_cpu(tmp_path, capsys):
    assert bench_vllm.main(["--quick", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "vllm_agent.json").read_text())
    rows = {r["system"]: r for r in doc["rows"]}
    assert set(rows) == {"none", "kvtriton", "simple"}
    assert "needs CUDA" in rows["simple"]["skipped"]
    for name in ("none", "kvtriton"):
        assert rows[name]["requests"] == doc["conditions"]["requests"] > 0
        assert rows[name]["ttft_s"]["p50"] > 0
    tier = rows["kvtriton"]
    assert tier["connector"]["cpu_hit_tokens"] > 0 and tier["connector"]["blocks_loaded"] > 0
    assert tier["transfers"]["load"]["bytes"] > 0
    assert "timings mean nothing" in doc["conditions"]["note"]
    assert "machine" in doc


@pytest.mark.parametrize("argv", [["--systems", "none,nope"], ["--limit", "0"],
                                  ["--model", "/no/such/folder"], ["--trace", "x"]])
def test_bad_arguments_are_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench_vllm.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error" in err
