"""Errors of the simulator that callers catch without importing the parts that raise them (the
integrity checker pulls in torch's transfer engine and Triton)."""

from __future__ import annotations

__all__ = ["IntegrityError"]


class IntegrityError(RuntimeError):
    """A block holds bytes other than its key's: after a load, or when it is registered under
    a key in the GPU prefix cache or the CPU tier."""
