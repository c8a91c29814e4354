"""Test configuration: the CPU lane runs Triton kernels in the interpreter.

``TRITON_INTERPRET`` must be set before any module that defines a ``@triton.jit`` kernel is
imported, so it is set here, at the top of the first file pytest loads. Kernel and engine tests
take their device from the ``device`` fixture (``device_lane.DEVICE``: the CPU here, CUDA on a
GPU box); modules marked ``device_lane`` have every registered KV tensor checked against it.
"""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - torch is a hard dependency
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("long", max_examples=2000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVTRITON_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def device():
    """The lane's device: ``cpu`` (Triton interpreter) without CUDA, ``cuda`` with it."""
    from device_lane import DEVICE

    return DEVICE


@pytest.fixture(autouse=True)
def _kv_on_lane_device(request, monkeypatch):
    """In ``device_lane`` modules, every KV tensor registered (``segment_views``) must be on the
    lane's device: a test that hard-codes CPU tensors fails on a GPU box."""
    if request.node.get_closest_marker("device_lane") is None:
        yield
        return
    import functools

    from device_lane import check_kv_device

    import kvtriton.engine.descriptors as descriptors

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
