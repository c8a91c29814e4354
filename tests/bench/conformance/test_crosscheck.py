"""``python -m bench.conformance.crosscheck``: every bad argument is one line and exit 2, found
before either loop runs anything."""

from __future__ import annotations

import os
import time

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.conformance import crosscheck


@pytest.mark.parametrize(("args", "named"), [
    (["--setups", "bogus"], "unknown setup 'bogus'"),
    (["--token-budget", "0"], "token_budget must be a positive int"),
    (["--max-running", "0"], "max_running must be a positive int"),
    (["--model", "nemotron-h-8b"], "Mamba"),
    (["--max-running", "300", "--token-budget", "256"], "max_running 300 exceeds token_budget"),
    (["--vllm-scheduler", "nosuchfield=1"], "'nosuchfield' is not a vLLM SchedulerConfig field"),
    (["--vllm-scheduler", "scheduler_reserve_full_isl=\"maybe\""], "SchedulerConfig refuses"),
    (["--setups", "eager+nextuse"], "the eviction 'nextuse' is an oracle"),
])
def test_bad_arguments_fail_before_any_run(monkeypatch, capsys, args, named):
    ran = []
    monkeypatch.setattr(crosscheck, "format_rows", lambda res: ran.append(res) or "")
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        crosscheck.main(["--workloads", "agent", "--quiet", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and named in err, err
    assert not ran and time.perf_counter() - t0 < 60
