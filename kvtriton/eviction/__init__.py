"""Eviction queues: which free block a ``BlockPool`` hands out next.

The registry of the queues a pool is built with by name (``EVICTION_QUEUES``,
``make_eviction_queue``). The protocol and the building blocks the queues share live in
``base``; one algorithm per module: ``lru``, ``arc``, ``s3fifo``, ``lfu`` (demand counted
over admitted requests, least-demanded first), ``request_lru`` (``reqlru``: vLLM 0.33's
offloading LRU, recency given by requests) and ``request_arc`` (``reqarc``: vLLM 0.33's
offloading ARC, a request's use counted at its finish), both on the skeleton in
``request_scoped`` (``RequestScopedQueue``); ``protected`` wraps any of them with the drop and
protected segments of continuation hints and the waiting-queue lookahead (``HintedQueue``).
"""

from kvtriton.eviction.arc import ARCQueue
from kvtriton.eviction.base import EvictionQueue
from kvtriton.eviction.lfu import LFUQueue
from kvtriton.eviction.lru import LRUQueue
from kvtriton.eviction.protected import CLOSED, NORMAL, PROTECTED, HintedQueue
from kvtriton.eviction.request_arc import RequestARCQueue
from kvtriton.eviction.request_lru import RequestLRUQueue
from kvtriton.eviction.request_scoped import RequestScopedQueue
from kvtriton.eviction.s3fifo import S3FIFOQueue

__all__ = [
    "CLOSED",
    "EVICTION_QUEUES",
    "NORMAL",
    "PROTECTED",
    "ARCQueue",
    "EvictionQueue",
    "HintedQueue",
    "LFUQueue",
    "LRUQueue",
    "RequestARCQueue",
    "RequestLRUQueue",
    "RequestScopedQueue",
    "S3FIFOQueue",
    "make_eviction_queue",
]

EVICTION_QUEUES: dict[str, type[EvictionQueue]] = {
    "lru": LRUQueue,
    "arc": ARCQueue,
    "s3fifo": S3FIFOQueue,
    "lfu": LFUQueue,
    "reqlru": RequestLRUQueue,
    "reqarc": RequestARCQueue,
}


#: Queues whose name may carry one number, ``name:X`` (``lfu:W``: the sketch's aging window).
PARAMETRIZED = ("lfu",)


def make_eviction_queue(name: str) -> EvictionQueue:
    """A fresh eviction queue by name (``lru`` and any registered in ``EVICTION_QUEUES``;
    ``lfu:W`` is ``LFUQueue(W)``)."""
    head, colon, arg = name.partition(":")
    if head not in EVICTION_QUEUES or (colon and head not in PARAMETRIZED):
        raise ValueError(f"unknown eviction {name!r}; known: {sorted(EVICTION_QUEUES)}, "
                         f"and {', '.join(p + ':W' for p in PARAMETRIZED)}")
    if not colon:
        return EVICTION_QUEUES[head]()
    try:
        value = float(arg)
    except ValueError:
        raise ValueError(f"eviction {name!r}: {arg!r} is not a number") from None
    return EVICTION_QUEUES[head](value)
