"""Frequency-first eviction: a TinyLFU-style sketch of demand, the least-demanded block first.

Demand is counted where a server sees all of it: every request the planner admits counts each
distinct key of its prompt once (``on_request``), whether the block is then a GPU hit, a CPU hit
or computed. The CPU tier's own hits would not show it (a popular block is mostly hit on the
GPU). Why frequency should help on chat-like traffic, and where it loses to recency, is the
studies' (``bench/tier_study/conversational_gap.py``, ``bench/tier_study/lfu_recency.py``).

``FrequencySketch``: a count-min sketch (``depth`` rows of ``width`` saturating counters,
TinyLFU's estimator) with aging: once it has counted ``window`` sightings, every counter is
halved (TinyLFU's reset), so that demand that stopped fades. Units: a sighting is one (admitted
request, distinct key) pair; ``window`` is in sightings.

Memory: ``depth`` bytes per counter column; the width is the window in sightings (at least 8
per tier block) rounded up to a power of two, so ``lfu:W`` costs 4 max(W, 8) to 8 max(W, 8) bytes
per tier block (64 to 128 at the default W = 16), a window of W tier sizes needing W tier sizes of
counters. ``LFUQueue.memory_bytes`` says how much for a pool before it is built: the connector's
and the simulator's host-memory checks count it (``lfu:4096`` on an 8 GiB tier of a small model
is a 4 GiB sketch).

``LFUQueue``: the free blocks ordered by the sketch's estimate of their key's demand, lowest
first; among equals the one freed longest ago (LRU). Unhashed blocks go first. A block whose key
is sighted while it is free is re-ranked at once; a repeated touch by its last taker keeps its
age. Aging re-ranks every free block. ``window_tiers``: the aging window in tier sizes (the
window is ``window_tiers`` times the pool's blocks). A heap with lazy deletion: O(log n) per
push, pop and re-rank, O(n) per aging.
"""

from __future__ import annotations

import heapq

import numpy as np

from kvtriton.eviction.ranked import RankedHeapQueue

__all__ = ["DEFAULT_WINDOW_TIERS", "SKETCH_DEPTH", "FrequencySketch", "LFUQueue"]

#: The aging window ``lfu`` means without ``:W``, in tier sizes (TinyLFU samples about ten
#: times the cache; a power of two). ``bench/tier_study/conversational_gap.py`` chooses among 4, 16
#and 64 : on the Mooncake trace's first half (it chose 64, spelled ``lfu:64``).
DEFAULT_WINDOW_TIERS = 16

# Odd 64-bit multipliers (splitmix64's and two golden-ratio variants): one hash per row.
_SEEDS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1
#: Rows of ``LFUQueue``'s sketch (one byte each per column).
SKETCH_DEPTH = 4


class FrequencySketch:
    """Count-min sketch of key sightings with TinyLFU's aging.

    ``width``: counters per row (rounded up to a power of two); ``depth``: rows (at most 4);
    ``window``: sightings after which every counter is halved (0: never); ``cap``: the most a
    counter holds (TinyLFU uses 15: a 4-bit counter)."""

    def __init__(self, width: int, *, depth: int = 4, window: int = 0, cap: int = 255) -> None:
        if not 1 <= depth <= len(_SEEDS):
            raise ValueError(f"depth must be in [1, {len(_SEEDS)}], got {depth!r}")
        if width < 1 or window < 0 or not 1 <= cap <= 255:
            raise ValueError(f"width must be >= 1, window >= 0 and cap in [1, 255], got "
                             f"{width!r}, {window!r}, {cap!r}")
        self.width = self.rounded_width(width)
        self._bits = self.width.bit_length() - 1
        self.window = window
        self.cap = cap
        self._seeds = np.array(_SEEDS[:depth], dtype=np.uint64)
        self._rows = np.zeros((depth, self.width), dtype=np.uint8)
        self._seen = 0
        # Estimates since the last add: the counters change only there, and between two admitted
        # requests a waiting request's lookup pins and unpins the same keys every step.
        self._estimates: dict[int, int] = {}
        #: How many times the counters were halved.
        self.agings = 0

    @staticmethod
    def rounded_width(width: int) -> int:
        """The counters per row a sketch asked for ``width`` has (the next power of two)."""
        return 1 << max(0, int(width - 1).bit_length())

    def _columns(self, keys: np.ndarray) -> np.ndarray:
        """[depth, n] column of each key in each row (multiplicative hashing, top bits)."""
        k = np.asarray(keys, dtype=np.int64).astype(np.uint64)[None, :]
        with np.errstate(over="ignore"):
            h = (k + np.uint64(1)) * self._seeds[:, None]
        return (h >> np.uint64(64 - self._bits)).astype(np.int64) if self._bits else \
            np.zeros(h.shape, dtype=np.int64)

    def add(self, keys: np.ndarray) -> bool:
        """Count one sighting of each of ``keys`` (distinct); True when this aged the sketch."""
        if not len(keys):
            return False
        cols = self._columns(keys)
        rows = self._rows
        self._estimates.clear()
        for r in range(len(rows)):
            # Distinct keys may share a column: count each, as count-min does. (unique, not a
            # bincount: a bincount spans the whole row, hundreds of thousands of counters.)
            hit, counts = np.unique(cols[r], return_counts=True)
            rows[r, hit] = np.minimum(rows[r, hit].astype(np.int64) + counts, self.cap)
        self._seen += len(keys)
        if self.window and self._seen >= self.window:
            self._rows >>= 1
            self._seen //= 2
            self.agings += 1
            return True
        return False

    def estimate(self, keys: np.ndarray) -> np.ndarray:
        """Estimated sightings of each key (an over-estimate only where keys share columns)."""
        cols = self._columns(keys)
        return self._rows[np.arange(len(self._rows))[:, None], cols].min(axis=0)

    def estimate_one(self, key: int) -> int:
        got = self._estimates.get(key)
        if got is not None:
            return got
        bits, rows = self._bits, self._rows
        k = (key + 1) & _MASK64
        got = self._estimates[key] = min(
            int(rows[r, ((k * int(s)) & _MASK64) >> (64 - bits)] if bits else rows[r, 0])
            for r, s in enumerate(self._seeds.tolist()))
        return got


