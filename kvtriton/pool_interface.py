"""What a block pool shows its users: listener signatures, the events it records, ``GpuPool``.

Kept apart from ``BlockPool`` (``kvtriton.pool``) because they are not one pool's: the planner
types its GPU pool as ``GpuPool``, which ``BlockPool`` and vLLM's pool (through
``kvtriton.vllm.gpu_pool.VllmGpuPool``) both serve, and the connector reads the events to turn
them into vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["AllBlocksCleared", "BatchCallback", "BlockRemoved", "BlockStored", "GpuPool",
           "KeyCallback", "PoolListeners"]

KeyCallback = Callable[[int, int], None]
#: ``(keys, block_ids)``: int64 arrays of the same length, pair i is one (key, block).
BatchCallback = Callable[[np.ndarray, np.ndarray], None]


class PoolListeners:
    """The listeners of a pool's keys, kept alike by kvtriton's ``BlockPool`` and the adapter
    over vLLM's (``kvtriton.vllm.gpu_pool``): per (key, block) callbacks, and per pool call
    callbacks with every pair it made hittable or dropped."""

    def _init_listeners(self) -> None:
        self._on_insert: list[KeyCallback] = []
        self._on_evict: list[KeyCallback] = []
        self._on_insert_many: list[BatchCallback] = []
        self._on_evict_many: list[BatchCallback] = []

    def add_listener(self, on_insert: KeyCallback | None = None,
                     on_evict: KeyCallback | None = None) -> None:
        """Call ``on_insert(key, block)`` / ``on_evict(key, block)`` for every pair made
        hittable / dropped."""
        if on_insert is not None:
            self._on_insert.append(on_insert)
        if on_evict is not None:
            self._on_evict.append(on_evict)

    def add_batch_listener(self, on_insert_many: BatchCallback | None = None,
                           on_evict_many: BatchCallback | None = None) -> None:
        """Call ``on_insert_many(keys, block_ids)`` / ``on_evict_many(keys, block_ids)`` once per
        pool call, after it, with every (key, block) pair it made hittable / dropped (int64
        arrays; a key may repeat when several blocks held it)."""
        if on_insert_many is not None:
            self._on_insert_many.append(on_insert_many)
        if on_evict_many is not None:
            self._on_evict_many.append(on_evict_many)


class GpuPool(Protocol):
    """What the planner (``kvtriton.planner``) uses of the scheduler's GPU pool: ``BlockPool``
    and vLLM's pool seen through ``kvtriton.vllm.gpu_pool.VllmGpuPool`` both serve it.

    Lazy mode on a layout of several groups also needs ``block_group(block_id) -> int | None``
    (the group a block was cached for); the planner looks it up and refuses a pool without it
    there, so it is not a member here.
    """

    #: Blocks in the pool, the null block 0 included: block ids are ``[0, num_blocks)``.
    num_blocks: int
    #: References per block id; 0: free.
    ref_cnt: Sequence[int]

    def add_listener(self, on_insert: KeyCallback | None = None,
                     on_evict: KeyCallback | None = None) -> None:
        """Call ``on_insert(key, block_id)`` / ``on_evict(key, block_id)`` for every key that
        becomes hittable / stops being hittable."""
        ...

    def block_hash(self, block_id: int) -> int | None:
        """The primary key of ``block_id``, or None if it is unhashed."""
        ...

    def block_keys(self, block_id: int) -> Sequence[int]:
        """Every key ``block_id`` is registered under, primary first (empty if unhashed)."""
        ...

    def get_cached_block(self, key: int) -> int | None:
        """A block registered under ``key``, or None."""
        ...

    def __contains__(self, key: int) -> bool:
        """Whether a block is registered under ``key``."""
        ...

    def iter_free(self, after: int | None = None) -> Iterator[int]:
        """Free blocks in eviction order (next victim first), past ``after`` if it is free."""
        ...

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one reference on each block (pins; a free block leaves the free queue)."""
        ...

    def pin_held(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """``touch`` of blocks the caller knows a running request references now (its
        full-attention table): a pool may keep such pins apart from its own count until that
        reference is dropped (``VllmGpuPool``)."""
        ...

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in order."""
        ...


@dataclass(slots=True)
class BlockStored:
    """A block became hittable under ``block_hashes`` (fields as in vLLM's kv_events)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class BlockRemoved:
    """``block_hashes`` are no longer hittable in ``medium``."""

    block_hashes: list[int]
    medium: str | None


@dataclass(slots=True)
class AllBlocksCleared:
    medium: str | None
