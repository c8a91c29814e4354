"""Test configuration: the CPU lane runs Triton kernels in the interpreter.

``TRITON_INTERPRET`` must be set before any module that defines a ``@triton.jit`` kernel is
imported, so it is set here, at the top of the first file pytest loads. Kernel and engine tests
take their device from the ``device`` fixture (``helpers.device_lane.DEVICE``: the CPU here, CUDA
on a GPU box); modules marked ``device_lane`` have every registered KV tensor checked against it.
"""

import importlib.util
import os
import runpy
import sys
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every pin the connector keeps apart from vLLM's counts is checked to be on a block vLLM holds,
# in this process and in the engines tests start (kvtriton.vllm.gpu_pool.VllmGpuPool.pin_held).
os.environ.setdefault("KVTRITON_CHECK_HELD_PINS", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVTRITON_HYPOTHESIS_PROFILE", "ci"))

# ``tests`` is on ``sys.path`` (pytest's ``pythonpath``, for ``helpers``), so without vLLM installed
# ``import vllm`` would find the ``tests/vllm`` folder as a namespace package: no test would skip
# and kvtriton would think vLLM is there. A ``None`` entry makes the import fail as a missing vLLM
# does; an installed vLLM (a regular package, with an ``__init__.py``) is found first and kept.
_vllm = importlib.util.find_spec("vllm")
if _vllm is not None and _vllm.origin is None:
    sys.modules["vllm"] = None


def pytest_terminal_summary(terminalreporter):
    """Name the vLLM release the run found (``make test`` runs the scheduler-role tests on two),
    read from its ``_version.py`` without importing vLLM."""
    if _vllm is None or _vllm.origin is None:
        return
    where = Path(_vllm.origin).parent
    if (where / "_version.py").exists():
        version = runpy.run_path(str(where / "_version.py")).get("__version__", "unknown")
        terminalreporter.write_line(f"vLLM {version} from {where}")


@pytest.fixture
def device():
    """The lane's device: ``cpu`` (Triton interpreter) without CUDA, ``cuda`` with it."""
    from helpers.device_lane import DEVICE

    return DEVICE


@pytest.fixture(autouse=True)
def _kv_on_lane_device(request, monkeypatch):
    """In ``device_lane`` modules, every KV tensor registered (``segment_views``) must be on the
    lane's device: a test that hard-codes CPU tensors fails on a GPU box."""
    if request.node.get_closest_marker("device_lane") is None:
        yield
        return
    import functools

    import kvtriton.engine.descriptors as descriptors
    from helpers.device_lane import check_kv_device

    real = descriptors._block_bytes_view

    @functools.wraps(real)
    def checked(name, x, nbytes):
        check_kv_device(x)
        return real(name, x, nbytes)

    monkeypatch.setattr(descriptors, "_block_bytes_view", checked)
    yield


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fixed_seed():
    import random

    import numpy as np
    import torch

    random.seed(0)
    np.random.seed(0)  # noqa: NPY002 - the legacy global RNG, for code that still uses it
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """The tiny Llama with random weights (``bench.vllm.engine_run.tiny_llama``'s defaults), for
    the tests that run vLLM's engine; built once per worker process. The caller skips without
    ``transformers`` (``pytest.importorskip``): it is imported here only when asked for."""
    from bench.vllm.engine_run import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama-weights"))


@pytest.fixture(scope="session")
def model_config_dir(tmp_path_factory):
    """A tiny Llama's ``config.json`` alone, no weights (``max_model_len`` 8192): what the tests
    that drive vLLM's ``Scheduler`` without an engine build its configs from."""
    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-config"), 8192)
