"""Checks shared by the public entry points that validate their input."""

from __future__ import annotations

import math
import numbers

__all__ = ["is_finite_number", "is_int"]


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
