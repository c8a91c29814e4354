"""A step's copy pairs and the table they are checked against, shared by every backend.

A store (GPU -> CPU) or load (CPU -> GPU) is a list of pairs ``(gpu_block, cpu_block, group)``.
``validate_pairs`` checks them once per step against the engine's ``CopyTable`` (which bounds
each group's GPU ids) and the CPU pool's size, whichever backend then moves them: the Triton
kernel (``kvtriton.kernels.copy_blocks``, which reads the table's descriptor rows), the copy
engine or the torch path. It lives beside the kernel so that ``kvtriton.kernels`` imports
nothing of ``kvtriton.engine``, which imports the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["CopyTable", "validate_pairs"]


@dataclass(frozen=True, slots=True)
class CopyTable:
    """The static tables of one engine, on the GPU tensors' device (their format is described in
    ``kvtriton.kernels.copy_blocks``): ``rows`` ``[R, 5]`` and ``units`` ``[U, 3]`` int64.

    ``group_units_host`` ``[len(WIDTHS), G, 2]`` is the kernel's ``group_units`` on the host, so a
    launch needs no device read; ``num_gpu_blocks[g]`` bounds group g's GPU ids;
    ``cpu_block_bytes`` is the pool's row pitch in bytes.
    """

    rows: torch.Tensor
    units: torch.Tensor
    group_units_host: np.ndarray
    num_gpu_blocks: tuple[int, ...]
    cpu_block_bytes: int
    device: torch.device

    @property
    def num_groups(self) -> int:
        return len(self.num_gpu_blocks)


def _as_ids(name: str, values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"{name} must be host (CPU) ids, got a tensor on {values.device}")
        values = values.numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _check_range(name: str, ids: np.ndarray, upper: int) -> None:
    bad = (ids < 0) | (ids >= upper)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name}[{i}]={int(ids[i])} is out of range [0, {upper})")


def validate_pairs(table: CopyTable, num_cpu_blocks: int, direction: str,
                   gpu_blocks, cpu_blocks, groups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check one step's pairs against ``table`` and return them as int64 arrays.

    Raises ``ValueError`` naming the bad value: unequal lengths, a group or block id out of
    range, or a destination written twice (a store's CPU block, a load's (group, GPU block)).
    """
    if direction not in ("store", "load"):
        raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
    gpu = _as_ids("gpu_blocks", gpu_blocks)
    cpu = _as_ids("cpu_blocks", cpu_blocks)
    grp = _as_ids("groups", groups)
    if not len(gpu) == len(cpu) == len(grp):
        raise ValueError(f"gpu_blocks, cpu_blocks and groups must have equal lengths, got "
                         f"{len(gpu)}, {len(cpu)} and {len(grp)}")
    if len(gpu) == 0:
        return gpu, cpu, grp
    _check_range("groups", grp, table.num_groups)
    limits = np.asarray(table.num_gpu_blocks, dtype=np.int64)[grp]
    bad = (gpu < 0) | (gpu >= limits)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"gpu_blocks[{i}]={int(gpu[i])} is out of range [0, {int(limits[i])}) "
                         f"for group {int(grp[i])}")
    _check_range("cpu_blocks", cpu, num_cpu_blocks)
    # A destination written twice in one launch is a race between programs: refuse it.
    dest = cpu if direction == "store" else grp * (int(limits.max()) + 1) + gpu
    _, first, counts = np.unique(dest, return_index=True, return_counts=True)
    if (counts > 1).any():
        i = int(first[np.flatnonzero(counts > 1)[0]])
        what = (f"cpu_blocks[{i}]={int(cpu[i])}" if direction == "store"
                else f"gpu_blocks[{i}]={int(gpu[i])} (group {int(grp[i])})")
        raise ValueError(f"{direction}: destination {what} appears more than once")
    return gpu, cpu, grp
