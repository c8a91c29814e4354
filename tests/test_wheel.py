"""The wheel built from the tree works without the tree.

``make test`` installs kvtriton editable, so a package the packaging leaves out is still imported
from the tree; a hand-kept package list once left out ``kvtriton.eviction`` and the wheel's
``import kvtriton`` failed. Here the wheel is built from a copy of the tree (an in-tree build
reuses ``build/lib``, where a deleted module lingers), installed with ``--no-deps`` into a fresh
venv, and used from a folder outside the tree. The fresh venv sees this interpreter's torch and
vLLM through plain path lines in a ``.pth``: unlike ``site.addsitedir`` these do not run the
``.pth`` files of those folders, so the editable install's finder stays out, and every kvtriton
module is checked to come from the venv's own site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The tree's package folders under their import names (kernels/ ships as kvtriton.kernels).
TREE_PACKAGES = {"kvtriton": ROOT / "kvtriton", "kvtriton.kernels": ROOT / "kernels"}
DATA = ("kvtriton", "sim", "data")
TIMEOUT_S = 180

# Run by the fresh venv's interpreter: imports every module of the installed kvtriton (the walk
# lists what the wheel holds, not what the tree has), loads the connector the way vLLM does for
# `kv_connector_module_path`, and reports where each came from.
PROBE = r"""
import importlib, inspect, json, pkgutil, sys
import kvtriton

names = ["kvtriton"] + [m.name for m in pkgutil.walk_packages(kvtriton.__path__, "kvtriton.")]
files = {n: importlib.import_module(n).__file__ for n in names}

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KVTritonConnector", kv_connector_module_path="kvtriton.vllm",
    kv_role="kv_both"))
print(json.dumps({"files": files, "connector": cls.__qualname__,
                  "connector_file": inspect.getfile(cls),
                  "is_v1_connector": issubclass(cls, KVConnectorBase_V1)}))
"""


def _tree_modules() -> set[str]:
    names = set()
    for pkg, base in TREE_PACKAGES.items():
        for path in base.rglob("*.py"):
            parts = path.relative_to(base).with_suffix("").parts
            names.add(".".join([pkg, *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return names


def _files_under(base: Path) -> set[str]:
    return {p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()}


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    shown = " ".join("<probe>" if "\n" in c else c for c in cmd)
    assert out.returncode == 0, f"{shown} failed ({out.returncode}):\n{out.stderr[-4000:]}"
    return out


def _sys_path(python: str, cwd: Path, env: dict[str, str]) -> list[str]:
    code = "import json, sys; print(json.dumps(sys.path))"
    return json.loads(_run([python, "-c", code], cwd, env).stdout)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    """(the fresh venv's python, its site-packages, the outside folder, the env to run in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    outside = tmp / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"

    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "__pycache__", "out", "results"))
    dist = tmp / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--no-index", "-w", str(dist), str(src)], outside, env)
    (wheel,) = dist.glob("kvtriton-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], outside, env)
    python = str(venv / "bin" / "python")
    # Installed before the venv sees this interpreter's packages: pip then finds no kvtriton
    # (the editable one's metadata) already there.
    _run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps",
          "--no-index", str(wheel)], outside, env)
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([python, "-c", code], outside, env).stdout.strip())
    own = set(_sys_path(python, outside, env))
    tree = (ROOT / "kvtriton").resolve()
    borrowed = [p for p in _sys_path(sys.executable, outside, env) if p not in own
                and Path(p).is_dir() and (Path(p) / "kvtriton").resolve() != tree]
    (site / "_outer_packages.pth").write_text("".join(f"{p}\n" for p in borrowed))
    return python, site, outside, env


@pytest.fixture(scope="module")
def probe(wheel_venv):
    python, _, outside, env = wheel_venv
    return json.loads(_run([python, "-c", PROBE], outside, env).stdout.splitlines()[-1])


def test_the_wheel_holds_and_imports_every_module_of_the_tree(wheel_venv, probe):
    _, site, _, _ = wheel_venv
    assert set(probe["files"]) == _tree_modules()
    stray = {n: f for n, f in probe["files"].items()
             if not Path(f).resolve().is_relative_to(site.resolve())}
    assert not stray, f"imported from outside the wheel's install: {stray}"


def test_the_wheel_ships_the_package_data(wheel_venv):
    _, site, _, _ = wheel_venv
    shipped = _files_under(site.joinpath(*DATA))
    assert shipped == _files_under(ROOT.joinpath(*DATA))


def test_vllm_loads_the_connector_from_the_wheel(wheel_venv, probe):
    _, site, _, _ = wheel_venv
    assert probe["connector"] == "KVTritonConnector" and probe["is_v1_connector"]
    assert Path(probe["connector_file"]).resolve() == site / "kvtriton" / "vllm" / "connector.py"


def test_the_installed_command_reads_a_shipped_trace(wheel_venv):
    python, _, outside, env = wheel_venv
    out = _run([str(Path(python).parent / "kvtriton"), "trace-stats", "glm5"], outside, env)
    stats = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
    assert stats["name"] == "glm5_sample.jsonl" and int(stats["requests"]) > 0, out.stdout
