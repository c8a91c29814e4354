"""``make gpu-check``: its dry run end to end on this CPU machine, and its time limits.

The real run happens once, unattended, on a rare GPU lent for minutes; everything but the GPU
work is checked here: every step runs under ``timeout`` within one budget, a failed or timed-out
step is recorded and the steps that need it are skipped, and the dry run writes the same JSON and
logs the real run does, installing nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["setup", "env", "compiled", "tests", "kernel_check", "bench"]


def test_the_whole_run_fits_in_8_minutes():
    # The budget caps every step's limit; the last step may overrun it by its kill grace.
    assert gpu_check.BUDGET_S + gpu_check.KILL_AFTER_S + 15 < 8 * 60
    steps = gpu_check.plan(Path("/tmp/out"), "python3", ROOT / ".venv", dry_run=False)
    assert [s.name for s in steps] == STEPS
    assert all(0 < s.limit_s <= gpu_check.BUDGET_S for s in steps)
    by_name = {s.name: s.command for s in steps}
    assert by_name["setup"][:2] == ["bash", "tools/bootstrap.sh"]
    assert "--plan" not in by_name["setup"]
    assert "--collect-only" not in by_name["tests"]
    assert "--quick" in by_name["bench"]
    assert not any(word in " ".join(map(str, cmd)) for cmd in by_name.values()
                   for word in ("sudo", "nvidia-smi -r", "--gpu-reset", "rm -rf"))


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils `timeout`")
def test_steps_run_under_timeout_and_within_the_budget(tmp_path, monkeypatch):
    steps = [
        gpu_check.Step("slow", ["sleep", "30"], 30),
        gpu_check.Step("after-slow", [sys.executable, "-c", "print(1)"], 30, ("slow",)),
        gpu_check.Step("late", ["true"], 30),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda *args: steps)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1)
    monkeypatch.setattr(gpu_check, "KILL_AFTER_S", 1)
    t0 = time.monotonic()
    doc = gpu_check.run(tmp_path, sys.executable, tmp_path / "venv", dry_run=True, budget_s=2)
    assert time.monotonic() - t0 < 10
    slow, after, late = doc["steps"]
    assert slow["timed_out"] and slow["rc"] == 124
    assert after["skipped"] == "needs slow, which did not succeed"
    assert late["skipped"].startswith("budget spent")
    assert doc["ok"] is False and doc["failed"] == ["slow"]
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == doc
    assert "===== slow: exit 124" in (tmp_path / "gpu_check.log").read_text()


def test_dry_run_writes_the_results_and_installs_nothing(tmp_path):
    out, venv = tmp_path / "gpu", tmp_path / "venv"
    default = gpu_check.DEFAULT_OUT
    before = set(default.rglob("*")) if default.exists() else None
    rc = gpu_check.main(["--dry-run", "--out", str(out), "--python", sys.executable,
                         "--venv", str(venv)])
    doc = json.loads((out / "gpu_check.json").read_text())
    assert rc == 0, (out / "gpu_check.log").read_text()[-4000:]
    assert doc["dry_run"] and doc["ok"] and not doc["failed"] and not doc["skipped"]
    assert [s["name"] for s in doc["steps"]] == STEPS
    assert all(s["rc"] == 0 and not s["timed_out"] for s in doc["steps"])
    log = (out / "gpu_check.log").read_text()
    assert all(f"===== {name}: exit 0" in log for name in STEPS)
    assert "bootstrap plan:" in (out / "setup.log").read_text()
    assert json.loads((out / "env.json").read_text())["cuda_available"] is False
    assert "sm_90" in (out / "compiled.txt").read_text()
    assert (out / "tests.xml").exists()
    assert json.loads((out / "kernel_check.json").read_text())["rows"]
    bench = json.loads((out / "bench_kernels_cpu_dryrun.json").read_text())
    assert bench["mode"] == "cpu-dry-run" and bench["contention"] and bench["piece_sweep"]
    assert not venv.exists(), "a dry run must not install anything"
    after = set(default.rglob("*")) if default.exists() else None
    assert after == before, "wrote to the default folder despite --out"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_runs_this_script():
    for target, extra in (("gpu-check", []), ("gpu-check-dry-run", ["--dry-run"])):
        # Under `make test` this runs as a sub-make: without --no-print-directory and a clean
        # MAKEFLAGS it prints "Entering directory" lines first.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        cmd = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert cmd[1] == "bench/gpu_check.py" and all(a in cmd for a in extra)
