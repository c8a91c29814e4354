"""Worker side: the ``TransferEngine`` (descriptor tables, pinned CPU pool, streams, events)."""

from kvtriton.engine.descriptors import allocate_kv_caches, build_copy_table, segment_views
from kvtriton.engine.host_memory import HostPool, allocate_host_pool
from kvtriton.engine.transfer import BACKENDS, TransferEngine

__all__ = [
    "BACKENDS",
    "HostPool",
    "TransferEngine",
    "allocate_host_pool",
    "allocate_kv_caches",
    "build_copy_table",
    "segment_views",
]
