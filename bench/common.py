"""What every benchmark result carries: the machine it ran on, and one place to write it; the
results folder's manifest; and the one-line argument errors of the scripts that use
``OneLineParser``.

``bench/results/MANIFEST.json`` has one entry per file written under ``bench/results/`` (by
``write_result``, or ``record_output`` for a figure or a file another tool wrote), keyed by its
path there: its writer (module and command line, and the harness's command line when ``python
-m bench`` ran it), the commit, whether the tracked code was clean, and the UTC date. Each write
updates its own entry under a lock and replaces the manifest atomically, so a partial run keeps
every other entry. Files written elsewhere (``--results-dir`` to a test's folder) are not
recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import fcntl
import functools
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NoReturn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
MANIFEST = "MANIFEST.json"


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


@functools.cache
def _git_sha() -> str:
    """HEAD's short sha, with ``+dirty`` when tracked code differs from it (results, the paper
    and the README's generated block do not count: a benchmark run rewrites them). Read once per
    process, at this module's import (before any study computes anything): a run records the
    code it loaded, not a commit made while it ran."""
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
        "date_utc": _utc_now(),
    }


def _utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


# Who is writing, while the harness runs a study (``writing_as``); else this process's own
# command line (``_writer``).
_current_writer: dict | None = None


def _command(module: str | None, argv: Sequence[str]) -> str:
    head = ["python", "-m", module] if module else ["python"]
    return " ".join([*head, *argv])


def _writer() -> dict:
    """This process as a writer: ``python -m MODULE ARGS`` (or ``python SCRIPT ARGS``)."""
    if _current_writer is not None:
        return dict(_current_writer)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    module = spec.name.removesuffix(".__main__") if spec is not None else None
    argv = sys.argv[1:]
    return {"module": module, "argv": argv,
            "command": _command(module, argv if module else sys.argv[:1] + argv)}


@contextlib.contextmanager
def writing_as(module: str, argv: Sequence[str], via: str | None = None) -> Iterator[None]:
    """Record what is written inside as written by ``python -m module argv``: the harness calls
    every study's ``main`` in one process, whose command line is the harness's (``via``)."""
    global _current_writer
    before = _current_writer
    _current_writer = {"module": module, "argv": list(argv), "command": _command(module, argv)}
    if via is not None:
        _current_writer["via"] = via
    try:
        yield
    finally:
        _current_writer = before


def _record(path: Path, writer: dict | None, git: str, date_utc: str) -> None:
    """Set ``path``'s entry in the results folder's manifest, leaving every other entry as it
    is. A file outside the results folder (a test's, or one a user named) is not recorded.
    ``writer=None``: only the file's findings were derived again (``derive_findings``); its
    entry keeps its writer and gains ``findings`` (commit, clean, date)."""
    root = RESULTS_DIR.resolve()
    path = path.resolve()
    if not path.is_relative_to(root):
        return
    commit, _, dirty = git.partition("+")
    stamp = {"commit": commit, "clean": None if commit == "unknown" else not dirty,
             "date_utc": date_utc}
    fd = os.open(root, os.O_RDONLY)
    try:
        # One writer at a time: a read-modify-write without it could drop another's entry.
        fcntl.flock(fd, fcntl.LOCK_EX)
        manifest = root / MANIFEST
        doc = json.loads(manifest.read_text()) if manifest.exists() else {}
        files = doc.get("files", {})
        key = path.relative_to(root).as_posix()
        if writer is None:
            files[key] = {**files[key], "findings": stamp}
        else:
            files[key] = {"writer": writer, **stamp}
        doc = {"about": "per file under this folder: its writer, commit, whether the tracked "
                        "code was clean, and the UTC date (bench/common.py)",
               "files": dict(sorted(files.items()))}
        _atomic_write(manifest, json.dumps(doc, indent=2) + "\n")
    finally:
        os.close(fd)  # releases the lock


def record_output(path: str | Path, writer: dict | None = None) -> Path:
    """Record ``path`` (a figure, or a file another tool wrote) in the results folder's
    manifest, as written now, at the current commit, by ``writer`` (default: this process);
    return it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"record_output: no file {path}")
    _record(path, writer or _writer(), _git_sha(), _utc_now())
    return path


def write_result(name: str, payload: dict, results_dir: Path | None = None,
                 findings: Callable[[str, dict], dict] | None = None) -> Path:
    """Write ``payload`` plus ``machine_info()`` to ``<results_dir>/<name>.json`` (default
    ``RESULTS_DIR``) and record it in the manifest; return it. ``findings(name, doc)``: what the
    study concludes from the rows it wrote (its verdicts, the figures its text cites, its labels),
    kept beside them as ``doc["findings"]``; ``derive_findings`` derives it again for a file
    already written."""
    out_dir = Path(results_dir) if results_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    machine = machine_info()
    doc = {"benchmark": name, "machine": machine, **payload}
    _write_doc(path, doc, findings)
    _record(path, _writer(), machine["git_sha"], machine["date_utc"])
    return path


def _write_doc(path: Path, doc: dict, findings: Callable[[str, dict], dict] | None) -> bool:
    """Write ``doc`` to ``path`` with the study's findings last (none when ``findings`` is None
    or finds nothing); return whether it has findings."""
    doc.pop("findings", None)
    if findings is not None and (found := findings(path.stem, doc)) is not None:
        doc["findings"] = found
    _atomic_write(path, json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return "findings" in doc


def derive_findings(results_dir: Path | None = None) -> list[str]:
    """Derive the findings of every results file again, without running its study: a study's
    findings are a function of the rows it wrote (``write_result``), so when that function
    changes the rows need no new run (``python -m bench --findings``). Every JSON file the
    manifest lists whose writer module has ``findings(name, doc)`` is rewritten with new
    findings, and its manifest entry records when (``findings``: commit, clean, date). Returns
    the files rewritten."""
    import importlib

    root = Path(results_dir) if results_dir is not None else RESULTS_DIR
    manifest = json.loads((root / MANIFEST).read_text())["files"]
    done = []
    for file, entry in manifest.items():
        module = entry["writer"].get("module")
        path = root / file
        if not file.endswith(".json") or module is None or not path.exists():
            continue
        findings = getattr(importlib.import_module(module), "findings", None)
        if findings is None:
            continue
        if _write_doc(path, json.loads(path.read_text()), findings):
            _record(path, None, _git_sha(), _utc_now())
            done.append(file)
    return done


_git_sha()  # read now: see _git_sha
