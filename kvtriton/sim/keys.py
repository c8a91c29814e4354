"""Dense key ids for a whole workload at once.

Every request's chain hashes become per-group keys (``kvtriton.hashing.group_key``, vectorized
here) and the keys of the whole workload are interned together with one ``np.unique``, so a
simulation indexes every array by small dense ints and pays the interning once.
"""

from __future__ import annotations

import numpy as np

from kvtriton.sim.workload import Workload
from kvtriton.specs import KVLayout

__all__ = ["group_keys_array", "workload_keys"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def group_keys_array(hashes: np.ndarray, group: int) -> np.ndarray:
    """``group_key(h, group)`` for every ``h`` of a uint64 array."""
    with np.errstate(over="ignore"):
        salt = _GOLDEN * np.uint64(group + 1)
        return _mix64(np.asarray(hashes, dtype=np.uint64) ^ salt)


def workload_keys(layout: KVLayout, workload: Workload) -> tuple[list[np.ndarray], int]:
    """Per request, dense key ids ``[num_groups, len(hashes)]`` (int64); and how many distinct
    keys there are."""
    if workload.hash_block_size != layout.hash_block_size:
        raise ValueError(f"workload hash_block_size={workload.hash_block_size} differs from "
                         f"the layout's {layout.hash_block_size}")
    lens = np.array([len(r.hashes) for r in workload], dtype=np.int64)
    flat = np.concatenate([r.hashes for r in workload]) if len(workload) else np.zeros(
        0, dtype=np.uint64)
    per_group = np.stack([group_keys_array(flat, g) for g in range(layout.num_groups)])
    uniq, inverse = np.unique(per_group.ravel(), return_inverse=True)
    ids = inverse.reshape(per_group.shape).astype(np.int64)
    out, start = [], 0
    for n in lens.tolist():
        out.append(np.ascontiguousarray(ids[:, start:start + n]))
        start += n
    return out, len(uniq)
