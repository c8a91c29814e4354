"""Admission rules: which keys a store may bring into the CPU tier (``PlannerConfig.admission``).

``"all"`` stores every block the planner selects and needs no rule; the two others hold keys
back and count each one in ``PlannerStats.admission_skipped``.

Second sight (``"second"``, eager stores). A key is admitted once at least two admitted requests
have held it, as SGLang HiCache's ``write_through_selective`` backs up a node on its second hit.
Sightings are counted per key when a request is admitted (saturating at two) and dropped when
the key id is recycled. Every selected block it drops counts as skipped.

Hinted admission (``"hinted"``, lazy mode). A lazy store happens after the turn that computed the
block ended, so the turn's hint is known by then: a key whose last holder finished with
``close`` (its session ended) is not offloaded. A later request that holds the key again, or a
later finish without ``close``, admits it again; the GPU evicting the key forgets it, so the
closed set never holds more keys than the GPU caches. A closed key counts as skipped once, the
first time a walk passes it.
"""

from __future__ import annotations

import numpy as np

from kvtriton.planner.selection import Selection
from kvtriton.planner.stats import PlannerStats
from kvtriton.pool_interface import GpuPool

__all__ = ["HintedAdmission", "SecondSight"]


class SecondSight:
    """Admission on second sight: per key, how many admitted requests held it (saturating)."""

    def __init__(self, stats: PlannerStats) -> None:
        self._stats = stats
        self._sightings = np.zeros(0, dtype=np.uint8)

    def sight(self, keys: np.ndarray) -> None:
        """A request holding ``keys`` (sorted, distinct) was admitted."""
        if not len(keys):
            return
        if int(keys[-1]) >= len(self._sightings):
            grown = np.zeros(max(2 * len(self._sightings), int(keys[-1]) + 1), dtype=np.uint8)
            grown[:len(self._sightings)] = self._sightings
            self._sightings = grown
        seen = self._sightings
        seen[keys] = np.minimum(seen[keys], 1) + 1

    def admitted(self, keys: list[int]) -> np.ndarray:
        """Mask of ``keys`` the rule lets in."""
        k = np.asarray(keys, dtype=np.int64)
        seen = self._sightings
        inside = k < len(seen)
        out = np.zeros(len(k), dtype=bool)
        out[inside] = seen[k[inside]] >= 2
        return out

    def admits(self, key: int) -> bool:
        return bool(self.admitted([key])[0])

    def filter(self, sel: Selection) -> None:
        """Drop the blocks of ``sel`` whose key the rule holds back."""
        keep = self.admitted(sel.keys)
        self._stats.admission_skipped += int(len(keep) - keep.sum())
        sel.take(np.flatnonzero(keep).tolist())

    def forget(self, keys: np.ndarray) -> None:
        """Drop the sightings of recycled keys."""
        if len(keys):
            keys = keys[keys < len(self._sightings)]
            self._sightings[keys] = 0


class HintedAdmission:
    """Hinted admission: the keys whose last holder closed its session. Listens to the GPU
    pool's evictions from construction on."""

    def __init__(self, gpu_pool: GpuPool, stats: PlannerStats) -> None:
        self._gpu_pool = gpu_pool
        self._stats = stats
        # Closed key -> whether a walk already skipped it (counted once in admission_skipped).
        self._closed: dict[int, bool] = {}
        gpu_pool.add_listener(None, self._on_gpu_evict)

    def refuses(self, key: int) -> bool:
        """Whether ``key`` is held back (counted the first time it is)."""
        closed = self._closed
        if closed and key in closed:
            if not closed[key]:
                closed[key] = True
                self._stats.admission_skipped += 1
            return True
        return False

    def note_admitted(self, keys: np.ndarray) -> None:
        """A request holding ``keys`` was admitted: they have a holder again."""
        if self._closed:
            closed = self._closed
            for k in np.unique(keys).tolist():
                closed.pop(k, None)

    def note_finished(self, keys: np.ndarray, hint: str | None) -> None:
        """A request that held ``keys`` (its computed blocks) finished with ``hint``: ``close``
        marks the ones the GPU caches as not to be offloaded, any other hint admits them
        again."""
        closed, gpu_pool = self._closed, self._gpu_pool
        if hint == "close":
            for k in np.unique(keys).tolist():
                if k in gpu_pool:
                    closed.setdefault(k, False)
        elif closed:
            for k in np.unique(keys).tolist():
                closed.pop(k, None)

    @property
    def num_closed(self) -> int:
        """Keys held back (at most the keys the GPU caches)."""
        return len(self._closed)

    def _on_gpu_evict(self, key: int, block: int) -> None:
        if self._closed:
            self._closed.pop(key, None)
