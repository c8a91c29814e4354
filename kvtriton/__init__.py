"""kvtriton: a CPU tier for an LLM server's KV cache.

Public names: the block model (``BlockPool``, ``HashIndex``, ``KVLayout`` and the group specs),
the scheduler-side ``OffloadPlanner``, the worker-side ``TransferEngine`` and the simulator's
``simulate``. Heavy submodules are imported on first use, so ``import kvtriton`` stays cheap.
"""

from kvtriton.hashing import HashIndex, chain_hashes, group_key
from kvtriton.lookup import Hit, find_longest_hit
from kvtriton.pool import BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec, preset

__version__ = "0.1.0"

_LAZY = {
    "OffloadPlanner": "kvtriton.planner",
    "PlannerConfig": "kvtriton.planner",
    "Request": "kvtriton.planner",
    "StepOutput": "kvtriton.planner",
    "TransferEngine": "kvtriton.engine",
    "simulate": "kvtriton.sim",
}

__all__ = [
    "BlockPool",
    "FullAttentionSpec",
    "HashIndex",
    "Hit",
    "KVLayout",
    "MambaSpec",
    "SlidingWindowSpec",
    "chain_hashes",
    "find_longest_hit",
    "group_key",
    "preset",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvtriton' has no attribute {name!r}")
