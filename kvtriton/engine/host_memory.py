"""The CPU pool's memory: page-aligned, exactly sized, pinned with ``cudaHostRegister`` under CUDA.

PyTorch's pinned allocator rounds every request up to a power of two (a 300 GiB pool would pin
512 GiB), so the pool is an anonymous ``mmap`` (page-aligned, zero-filled lazily by the kernel)
registered with CUDA in place. Without CUDA it stays ordinary memory.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from dataclasses import dataclass

import torch

from kvtriton.validation import is_int

__all__ = ["HostPool", "allocate_host_pool"]

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2


@dataclass(slots=True)
class HostPool:
    """``tensor`` ``[num_blocks, block_bytes]`` uint8; ``device_ptr`` the address a CUDA kernel
    uses for it (the host address without CUDA); ``pinned`` whether it is registered."""

    tensor: torch.Tensor
    device_ptr: int
    pinned: bool
    _release: weakref.finalize

    def close(self) -> None:
        """Unregister the memory from CUDA now (it stays readable from the host)."""
        self._release()


def _cudart_library():
    """The CUDA runtime torch already loaded, for the calls ``torch.cuda.cudart()`` lacks."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _device_pointer(host_ptr: int) -> int:
    lib = _cudart_library()
    if lib is None:
        log.debug("libcudart not found; using the host address as the device address (UVA)")
        return host_ptr
    dev = ctypes.c_void_p()
    err = lib.cudaHostGetDevicePointer(ctypes.byref(dev), ctypes.c_void_p(host_ptr), 0)
    if err != 0 or dev.value is None:
        raise RuntimeError(f"cudaHostGetDevicePointer failed with error {err}")
    return int(dev.value)


def _unregister(ptr: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        log.warning("cudaHostUnregister(%#x) failed with error %s", ptr, err)


def allocate_host_pool(num_blocks: int, block_bytes: int, *, pin: bool) -> HostPool:
    """Allocate a ``[num_blocks, block_bytes]`` uint8 pool of exactly that many bytes, zeroed,
    page-aligned; with ``pin``, page-locked in place and mapped for the GPU."""
    for name, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    nbytes = num_blocks * block_bytes
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buf, dtype=torch.uint8).view(num_blocks, block_bytes)
    ptr = tensor.data_ptr()
    if not pin:
        return HostPool(tensor, ptr, False, weakref.finalize(tensor, lambda: None))
    err = torch.cuda.cudart().cudaHostRegister(
        ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed with error "
                           f"{err}")
    release = weakref.finalize(tensor, _unregister, ptr)
    return HostPool(tensor, _device_pointer(ptr), True, release)
