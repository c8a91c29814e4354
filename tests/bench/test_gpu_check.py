"""``make gpu-check``: its dry run end to end on this CPU machine, and its time limits.

The real run happens once, unattended, on a rare GPU lent for minutes; everything but the GPU
work is checked here: every step runs under ``timeout`` within one budget its limits fit, a failed
or timed-out step is recorded and the steps that need it are skipped, a missed benchmark target
is a verdict of its own (not a failed step), and the dry run writes the same JSON and logs the
real run does and prints the target table, installing nothing.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import gpu_check
from bench.kernels import targets

ROOT = Path(__file__).resolve().parents[2]
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


def test_step_limits_add_up_to_the_budget():
    # Otherwise the last steps get what the first left over, not what they were sized for.
    for dry_run in (False, True):
        steps = gpu_check.plan(Path("/tmp/out"), "python3", ROOT / ".venv", dry_run=dry_run)
        assert sum(s.limit_s for s in steps) <= gpu_check.BUDGET_S, dry_run


def test_the_tests_step_is_the_device_lane_by_marker_with_a_bounded_fuzz():
    (tests,) = [s for s in gpu_check.plan(Path("/tmp/out"), "python3", ROOT / ".venv",
                                          dry_run=False) if s.name == "tests"]
    cmd = tests.command
    assert cmd[cmd.index("-m", 3) + 1] == gpu_check.GPU_TESTS_MARKER
    assert "device_lane" in gpu_check.GPU_TESTS_MARKER.split()
    assert not [a for a in cmd if a.endswith(".py")], "files move: select by marker"
    assert tests.env == {"KVTRITON_FUZZ_EXAMPLES": str(gpu_check.GPU_FUZZ_EXAMPLES)}
    assert tests.limit_s == gpu_check.TESTS_MEASURED_S * gpu_check.TESTS_FACTOR
    # The variable is the one a device-lane fuzz module reads, wherever it has moved to.
    readers = [f for f in (ROOT / "tests").rglob("test_*.py")
               if "KVTRITON_FUZZ_EXAMPLES" in (text := f.read_text())
               and "pytest.mark.device_lane" in text]
    assert readers, "no device-lane test reads KVTRITON_FUZZ_EXAMPLES"


def _bench_json(path: Path, h2d_kernel_gbps: float) -> dict:
    """What bench.kernels.bandwidth writes of its targets (judged by bench.kernels.targets), for a
    run whose H2D kernel reached ``h2d_kernel_gbps`` against a 50 GB/s ceiling."""
    rows = [{"scenario": "llama3-8b", "blocks_per_launch": 64, "method": m, "direction": d,
             "gbps_median": g, "host_us_median": 10.0}
            for d in ("d2h", "h2d") for m, g in
            (("ceiling", 50.0), ("loop", 4.0),
             ("kernel", h2d_kernel_gbps if d == "h2d" else 48.0))]
    judged = targets.evaluate_targets(rows, evaluate=True)
    doc = {"targets": judged, "targets_summary": targets.targets_summary(judged),
           "report": targets.target_table(judged)}
    path.write_text(json.dumps(doc))
    return doc


@pytest.mark.parametrize(("bench_rc", "h2d", "failed", "missed", "rc"), [
    (3, 30.0, [], ["h2d_vs_ceiling"], 3),
    (0, 40.0, [], [], 0),
    (1, 30.0, ["bench"], [], 1),
], ids=["target-missed", "targets-met", "step-failed"])
def test_a_missed_target_is_a_verdict_apart_from_a_failed_step(
        tmp_path, monkeypatch, capsys, bench_rc, h2d, failed, missed, rc):
    # 3: the benchmark ran to the end and missed a target; gpu_check passes the verdict on.
    assert gpu_check.TARGETS_MISSED_RC == targets.EXIT_TARGET_MISSED == 3
    bench = _bench_json(tmp_path / "bench.json", h2d)
    steps = [
        gpu_check.Step("bench", [sys.executable, "-c", f"raise SystemExit({bench_rc})"], 30,
                       missed_rc=gpu_check.TARGETS_MISSED_RC, targets_file="bench.json"),
        gpu_check.Step("after", [sys.executable, "-c", "print(1)"], 30, ("bench",)),
    ]
    monkeypatch.setattr(gpu_check, "plan", lambda *args: steps)
    assert gpu_check.main(["--out", str(tmp_path), "--python", sys.executable,
                           "--venv", str(tmp_path / "venv")]) == rc
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["failed"] == failed and doc["targets_missed"] == missed
    assert doc["ok"] is (rc == 0)
    out = capsys.readouterr().out
    summary = out.rstrip().splitlines()[-1]
    if failed:
        assert doc["steps"][1]["skipped"] == "needs bench, which did not succeed"
        assert "FAILED: bench" in summary and "targets not judged" in summary
        assert "h2d_vs_ceiling" not in out
    else:
        # A benchmark that ran to the end satisfies the steps that need it.
        assert doc["steps"][1]["rc"] == 0
        assert "steps all passed" in summary and bench["targets_summary"] in summary
        assert "\n".join(bench["report"]) in out
        assert doc["targets"]["bench"]["h2d_vs_ceiling"]["status"] == (
            "missed" if missed else "met")


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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run for the tests below: its folder, its venv path, what it printed, its exit
    code, and the default folder's files before and after."""
    tmp = tmp_path_factory.mktemp("dry")
    out, venv = tmp / "gpu", tmp / "venv"
    default = gpu_check.DEFAULT_OUT
    before = set(default.rglob("*")) if default.exists() else None
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        rc = gpu_check.main(["--dry-run", "--out", str(out), "--python", sys.executable,
                             "--venv", str(venv)])
    after = set(default.rglob("*")) if default.exists() else None
    return out, venv, printed.getvalue(), rc, before, after


