"""What every benchmark result carries: the machine it ran on, and one place to write it; and
the one-line argument errors of the scripts that use ``OneLineParser``."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_sha(where: str | Path, pathspec: Sequence[str] = ()) -> str:
    """HEAD's short sha of the checkout holding ``where``, with ``+dirty`` when tracked files
    (those of ``pathspec`` if given) differ from it; ``unknown`` outside a checkout."""
    # No optional locks: a concurrent git command in the same tree must not see index.lock.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    status = ["git", "status", "--porcelain", "--untracked-files=no"]
    if pathspec:
        status += ["--", *pathspec]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=where, timeout=10, env=env).stdout.strip()
        dirty = subprocess.run(status, capture_output=True, text=True, cwd=where, timeout=10,
                               env=env).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


class OneLineParser(argparse.ArgumentParser):
    """``argparse`` that reports a bad argument the way the ``kvtriton`` CLI does: one line on
    stderr, exit code 2 (argparse's own usage dump first buries the message, and a caller
    checking stderr would have to skip a usage block whose length follows the options)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())}\n")


def _git_sha() -> str:
    """HEAD's short sha, with ``+dirty`` when tracked code differs from it (results, the paper
    and the README's generated block do not count: a benchmark run rewrites them)."""
    return git_sha(Path(__file__).resolve().parent.parent,
                   (".", ":!bench/results", ":!paper", ":!README.md"))


def machine_info() -> dict:
    """CPU, core count, GPU (or None), torch, triton, vLLM (where this run imported it), git sha
    and UTC date of this run."""
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cpu": cpu_name(),
        "cpu_cores": os.cpu_count(),
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "vllm": getattr(sys.modules.get("vllm"), "__version__", None),
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_result(name: str, payload: dict, results_dir: Path | None = None) -> Path:
    """Write ``payload`` plus ``machine_info()`` to ``<results_dir>/<name>.json``; return it."""
    out_dir = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"benchmark": name, "machine": machine_info(), **payload}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    tmp.replace(path)
    return path
