"""Worker side: the ``TransferEngine`` (descriptor tables, pinned CPU pool, streams, events).

The names below load their module on first use (PEP 562): importing the package, or one module
of it such as ``host_memory``, does not load the Triton kernel that ``descriptors`` and
``transfer`` import.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtriton.engine.copy_engine import COPY_ENGINE_MAX_PIECES, COPY_ENGINE_MIN_PIECE_BYTES
    from kvtriton.engine.descriptors import allocate_kv_caches, build_copy_table, segment_views
    from kvtriton.engine.host_memory import HostPool, allocate_host_pool
    from kvtriton.engine.transfer import BACKENDS, TransferEngine

__all__ = [
    "BACKENDS",
    "COPY_ENGINE_MAX_PIECES",
    "COPY_ENGINE_MIN_PIECE_BYTES",
    "HostPool",
    "TransferEngine",
    "allocate_host_pool",
    "allocate_kv_caches",
    "build_copy_table",
    "segment_views",
]

# Public name -> the module of this package that defines it.
_HOMES = {
    "BACKENDS": "transfer",
    "COPY_ENGINE_MAX_PIECES": "copy_engine",
    "COPY_ENGINE_MIN_PIECE_BYTES": "copy_engine",
    "HostPool": "host_memory",
    "TransferEngine": "transfer",
    "allocate_host_pool": "host_memory",
    "allocate_kv_caches": "descriptors",
    "build_copy_table": "descriptors",
    "segment_views": "descriptors",
}


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