def test_dry_run_writes_the_results_and_installs_nothing(dry_run):
    out, venv, _, rc, before, after = dry_run
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
    collected = (out / "tests.log").read_text()
    assert "test_fuzz.py::" in collected and "runTest" in collected, "the lane lost the fuzz"
    assert json.loads((out / "kernel_check.json").read_text())["rows"]
    bench = json.loads((out / "bench_kernels_cpu_dryrun.json").read_text())
    assert bench["mode"] == "cpu-dry-run" and bench["contention"] and bench["piece_sweep"]
    assert not venv.exists(), "a dry run must not install anything"
    assert after == before, "wrote to the default folder despite --out"


def test_dry_run_prints_the_target_table_from_the_target_code(dry_run):
    out, _, printed, _, _, _ = dry_run
    bench = json.loads((out / "bench_kernels_cpu_dryrun.json").read_text())
    lines = printed.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split() == ["target", "measured",
                                                                      "bound", "met"])
    rows = {line.split()[0]: line for line in lines[header + 1: header + 1 + len(
        targets.TARGETS)]}
    assert set(rows) == set(targets.TARGETS)
    for name, line in rows.items():
        # Every target's value is computed on the CPU (the dry run reaches the target code),
        # and judged by nobody.
        assert line.endswith("n/a (dry run)") and line.split()[1] != "-", line
        assert bench["targets"][name]["value"] is not None
    assert any(line.startswith("small:") and "#42212" in line for line in lines)
    assert lines[-1].startswith("gpu_check (dry run): steps all passed; targets: not judged")


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_runs_this_script():
    for target, extra in (("gpu-check", []), ("gpu-check-dry-run", ["--dry-run"])):
        # Under `make test` this runs as a sub-make: without --no-print-directory and a clean
        # MAKEFLAGS it prints "Entering directory" lines first.
        env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
        cmd = subprocess.run(["make", "--no-print-directory", "-n", target], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        assert cmd[1] == "bench/gpu_check.py" and all(a in cmd for a in extra)
