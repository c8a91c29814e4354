"""The device every kernel and engine test runs on: one lane per machine, the same test code.

Without CUDA the lane is the CPU, with the Triton kernels in the interpreter (``conftest.py`` sets
``TRITON_INTERPRET=1`` before any kernel module is imported); with a GPU it is ``cuda``. Tests take
it from the ``device`` fixture (``conftest.py``), or import ``DEVICE`` where no fixture reaches
(hypothesis state machines, module-level helpers). A test module opts in with
``pytestmark = pytest.mark.device_lane``: every KV tensor its tests register must then be on the
lane's device (``check_kv_device``, enforced by ``conftest.py``), so a test that builds its KV
tensors on the CPU fails on a GPU box instead of testing the interpreter path twice.
``tests/test_device_lane.py`` checks the sources for hard-coded CPU devices here.

Only torch is imported at module level: the kernel module must not load before the interpreter
switch is set.
"""

from __future__ import annotations

import torch

__all__ = ["DEVICE", "PIN", "check_kv_device", "host_pool", "synchronize"]

DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
# A CUDA copy kernel can only address page-locked host memory; the CPU lane needs none.
PIN = DEVICE.type == "cuda"


def synchronize() -> None:
    """Wait for the work queued on the lane's device (host reads of a pinned pool, comparisons
    of device tensors written on another stream); nothing to wait for on the CPU lane."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def host_pool(num_blocks: int, block_bytes: int):
    """A ``[num_blocks, block_bytes]`` uint8 CPU pool the lane's kernels can address: pinned
    (``cudaHostRegister``) on a GPU box, ordinary memory otherwise. Returns the ``HostPool``
    (``.tensor``, ``.device_ptr``)."""
    from kvtriton.engine import allocate_host_pool

    return allocate_host_pool(num_blocks, block_bytes, pin=PIN)


def check_kv_device(x: torch.Tensor, lane: torch.device = DEVICE) -> None:
    """Fail a device-lane test that registers a KV tensor off the lane's device."""
    if x.device.type != lane.type:
        raise AssertionError(
            f"a device-lane test registered a KV tensor on {x.device}, the lane is {lane}: "
            "build KV tensors on the `device` fixture (or helpers.device_lane.DEVICE)")
