"""One unattended check of kvtriton on a lent GPU (``make gpu-check``), under 8 minutes.

Steps, each under coreutils ``timeout`` (their limits add up to at most ``BUDGET_S``, and the
whole run stays under it: a step gets what is left of the budget when that is less than its own
limit, and is skipped below ``MIN_STEP_S``):

1. ``setup``: ``tools/bootstrap.sh PYTHON VENV``, which reuses a CUDA torch that PYTHON imports;
2. ``env``: ``nvidia-smi``, torch / Triton / CUDA versions and the device, to ``env.json``;
3. ``compiled``: the copy kernel compiled for sm_90, sm_80 and this device, registers and spills
   read from the artifact (``python -m kvtriton.kernels.compiled``);
4. ``tests``: the device lane on ``device="cuda"``: every test marked ``device_lane`` (the kernel
   and engine tests, the fuzz with ``GPU_FUZZ_EXAMPLES`` examples per machine) or ``gpu``,
   selected by marker from ``tests/`` (``pytest``, JUnit XML to ``tests.xml``);
5. ``kernel_check``: every backend against the torch reference on every preset;
6. ``bench``: ``bench.kernels.bandwidth --quick``: bandwidth against the copy-engine ceiling, host
time
   per launch, the piece-size sweep and the GEMM contention run, each target judged.

Everything lands in one folder (``bench/results/gpu/`` by default): each step's JSON, a log per
step, ``gpu_check.log`` (all of them, in order) and ``gpu_check.json`` (per step: command,
limit, exit code, seconds, timed out or skipped; the benchmark's targets). The run is safe on a
rare, time-limited machine: it never touches the GPU's settings, needs no root, writes nothing
outside that folder and the venv, and keeps going after a failed step (skipping only the steps
that need what failed).

A step failed and a target was missed are two verdicts: the benchmark exits
``TARGETS_MISSED_RC`` when it ran to the end and a target was missed, which is not a failed step.
The run prints each step, the benchmark's target table (measured, bound, met) and one summary
line, and exits 1 if a step failed, else ``TARGETS_MISSED_RC`` if a target was missed, else 0.

``--dry-run`` runs the same pipeline at CPU size on a machine without a GPU: the bootstrap only
says what it would do (``--plan``), the tests are collected, not run, the kernel check runs in
the Triton interpreter and the benchmark as ``--dry-run``, which computes every target from its
CPU timings and judges none (``n/a (dry run)``); results go to ``.../gpu/dry-run/``.

Only the standard library is imported: this runs under the interpreter that exists before the
venv does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "gpu"
BUDGET_S = 450  # 7.5 minutes: under 8 with the kill grace of one step and the start-up
MIN_STEP_S = 15
KILL_AFTER_S = 10  # SIGKILL this long after a step's SIGTERM
# The device lane, by marker: the test files move between folders, the marks go with them.
GPU_TESTS_MARKER = "device_lane or gpu"
# Examples per fuzz state machine (KVTRITON_FUZZ_EXAMPLES, read by the planner fuzz tests); CI's
# profile runs 20 to 300 per machine, about 100 s of CPU, more than the step can give.
GPU_FUZZ_EXAMPLES = 10
# The tests step's limit, from a measurement: the selection below (203-205 tests) took 59, 50
# and 30 s wall, collection of tests/ included, on a 2-core CPU machine at load 6, 4 and 2,
# kernels in the Triton interpreter, with GPU_FUZZ_EXAMPLES. The slowest, twice, on the GPU box:
# CUDA start-up and the first-launch compile of each kernel specialization, which the
# interpreter never pays.
TESTS_MEASURED_S = 59
TESTS_FACTOR = 2
# bench.kernels.targets.EXIT_TARGET_MISSED: it ran to the end, a target missed.
TARGETS_MISSED_RC = 3

ENV_PROBE = """
import json, platform, subprocess, sys
import torch, triton
info = {"python": platform.python_version(), "executable": sys.executable,
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    info.update(device=p.name, capability=f"{p.major}{p.minor}", sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1))
try:
    info["nvidia_smi"] = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.current,"
         "pcie.link.width.current,clocks.max.sm,power.limit", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20).stdout.strip()
except (OSError, subprocess.SubprocessError) as exc:
    info["nvidia_smi"] = f"unavailable: {exc}"
