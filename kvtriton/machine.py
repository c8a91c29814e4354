"""What a result records about where it was measured: the CPU's name and the commit.

Shared by the benchmark harness (``bench/common.py``) and the library's own result writers
(``kvtriton.vllm.crosscheck``), which cannot import ``bench/``.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path

__all__ = ["cpu_name", "git_sha"]


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
