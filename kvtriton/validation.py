"""Checks shared by the public entry points that validate their input."""

from __future__ import annotations

import numbers

__all__ = ["is_int"]


def is_int(value: object) -> bool:
    """An integer (Python or NumPy), not a bool: ``True`` would silently count as 1 and a float
    such as ``2.0`` would be truncated by an index."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
