"""Checks shared by the public entry points that validate their input."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["block_id_array", "check_block_ids", "check_request_keys", "host_memory_bytes",
           "is_finite_number", "is_int"]


def host_memory_bytes() -> int:
    """This machine's physical memory, bytes: the bound of every size a setting may ask for."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: ``True`` would silently count as 1 and a float
    such as ``2.0`` would be truncated by an index."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A finite int or float, not a bool; False (not ``OverflowError``) for an int too large for
    a float."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def check_block_ids(ids: Sequence[int] | np.ndarray, num_blocks: int, what: str) -> None:
    """``ValueError`` naming ``what`` and a bad id unless ``ids`` is a list, tuple or 1-D integer
    array of block ids in ``[0, num_blocks)`` (the null block allowed).

    No Python-level loop over the ids: a list is checked by the set of its element types (ints
    only: a bool or a float is refused, not truncated) and its ``min``/``max``, an array by its
    dtype and its ``min``/``max``.
    """
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise ValueError(f"{what}: expected a 1-D array of integer block ids, got dtype "
                             f"{ids.dtype} and shape {ids.shape}")
        if not ids.size:
            return
        lo, hi = ids.min().item(), ids.max().item()
    elif isinstance(ids, list | tuple):
        if not ids:
            return
        if set(map(type, ids)) - _INT:  # NumPy ints pass; anything else is named
            bad = next((b for b in ids if not is_int(b)), None)
            if bad is not None:
                raise ValueError(f"{what}: block id {bad!r} is not an int")
        lo, hi = min(ids), max(ids)
    else:
        raise ValueError(f"{what}: expected a list of block ids, got {type(ids).__name__}")
    if lo < 0 or hi >= num_blocks:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{what}: block id {bad!r} out of range [0, {num_blocks})")


def block_id_array(ids: Sequence[int] | np.ndarray, num_blocks: int, what: str) -> np.ndarray:
    """``ids`` checked by ``check_block_ids``, as an int64 array."""
    check_block_ids(ids, num_blocks, what)
    return np.asarray(ids, dtype=np.int64) if len(ids) else np.zeros(0, dtype=np.int64)


def check_request_keys(rid: str, keys: Any) -> None:
    """``ValueError`` unless ``keys`` is a 2-D int64 array of key ids >= 0: keys index the pools'
    and the planner's per-key arrays, where a negative one would wrap to another key's entry."""
    if not isinstance(keys, np.ndarray) or keys.dtype != np.int64 or keys.ndim != 2:
        got = (f"dtype {keys.dtype}, shape {keys.shape}" if isinstance(keys, np.ndarray)
               else type(keys).__name__)
        raise ValueError(f"request {rid!r}: keys must be an int64 array [groups, n], got {got}")
    if keys.size and (low := int(keys.min())) < 0:
        g, j = np.argwhere(keys == low)[0].tolist()
        raise ValueError(f"request {rid!r}: keys must be non-negative ids, got {low} "
                         f"(group {g}, position {j})")


_INT = {int}
