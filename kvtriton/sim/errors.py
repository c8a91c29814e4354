"""Errors of the simulator that callers catch without importing the parts that raise them (the
integrity checker pulls in torch's transfer engine and Triton)."""

from __future__ import annotations

__all__ = ["IntegrityError", "UncleanEndError"]


class IntegrityError(RuntimeError):
    """A block holds bytes other than its key's, or was registered under a key that nothing
    wrote into it: found after a load, or as it is registered in the GPU prefix cache or the
    CPU tier."""


class UncleanEndError(RuntimeError):
    """A simulation ended with a request, a pending planner transfer or a held block left: a bug
    in the scheduler or the planner, not in the input."""
