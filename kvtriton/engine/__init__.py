"""Worker side: the ``TransferEngine`` (descriptor tables, pinned CPU pool, streams, events)."""

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
