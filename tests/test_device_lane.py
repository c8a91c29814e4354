"""Kernel and engine tests take their device from the lane, never hard-code the CPU.

On this machine the lane is the CPU, so a test that builds its KV tensors on the CPU passes here
and silently tests the interpreter on a GPU box too. The sources of the device-lane test modules
are read instead: each declares ``pytestmark = pytest.mark.device_lane`` (which makes
``conftest.py`` check every registered KV tensor's device on a GPU box), names no CPU device
(``device="cpu"``, ``torch.device("cpu")``, ``.to("cpu")``) and passes ``device=`` to every
``allocate_kv_caches`` call (its default is the CPU).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from device_lane import DEVICE, check_kv_device

import kvtriton.engine.descriptors as descriptors

TESTS = Path(__file__).resolve().parent
LANE_FILES = ("test_kernels.py", "test_engine.py", "test_layouts.py", "test_faults.py",
              "test_fuzz.py")


def _is_cpu(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.split(":")[0] == "cpu"


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def hard_coded_devices(source: str, filename: str = "<test>") -> list[str]:
    """Everything in a test module's ``source`` that ties it to the CPU device, one line each."""
    tree = ast.parse(source, filename)
    problems = []
    marked = any(
        isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
        and any(isinstance(n, ast.Attribute) and n.attr == "device_lane"
                for n in ast.walk(node.value))
        for node in tree.body)
    if not marked:
        problems.append(f"{filename}: no `pytestmark = pytest.mark.device_lane`")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        where = f"{filename}:{node.lineno}"
        name = _name(node.func)
        if any(kw.arg == "device" and _is_cpu(kw.value) for kw in node.keywords):
            problems.append(f"{where}: device='cpu'")
        if name == "device" and node.args and _is_cpu(node.args[0]):
            problems.append(f"{where}: torch.device('cpu')")
        if name == "to" and node.args and _is_cpu(node.args[0]):
            problems.append(f"{where}: .to('cpu')")
        if name == "allocate_kv_caches" and not any(kw.arg == "device" for kw in node.keywords):
            problems.append(f"{where}: allocate_kv_caches without device= (defaults to the CPU)")
    return problems


@pytest.mark.parametrize("filename", LANE_FILES)
def test_lane_modules_do_not_hard_code_the_cpu(filename):
    assert hard_coded_devices((TESTS / filename).read_text(), filename) == []


def test_the_scan_finds_each_kind_of_hard_coded_cpu():
    """The negative control of the scan: every form it looks for, in a module without the mark."""
    source = '''
import torch
def test_a():
    caches = allocate_kv_caches(layout, 4)
    x = torch.zeros(3, device="cpu")
    y = torch.device("cpu")
    z = x.to("cpu:0")
    ok = allocate_kv_caches(layout, 4, device=device)
    host = x.cpu()  # reading a result back to the host is fine
'''
    found = hard_coded_devices(source, "t.py")
    assert found == ["t.py: no `pytestmark = pytest.mark.device_lane`",
                     "t.py:4: allocate_kv_caches without device= (defaults to the CPU)",
                     "t.py:5: device='cpu'", "t.py:6: torch.device('cpu')", "t.py:7: .to('cpu')"]
    assert hard_coded_devices("import pytest\npytestmark = pytest.mark.device_lane\n") == []


def test_the_guard_refuses_kv_off_the_lane():
    check_kv_device(torch.empty(2, 2), lane=torch.device("cpu"))
    with pytest.raises(AssertionError, match="build KV tensors on the `device` fixture"):
        check_kv_device(torch.empty(2, 2), lane=torch.device("cuda"))


@pytest.mark.device_lane
def test_the_guard_is_active_in_device_lane_tests(device):
    assert device == DEVICE
    assert hasattr(descriptors._block_bytes_view, "__wrapped__")


def test_the_guard_is_off_elsewhere():
    assert not hasattr(descriptors._block_bytes_view, "__wrapped__")