print(json.dumps(info, indent=2))
"""


@dataclass
class Step:
    name: str
    command: list[str]
    limit_s: int
    needs: tuple[str, ...] = ()  # steps that must have succeeded first
    output: str | None = None  # file (in the folder) that receives the step's stdout
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    # The exit code that means "ran to the end, a target was missed", and the JSON (in the
    # folder) whose ``targets`` and ``report`` say which: a benchmark's verdict, not a failure.
    missed_rc: int | None = None
    targets_file: str | None = None
    result: dict = field(default_factory=dict)


def plan(out: Path, python: str, venv: Path, dry_run: bool) -> list[Step]:
    """The steps of one run; in a dry run, their CPU-sized forms."""
    vpy = str(venv / "bin" / "python")
    if dry_run and not Path(vpy).exists():
        vpy = sys.executable  # nothing is installed in a dry run: use the interpreter at hand
    setup = ["bash", "tools/bootstrap.sh", *(["--plan"] if dry_run else []), python, str(venv)]
    # A module that fails to import on the GPU box (a missing optional package) is reported
    # (exit 1) without losing the lane's results.
    tests = [vpy, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "tests",
             "-m", GPU_TESTS_MARKER, "--continue-on-collection-errors",
             f"--junitxml={out / 'tests.xml'}", *(["--collect-only"] if dry_run else [])]
    compiled = [vpy, "-m", "kvtriton.kernels.compiled", "--arch", "90", "80", "device"]
    bench = [vpy, "-m", "bench.kernels.bandwidth", "--dry-run" if dry_run else "--quick",
             "--results-dir", str(out)]
    bench_json = "bench_kernels_cpu_dryrun.json" if dry_run else "bench_kernels_quick.json"
    # Limits on the GPU box (they add up to BUDGET_S); the dry run's fit the CPU.
    return [
        Step("setup", setup, 30 if dry_run else 105),
        Step("env", [vpy, "-c", ENV_PROBE], 20, ("setup",), output="env.json"),
        Step("compiled", compiled, 45, ("setup",), output="compiled.txt"),
        Step("tests", tests, 90 if dry_run else TESTS_MEASURED_S * TESTS_FACTOR, ("setup",),
             env={"KVTRITON_FUZZ_EXAMPLES": str(GPU_FUZZ_EXAMPLES)}),
        Step("kernel_check", [vpy, "-m", "bench.kernels.check", "--results-dir", str(out)], 40,
             ("setup",)),
        Step("bench", bench, 120, ("setup",), missed_rc=TARGETS_MISSED_RC,
             targets_file=bench_json),
    ]


def _run_step(step: Step, limit: int, log, out: Path) -> dict:
    cmd = step.command
    if shutil.which("timeout"):
        cmd = ["timeout", f"--kill-after={KILL_AFTER_S}", str(limit), *cmd]
    env = " ".join(f"{k}={v}" for k, v in step.env.items())
    log.write(f"\n===== {step.name}: {env + ' ' if env else ''}{' '.join(step.command)} "
              f"(limit {limit} s)\n")
    log.flush()
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=limit + KILL_AFTER_S + 5, env={**os.environ, **step.env})
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
    except OSError as exc:
        rc, stdout, stderr = 127, "", f"{exc}\n"
    seconds = time.monotonic() - t0
    (out / f"{step.name}.log").write_text(stdout + stderr)
    if step.output and rc == 0:
        (out / step.output).write_text(stdout)
    log.write(stdout + stderr)
    log.write(f"===== {step.name}: exit {rc} in {seconds:.1f} s\n")
    log.flush()
    return {"rc": rc, "seconds": round(seconds, 1), "timed_out": rc in (124, 137),
            "log": f"{step.name}.log"}


def _targets(step: Step, out: Path) -> dict:
    """What ``step``'s JSON says of its targets: ``targets`` (name: value, bound, met, status),
    ``missed`` (names), ``summary`` and ``report`` (the lines it printed: its tables)."""
    rc = step.result.get("rc")
    if step.targets_file is None or rc not in (0, step.missed_rc):
        return {}
    try:
        doc = json.loads((out / step.targets_file).read_text())
        targets = {name: {k: t.get(k) for k in ("value", "op", "bound", "met", "status")}
                   for name, t in doc["targets"].items()}
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        why = f"{step.name} exited {rc}, its targets are unreadable ({step.targets_file}: {exc})"
        return {"targets": {}, "missed": [why] if rc == step.missed_rc else [], "summary": why,
                "report": []}
    missed = [name for name, t in targets.items() if t["status"] == "missed"]
    summary = doc.get("targets_summary", "")
    if rc == step.missed_rc and not missed:
        missed = [f"{step.name} exited {rc} but its JSON names no missed target"]
        summary = f"{summary}; {missed[0]}"
    return {"targets": targets, "missed": missed, "summary": summary,
            "report": doc.get("report", [])}


def run(out: Path, python: str, venv: Path, dry_run: bool, budget_s: float = BUDGET_S,
        only: tuple[str, ...] = ()) -> dict:
    """Run the steps in order into ``out``; returns what ``gpu_check.json`` holds."""
    out.mkdir(parents=True, exist_ok=True)
    steps = plan(out, python, venv, dry_run)
    deadline = time.monotonic() + budget_s
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    ok: set[str] = set()
    with open(out / "gpu_check.log", "w") as log:
        log.write(f"gpu_check {'dry run ' if dry_run else ''}started {started}, budget "
                  f"{budget_s:.0f} s, python {python}, venv {venv}, folder {out}\n")
        for step in steps:
            left = int(deadline - time.monotonic())
            missing = [n for n in step.needs if n not in ok]
            if only and step.name not in only:
                step.result = {"skipped": "not selected (--only)"}
            elif missing:
                step.result = {"skipped": f"needs {', '.join(missing)}, which did not succeed"}
            elif left < MIN_STEP_S:
                step.result = {"skipped": f"budget spent ({left} s left)"}
            else:
                step.result = _run_step(step, min(step.limit_s, left), log, out)
                if step.result["rc"] in (0, step.missed_rc):
                    ok.add(step.name)
            if "skipped" in step.result:
                log.write(f"\n===== {step.name}: skipped, {step.result['skipped']}\n")
    if not dry_run and "setup" in ok and (venv / "bin" / "python").exists():
        (venv / ".installed").touch()  # what `make` checks before its own set-up
    failed = [s.name for s in steps if s.result.get("rc") not in (None, 0, s.missed_rc)]
    skipped = [s.name for s in steps if "skipped" in s.result and s.name in (only or [s.name])]
    judged = {s.name: _targets(s, out) for s in steps if s.targets_file}
    missed = [m for j in judged.values() for m in j.get("missed", [])]
    doc = {
        "benchmark": "gpu_check",
        "dry_run": dry_run,
        "started_utc": started,
        "budget_s": budget_s,
        "python": python,
        "venv": str(venv),
        "folder": str(out),
        "ok": not failed and not skipped and not missed,
        "failed": failed,
        "skipped": skipped,
        "targets_missed": missed,
        "targets": {name: j.get("targets") for name, j in judged.items()},
        "targets_summary": "; ".join(
            j["summary"] if j else f"targets not judged: {name} did not run to the end"
            for name, j in judged.items()),
        "report": [line for j in judged.values() for line in j.get("report", [])],
        "steps": [{"name": s.name, "command": s.command, "limit_s": s.limit_s,
                   **({"env": s.env} if s.env else {}), **s.result} for s in steps],
    }
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="the same pipeline at CPU size, installing nothing")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"results folder (default {DEFAULT_OUT}, dry run: .../dry-run)")
    ap.add_argument("--python", default=os.environ.get("PYTHON", "python3"),
                    help="interpreter the venv is made from (its CUDA torch is reused)")
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S)
    ap.add_argument("--only", nargs="+", default=(), metavar="STEP",
                    help="run only these steps (setup, env, compiled, tests, kernel_check, bench)")
    args = ap.parse_args(argv)
    out = args.out or (DEFAULT_OUT / "dry-run" if args.dry_run else DEFAULT_OUT)
    venv = args.venv if args.venv.is_absolute() else ROOT / args.venv
    doc = run(out.resolve(), args.python, venv, args.dry_run, args.budget_s, tuple(args.only))
    for s in doc["steps"]:
        if "skipped" in s:
            state = f"skipped ({s['skipped']})"
        elif s["rc"] == 0 or s["name"] not in doc["failed"]:
            state = "ok" if s["rc"] == 0 else f"ran to the end, exit {s['rc']}: a target missed"
            state += f" in {s['seconds']} s"
        else:
            state = f"FAILED, exit {s['rc']} in {s['seconds']} s"
        print(f"  {s['name']:13s} {state}")
    if doc["report"]:
        print("\n" + "\n".join(doc["report"]) + "\n")
    steps = (f"FAILED: {', '.join(doc['failed'])}" if doc["failed"] else
             f"skipped: {', '.join(doc['skipped'])}" if doc["skipped"] else "all passed")
    print(f"gpu_check{' (dry run)' if doc['dry_run'] else ''}: steps {steps}; "
          f"{doc['targets_summary']}; "
          f"results in {out}{'' if doc['ok'] else ', log ' + str(out / 'gpu_check.log')}")
    if doc["failed"]:
        return 1
    return TARGETS_MISSED_RC if doc["targets_missed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
