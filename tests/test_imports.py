"""Imports run one way, and heavy optional parts load only when used.

Each check runs in a fresh interpreter, so modules imported by earlier tests cannot hide an
import; the cycle check reads every module's imports (top level, inside functions and in
``TYPE_CHECKING`` blocks: a type-only import back is still a cycle a reader has to untangle) and
fails on any cycle among kvtriton's modules and the benchmarks' (``bench``: a study imports what
the studies share, never another study's module back).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from kvtriton.sim.traces import MOONCAKE_SYNTHETIC, data_path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"kvtriton": ROOT / "kvtriton", "kvtriton.kernels": ROOT / "kernels"}
# The cycle check reads the benchmarks too; the library's own rules (no CLI, no driver in the
# connector) hold for PACKAGES only.
CYCLE_PACKAGES = {**PACKAGES, "bench": ROOT / "bench"}


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport sys\nprint('\\nmodules:', ' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return set(out.stdout.rsplit("modules:", 1)[1].split())


def test_engine_imports_without_the_planner():
    mods = _modules_after("from kvtriton.engine import TransferEngine")
    assert "kvtriton.records" in mods
    assert not {m for m in mods if m.startswith("kvtriton.planner")}


def test_the_kernels_import_nothing_of_the_engine():
    # The engine imports the kernels; the kernels (their pairs and table included) must not
    # import the engine back.
    mods = _modules_after("import kvtriton.kernels.copy_blocks")
    assert {"kvtriton.kernels.pairs", "kvtriton.kernels.copy_blocks"} <= mods
    assert not {m for m in mods if m.startswith("kvtriton.engine")}


def test_records_import_neither_side():
    mods = _modules_after("import kvtriton.records")
    assert not {m for m in mods if m.startswith(("kvtriton.planner", "kvtriton.engine"))}


@pytest.mark.parametrize("code", [
    "from kvtriton.sim import agent_workload",
    "import kvtriton.sim.loop",
    f"from kvtriton.cli import main; main(['trace-stats', {str(data_path(MOONCAKE_SYNTHETIC))!r}])",
], ids=["agent_workload", "serving-loop", "trace-stats"])
def test_simulator_does_not_import_triton(code):
    mods = _modules_after(code)
    assert "triton" not in mods
    assert "kvtriton.sim.integrity" not in mods
    assert "kvtriton.engine" not in mods


@pytest.mark.parametrize("code", [
    "import kvtriton.sim",
    "from kvtriton.sim import agent_workload",
    "import kvtriton.sim.loop",
    "import kvtriton.sim.scheduler",
    "import kvtriton.sim.batch_scheduler",
])
def test_simulator_imports_leave_out_triton_and_integrity_mode(code):
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    mods = set(out.stdout.split())
    assert "triton" not in mods
    assert "kvtriton.sim.integrity" not in mods


def test_triton_is_imported_when_integrity_is_asked_for():
    # The negative control of the checks above: the same probe does see Triton once it is used.
    mods = _modules_after("from kvtriton.sim import agent_workload, simulate\n"
                          "simulate(agent_workload(num_conversations=1, min_turns=1, max_turns=1,"
                          " seed=0), gpu_blocks=256, cpu_blocks=64, setups=['eager'],"
                          " integrity=True, bound=False)")
    assert "kvtriton.sim.integrity" in mods and "triton" in mods


def _module_name(path: Path, packages: dict[str, Path] = PACKAGES) -> str:
    for pkg, base in packages.items():
        if path.is_relative_to(base):
            rel = path.relative_to(base).with_suffix("")
            parts = [] if rel.name == "__init__" else [rel.name]
            return ".".join([pkg, *rel.parent.parts, *parts])
    raise AssertionError(path)


def _imports(tree: ast.AST) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_no_import_cycles():
    files = [p for base in CYCLE_PACKAGES.values() for p in base.rglob("*.py")]
    names = {_module_name(p, CYCLE_PACKAGES): p for p in files}
    graph = {}
    for name, path in names.items():
        graph[name] = {d for d in _imports(ast.parse(path.read_text()))
                       if d in names and d != name}
    cycles: list[list[str]] = []
    on_path: list[str] = []
    done: set[str] = set()

    def visit(n: str) -> None:
        on_path.append(n)
        for d in sorted(graph[n]):
            if d in on_path:
                cycles.append([*on_path[on_path.index(d):], d])
            elif d not in done:
                visit(d)
        on_path.pop()
        done.add(n)

    for n in sorted(graph):
        if n not in done:
            visit(n)
    assert not cycles, f"import cycles: {cycles}"


def _library_files() -> dict[str, Path]:
    return {_module_name(p): p for base in PACKAGES.values() for p in base.rglob("*.py")}


def test_the_library_imports_nothing_from_the_command_line():
    # The CLI sits on top: workloads, checks and settings it uses live in the library.
    upward = sorted(name for name, path in _library_files().items() if name != "kvtriton.cli"
                    and any(d == "kvtriton.cli" or d.startswith("kvtriton.cli.")
                            for d in _imports(ast.parse(path.read_text()))))
    assert not upward, f"modules importing kvtriton.cli: {upward}"


def test_the_connector_package_holds_no_experiment_driver():
    # kvtriton.vllm is what vLLM loads: no command line, no experiment (those live in bench/).
    drivers = []
    for name, path in _library_files().items():
        if not name.startswith("kvtriton.vllm"):
            continue
        tree = ast.parse(path.read_text())
        top = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if "main" in top or "argparse" in _imports(tree) or "__main__" in path.read_text():
            drivers.append(name)
    assert not drivers, f"experiment drivers in kvtriton/vllm: {drivers}"
