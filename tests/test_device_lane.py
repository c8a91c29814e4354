"""Kernel and engine tests take their device from the lane, never hard-code the CPU.

On this machine the lane is the CPU, so a test that builds its KV tensors on the CPU passes here
and silently tests the interpreter on a GPU box too. The sources of the device-lane test modules
are read instead: each declares ``pytestmark = pytest.mark.device_lane`` (which makes
``conftest.py`` check every registered KV tensor's device on a GPU box), names no CPU device
(``device="cpu"``, ``torch.device("cpu")``, ``.to("cpu")``) and passes ``device=`` to every
``allocate_kv_caches`` call (its default is the CPU). The helpers those modules build their KV
tensors with are read the same way, without the mark (they hold no tests).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

import kvtriton.engine.descriptors as descriptors
from helpers.device_lane import DEVICE, check_kv_device

TESTS = Path(__file__).resolve().parent
LANE_FILES = ("kernels/test_copy_blocks.py", "kernels/test_reference.py",
              "engine/test_transfer.py", "engine/test_descriptors.py", "engine/test_copy_engine.py",
              "engine/test_faults.py", "planner/test_fuzz.py")
# Where lane modules allocate KV tensors outside their own source.
LANE_HELPERS = ("helpers/copy_rig.py", "helpers/vllm_layouts.py")


def _is_cpu(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str) \
        and node.value.split(":")[0] == "cpu"


def _name(func: ast.AST) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def hard_coded_devices(source: str, filename: str = "<test>", *, needs_mark: bool = True
                       ) -> list[str]:
    """Everything in a test module's ``source`` that ties it to the CPU device, one line each
    (``needs_mark``: the module must also declare the device-lane mark)."""
    tree = ast.parse(source, filename)
    problems = []
    marked = not needs_mark or any(
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


def test_every_lane_module_is_scanned():
    """A module that declares the mark but is missing from ``LANE_FILES`` would go unread."""
    marked = {str(path.relative_to(TESTS)) for path in TESTS.rglob("test_*.py")
              if re.search(r"^pytestmark = pytest\.mark\.device_lane$", path.read_text(), re.M)}
    assert marked == set(LANE_FILES)


@pytest.mark.parametrize("filename", LANE_HELPERS)
def test_lane_helpers_do_not_hard_code_the_cpu(filename):
    assert hard_coded_devices((TESTS / filename).read_text(), filename, needs_mark=False) == []


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


def test_the_helper_scan_finds_the_same_without_asking_for_the_mark():
    source = """
def allocate(layout, device):
    caches = allocate_kv_caches(layout, 4)
    return caches, torch.zeros(3, device="cpu"), allocate_kv_caches(layout, 4, device=device)
"""
    assert hard_coded_devices(source, "h.py", needs_mark=False) == [
        "h.py:3: allocate_kv_caches without device= (defaults to the CPU)", "h.py:4: device='cpu'"]


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