class LFUQueue(RankedHeapQueue):
    """Free blocks by estimated demand (lowest first), LRU among equals; see the module
    docstring. ``window_tiers``: the sketch's aging window in tier sizes (0: never ages);
    ``width_per_block``: sketch counters per row per pool block (None: the window's sightings,
    at least 8 per block)."""

    name = "lfu"
    observes_requests = True

    def __init__(self, window_tiers: float = DEFAULT_WINDOW_TIERS, *,
                 width_per_block: int | None = None) -> None:
        if not window_tiers >= 0 or (width_per_block is not None and width_per_block < 1):
            raise ValueError(f"window_tiers must be >= 0 and width_per_block >= 1 or None, got "
                             f"{window_tiers!r}, {width_per_block!r}")
        self.window_tiers = window_tiers
        self.width_per_block = width_per_block

    def _sketch_size(self, num_blocks: int) -> tuple[int, int]:
        """(width, window) of the sketch for a pool of ``num_blocks`` blocks."""
        tier = max(1, num_blocks - 1)  # block 0 of a pool is the null block
        window = int(self.window_tiers * tier)
        # Most keys of chat traffic are seen once, so a window holds nearly as many distinct
        # keys as sightings: a row needs about that many counters, or collisions inflate the
        # estimates of cold keys (at least 8 per block when the sketch never ages).
        width = (self.width_per_block * tier if self.width_per_block is not None
                 else max(8 * tier, window))
        return width, window

    def memory_bytes(self, num_blocks: int) -> int:
        width, _ = self._sketch_size(num_blocks)
        return SKETCH_DEPTH * FrequencySketch.rounded_width(width)

    def reset(self, num_blocks: int) -> None:
        width, window = self._sketch_size(num_blocks)
        self.sketch = FrequencySketch(width, depth=SKETCH_DEPTH, window=window)
        super().reset(num_blocks)  # entries (estimate, freed order, stamp, block)
        self._freed = [0] * num_blocks  # when the block was last freed by a real use
        self._repeat = bytearray(num_blocks)  # taken back by its last taker: keeps its age

    def _rank(self, block_id: int, key: int) -> tuple[int, int]:
        return self.sketch.estimate_one(key), self._freed[block_id]

    def on_request(self, keys: np.ndarray) -> None:
        if self.sketch.add(keys):
            self._rerank_all()
        elif self._by_key:
            self._rerank(keys.tolist())

    def push(self, block_id: int, key: int | None) -> None:
        if key is None:
            self._unhashed.appendleft(block_id)
            return
        if self._repeat[block_id]:
            self._repeat[block_id] = 0
        else:
            self._freed[block_id] = self._clock + 1
        self._add(block_id, key)

    def _leave(self, b: int) -> None:
        super()._leave(b)
        self._repeat[b] = 0

    def remove(self, block_id: int, reuse: bool = True) -> None:
        hashed = bool(self._stamp[block_id])
        super().remove(block_id, reuse)
        if hashed:
            self._repeat[block_id] = not reuse

    def forget_block(self, block_id: int) -> None:
        self._repeat[block_id] = 0

    def note_reuse(self, block_id: int) -> None:
        self._repeat[block_id] = 0

    def _rerank_all(self) -> None:
        live = self._live()
        if not live:
            self._heap = []
            return
        blocks = [e[3] for e in live]
        est = self.sketch.estimate(np.array([self._key[b] for b in blocks], dtype=np.int64))
        self._heap = [(int(f), e[1], e[2], e[3]) for f, e in zip(est.tolist(), live,
                                                               strict=True)]
        heapq.heapify(self._heap)
