"""Dense key ids for a whole workload at once.

Every request's chain hashes become per-group keys (``kvtriton.hashing.group_keys_array``) and
the keys of the whole workload are interned together with one ``np.unique``, so a simulation
indexes every array by small dense ints and pays the interning once.
"""

from __future__ import annotations

import numpy as np

from kvtriton.hashing import group_keys_array
from kvtriton.sim.workload import Workload
from kvtriton.specs import KVLayout

__all__ = ["workload_keys"]


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
