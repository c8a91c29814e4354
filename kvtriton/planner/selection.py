"""The contract of an eager store selector, shared by the fused scan and the loop reference.

A selector owns the per-request block tables and cursors of the positional groups (full
attention, sliding window) and decides, once per step, which GPU blocks to copy to the CPU.

Semantics (both implementations follow them exactly; tests compare them on random schedules):

- Keys: position p of group g in a request is the group block ending at token
  ``(p + 1) * block_size_g``; its key is the request's primary key there. A request *owns* the
  keys of all its positions from admission to release.
- Wanted: a key the CPU evicted while some request owned it (or whose store failed or was
  abandoned) is *wanted* until it is stored again, becomes present in the CPU, or is owned by
  no request.
- Thrash: a selected re-store of a key that was re-stored before.

Each pass runs four phases, in this order:

- Candidates, in (scan rank, group, position) order: for each scanned row and group, positions
  ``[cursor, ready)`` ("new") and, with re-store on, positions below the cursor whose key is
  wanted ("re-store"). Source block: the table entry; a null entry of a sliding-window group is
  recovered from the GPU prefix cache by key when a block there still holds it.
- Classify, first match wins: ``null`` (no source), ``not_hashed`` (the source does not hold the
  key), ``in_flight`` (source block or key already being stored), ``already_cached`` (key
  present in the CPU), ``duplicate`` (key met earlier in this pass).
- Budget, in candidate order: ``restore_capped`` (per-key or per-step re-store bound),
  ``deferred`` (no CPU block left in the budget), else selected.
- Cursor: stays where it is if the budget was spent before the pass reached the (row, group)
  (vLLM's scan stops there too: the positions it would pass are looked at again next step);
  else the first position at or past the old cursor that was ``deferred``, or a duplicate whose
  first occurrence was not selected; else ``ready``. Never moves backwards.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from kvtriton.planner.stats import ScanOutcomes

__all__ = ["Selection", "StoreSelector"]


@dataclass(slots=True)
class Selection:
    """The blocks one scan selected, in (scan rank, group, position) order. ``rows``,
    ``positions`` and ``restore`` may be arrays (the fused scan leaves them so)."""

    rows: list[int] | np.ndarray = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    positions: list[int] | np.ndarray = field(default_factory=list)
    gpu_blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    restore: list[bool] | np.ndarray = field(default_factory=list)
    outcomes: ScanOutcomes = field(default_factory=ScanOutcomes)
    thrash: int = 0
    #: ``gpu_blocks`` and ``keys`` as int64 arrays too, when the selector had them (the fused
    #: scan): the planner pins and flags the batch from them without converting back.
    arrays: tuple[np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.gpu_blocks)

    def take(self, indices: list[int]) -> None:
        """Keep only the selected blocks at ``indices``, in that order (outcomes unchanged)."""
        for name in ("rows", "groups", "positions", "gpu_blocks", "keys", "restore"):
            col = getattr(self, name)
            setattr(self, name, col[np.asarray(indices, dtype=np.int64)]
                    if isinstance(col, np.ndarray) else [col[i] for i in indices])
        self.arrays = None


class StoreSelector(ABC):
    """Per-request tables, cursors, ownership and wanted keys, plus the per-step selection."""

    #: CPU evictions of keys owned by a running request (counted when they happen).
    running_evictions: int
    #: Keys owned by a running request that the CPU holds now.
    running_present: int

    @abstractmethod
    def admit(self, row: int, primary_keys: list[np.ndarray]) -> None:
        """Start tracking ``row`` whose group g has primary keys ``primary_keys[g]`` by position
        (empty for groups that are not positional)."""

    @abstractmethod
    def release(self, row: int) -> None:
        """Stop tracking ``row``: drop its table, cursors and ownership."""

    @abstractmethod
    def append_blocks(self, row: int, group: int, block_ids: list[int]) -> None:
        """Append GPU blocks to the row's table for ``group``."""

    @abstractmethod
    def table(self, row: int, group: int) -> list[int]:
        ...

    @abstractmethod
    def cursor(self, row: int, group: int) -> int:
        ...

    @abstractmethod
    def on_cpu_insert(self, key: int, block: int) -> None:
        ...

    @abstractmethod
    def on_cpu_evict(self, key: int, block: int) -> None:
        ...

    @abstractmethod
    def on_gpu_insert(self, key: int, block: int) -> None:
        ...

    @abstractmethod
    def on_gpu_evict(self, key: int, block: int) -> None:
        ...

    #: Whether the pools should call the ``*_many`` listeners below (once per pool call, after
    #: it) instead of the per-key ones (once per key, as each block changes). The loop
    #: reference keeps the per-key ones: it is what the batched path is checked against. The
    #: ``*_many`` defaults replay a batch through the per-key listeners.
    batch_listeners = False

    def on_cpu_insert_many(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Every (key, block) a CPU pool call made hittable, after the call."""
        for key, block in zip(keys.tolist(), blocks.tolist(), strict=True):
            self.on_cpu_insert(key, block)

    def on_cpu_evict_many(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Every (key, block) a CPU pool call dropped, after the call."""
        for key, block in zip(keys.tolist(), blocks.tolist(), strict=True):
            self.on_cpu_evict(key, block)

    def on_gpu_insert_many(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Every (key, block) a GPU pool call made hittable, after the call."""
        for key, block in zip(keys.tolist(), blocks.tolist(), strict=True):
            self.on_gpu_insert(key, block)

    def on_gpu_evict_many(self, keys: np.ndarray, blocks: np.ndarray) -> None:
        """Every (key, block) a GPU pool call dropped, after the call."""
        for key, block in zip(keys.tolist(), blocks.tolist(), strict=True):
            self.on_gpu_evict(key, block)

    def append_blocks_many(self, group: int, rows: list[int], block_ids: list[list[int]]
                           ) -> np.ndarray:
        """``append_blocks(rows[i], group, block_ids[i])`` for every i (one step's new blocks);
        returns ``len(block_ids[i])`` for every i (int64)."""
        for row, ids in zip(rows, block_ids, strict=True):
            self.append_blocks(row, group, ids)
        return np.fromiter(map(len, block_ids), dtype=np.int64, count=len(block_ids))

    @abstractmethod
    def set_in_flight(self, gpu_blocks: list[int], keys: list[int], value: bool) -> None:
        ...

    @abstractmethod
    def in_flight(self, gpu_block: int, key: int) -> bool:
        ...

    @abstractmethod
    def in_flight_flags(self) -> tuple[set[int], set[int]]:
        """The GPU blocks and the keys flagged in flight now."""

    @abstractmethod
    def want(self, keys: list[int]) -> None:
        """Mark keys whose store failed or was abandoned as wanted (if owned)."""

    @abstractmethod
    def wanted_below_cursor(self, row: int, group: int) -> list[int]:
        """Positions below the cursor of ``row`` whose key is wanted (for a finish flush)."""

    @property
    @abstractmethod
    def key_slots(self) -> int:
        """Per-key entries held now: the length of the per-key arrays (fused scan), or of the
        per-key dicts (loop reference). What grows with the key ids a caller hands out."""

    @abstractmethod
    def referenced_keys(self) -> np.ndarray:
        """Keys the selector's state refers to: owned by a row, flagged in flight, wanted."""

    @abstractmethod
    def forget_keys(self, keys: np.ndarray) -> None:
        """``keys`` (not referenced, in neither pool) will name other blocks: drop what is
        remembered of them (re-store counts)."""

    @abstractmethod
    def select(self, rows: list[int], ready: np.ndarray, budget: int,
               restore_budget: int | None) -> Selection:
        """One scan. ``rows`` in scan order, ``ready[i, g]`` the confirmed positions of
        ``rows[i]`` in group g, ``budget`` the CPU blocks available, ``restore_budget`` the
        re-store cap for this step (None: none)."""

    @abstractmethod
    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise ``AssertionError`` if the selector's books are inconsistent: ownership counts
        equal to the held rows' keys, ``running_present`` equal to the owned keys the CPU holds,
        wanted keys owned and absent from the CPU, cursors within their tables. With ``idle``,
        also if it holds any row, in-flight flag or wanted key."""
