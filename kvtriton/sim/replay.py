"""Cache-only replay: one cache tier, requests in order, no serving loop.

The setting of the Mooncake paper's capacity curve. A tier holds ``capacity_blocks`` blocks of
``hash_block_size`` tokens. At each request, in workload order:

1. hit: the longest run of the prompt's full blocks present in the tier, from block 0;
2. the request's blocks (prompt then output, its first ``capacity_blocks`` when it has more)
   are touched if present and inserted if not, evicting by the eviction rule among blocks that
   are not the request's own; then freed tail first, so a chain's head is the last to go.

Hit rate = hit tokens / prompt tokens. The rules of ``kvtriton.eviction.EVICTION_QUEUES`` run
through a real ``BlockPool``; ``"belady"`` is the offline bound: evict the cached block whose next
use is farthest (a block never used again first, the deeper of a tie first). With chain hashes a
block is used whenever a deeper block of its chain is, so that tie rule keeps Belady's cache
prefix-closed and every block it keeps is reachable; it is then optimal for this setting, and
the tests check it against an exhaustive search on small traces. ``max_hit_rate`` is the hit
rate of an infinite cache.

Keys are interned once per workload as dense Python ints (``np.unique``), shared by every run of
a sweep.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtriton.eviction import EVICTION_QUEUES
from kvtriton.pool import BlockPool
from kvtriton.sim.workload import Workload

__all__ = [
    "BELADY",
    "ReplayResult",
    "SweepResult",
    "capacity_sweep",
    "default_capacities",
    "max_hit_rate",
    "replay",
]

BELADY = "belady"
DEFAULT_EVICTIONS = ("lru", "arc", "s3fifo", BELADY)


@dataclass(slots=True)
class ReplayResult:
    """One replay: ``hit_tokens`` of ``prompt_tokens`` at ``capacity_blocks`` blocks."""

    eviction: str
    capacity_blocks: int
    capacity_tokens: int
    requests: int
    prompt_tokens: int
    hit_tokens: int
    wall_s: float

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(slots=True)
class SweepResult:
    """Hit rate per eviction rule per capacity, plus the infinite-cache maximum.

    ``capacities_tokens`` as asked; ``capacities_blocks`` what ran (tokens rounded down to whole
    blocks). ``hit_rate[eviction][i]`` is at capacity i; ``wall_s`` likewise, in seconds.
    """

    name: str
    hash_block_size: int
    requests: int
    prompt_tokens: int
    capacities_tokens: list[int]
    capacities_blocks: list[int]
    max_hit_rate: float
    hit_rate: dict[str, list[float]] = field(default_factory=dict)
    hit_tokens: dict[str, list[int]] = field(default_factory=dict)
    wall_s: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        """A text table: a row per capacity, a column per eviction rule, hit rates in percent."""
        evictions = list(self.hit_rate)
        head = f"{'capacity (tokens)':>18} " + " ".join(f"{p:>8}" for p in evictions)
        lines = [head]
        for i, cap in enumerate(self.capacities_tokens):
            row = " ".join(f"{100 * self.hit_rate[p][i]:7.2f}%" for p in evictions)
            lines.append(f"{cap:>18,} {row}")
        lines.append(f"{'infinite':>18} {100 * self.max_hit_rate:7.2f}% (max hit rate)")
        return "\n".join(lines)


class _Prepared:
    """A workload's keys as dense ints: per request, its keys (duplicates dropped) and how many
    leading ones are full prompt blocks."""

    __slots__ = ("b", "keys", "lookup", "name", "num_keys", "prompt_tokens")

    def __init__(self, workload: Workload) -> None:
        self.b = workload.hash_block_size
        self.name = workload.name
        reqs = workload.requests
        lengths = np.array([len(r.hashes) for r in reqs], dtype=np.int64)
        if len(reqs) and lengths.sum():
            flat = np.concatenate([r.hashes for r in reqs])
            uniq, dense = np.unique(flat, return_inverse=True)
            self.num_keys = len(uniq)
            dense_list = dense.ravel().tolist()
        else:
            self.num_keys, dense_list = 0, []
        ends = np.cumsum(lengths).tolist()
        self.keys: list[list[int]] = []
        self.lookup: list[int] = []
        start = 0
        for r, end in zip(reqs, ends, strict=True):
            keys = dense_list[start:end]
            if len(set(keys)) != len(keys):  # only on a 64-bit collision or a hand-made workload
                keys = list(dict.fromkeys(keys))
            self.keys.append(keys)
            self.lookup.append(min(r.prompt_len // self.b, len(keys)))
            start = end
        self.prompt_tokens = sum(r.prompt_len for r in reqs)


def _prepare(workload: Workload | _Prepared) -> _Prepared:
    return workload if isinstance(workload, _Prepared) else _Prepared(workload)


def _hits_pool(prep: _Prepared, capacity: int, eviction: str) -> int:
    pool = BlockPool(capacity + 1, eviction=eviction)
    get, touch, free = pool.get_cached_block, pool.touch, pool.free_blocks
    new, cache = pool.get_new_blocks, pool.cache_block
    hits = 0
    for keys, n_lookup in zip(prep.keys, prep.lookup, strict=True):
        if len(keys) > capacity:
            keys = keys[:capacity]
        blocks = [get(k) for k in keys]
        h = 0
        for b in blocks[:n_lookup]:
            if b is None:
                break
            h += 1
        hits += h
        present = [b for b in blocks if b is not None]
        if present:
            touch(present)
        if len(present) < len(blocks):
            missing = [i for i, b in enumerate(blocks) if b is None]
            for i, b in zip(missing, new(len(missing)), strict=True):
                cache(b, keys[i])
                blocks[i] = b
        blocks.reverse()
        free(blocks)
    return hits


def _next_uses(prep: _Prepared, capacity: int) -> list[list[int]]:
    """For each request's first ``capacity`` keys, the index of the next request that uses the
    key among its own first ``capacity`` keys (``len(requests)`` if none)."""
    keys = [k[:capacity] for k in prep.keys]
    lengths = np.array([len(k) for k in keys], dtype=np.int64)
    n = len(keys)
    if not lengths.sum():
        return [[] for _ in keys]
    flat = np.fromiter((k for ks in keys for k in ks), dtype=np.int64, count=int(lengths.sum()))
    req = np.repeat(np.arange(n, dtype=np.int64), lengths)
    order = np.lexsort((req, flat))  # by key, then request
    nxt_sorted = np.full(len(flat), n, dtype=np.int64)
    same = flat[order[1:]] == flat[order[:-1]]
    nxt_sorted[:-1][same] = req[order[1:]][same]
    nxt = np.empty_like(nxt_sorted)
    nxt[order] = nxt_sorted
    out, start = [], 0
    nxt_list = nxt.tolist()
    for end in np.cumsum(lengths).tolist():
        out.append(nxt_list[start:end])
        start = end
    return out


def _hits_belady(prep: _Prepared, capacity: int) -> int:
    next_uses = _next_uses(prep, capacity)
    cached: dict[int, int] = {}  # key -> its next use (matches its live heap entry)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key); stale entries skipped
    push, pop = heapq.heappush, heapq.heappop
    hits = 0
    for keys, n_lookup, nexts in zip(prep.keys, prep.lookup, next_uses, strict=True):
        if len(keys) > capacity:
            keys = keys[:capacity]
        hits += _prefix_hits(keys, n_lookup, cached)
        missing = sum(1 for k in keys if k not in cached)
        # This request's own keys have next use == now, the smallest of all, so they are never
        # popped before the `excess` victims are found among the others.
        excess = len(cached) + missing - capacity
        while excess > 0:
            neg_next, _, k = pop(heap)
            if cached.get(k) == -neg_next:
                del cached[k]
                excess -= 1
        for depth, (k, nx) in enumerate(zip(keys, nexts, strict=True)):
            cached[k] = nx
            push(heap, (-nx, -depth, k))
    return hits


def _prefix_hits(keys: Sequence[int], n_lookup: int, held: Container[int]) -> int:
    """How many of the first ``n_lookup`` keys ``held`` has before the first it lacks: a
    prefix cache serves a request's blocks up to its first miss."""
    h = 0
    for k in keys[:n_lookup]:
        if k not in held:
            break
        h += 1
    return h


def _hits_infinite(prep: _Prepared) -> int:
    seen: set[int] = set()
    hits = 0
    for keys, n_lookup in zip(prep.keys, prep.lookup, strict=True):
        hits += _prefix_hits(keys, n_lookup, seen)
        seen.update(keys)
    return hits


def _check_eviction(eviction: str) -> None:
    if eviction != BELADY and eviction not in EVICTION_QUEUES:
        raise ValueError(f"unknown replay eviction {eviction!r}; known: "
                         f"{sorted([*EVICTION_QUEUES, BELADY])}")
    if eviction != BELADY and EVICTION_QUEUES[eviction].observes_requests:
        # Its demand comes from the planner's admissions, which a cache-only replay lacks: it
        # would silently run as LRU.
        raise ValueError(f"replay eviction {eviction!r} learns from the requests a planner "
                         "admits, which a cache-only replay has none of; use simulate")


def _capacity_blocks(b: int, capacity_tokens: int | None, capacity_blocks: int | None) -> int:
    if (capacity_tokens is None) == (capacity_blocks is None):
        raise ValueError("give exactly one of capacity_tokens and capacity_blocks")
    if capacity_blocks is None:
        if not isinstance(capacity_tokens, int) or capacity_tokens < b:
            raise ValueError(f"capacity_tokens must be an int >= hash_block_size ({b}), "
                             f"got {capacity_tokens!r}")
        return capacity_tokens // b
    if not isinstance(capacity_blocks, int) or capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be an int >= 1, got {capacity_blocks!r}")
    return capacity_blocks


def replay(
    workload: Workload,
    capacity_tokens: int | None = None,
    *,
    capacity_blocks: int | None = None,
    eviction: str = "lru",
) -> ReplayResult:
    """Replay ``workload`` through one tier of ``capacity_tokens`` (rounded down to whole
    blocks) or ``capacity_blocks``, evicting by ``eviction`` (an ``EVICTION_QUEUES`` name or
    ``"belady"``)."""
    _check_eviction(eviction)
    prep = _prepare(workload)
    cap = _capacity_blocks(prep.b, capacity_tokens, capacity_blocks)
    t0 = time.perf_counter()
    hits = _hits_belady(prep, cap) if eviction == BELADY else _hits_pool(prep, cap, eviction)
    return ReplayResult(eviction, cap, cap * prep.b, len(prep.keys), prep.prompt_tokens,
                        hits * prep.b, time.perf_counter() - t0)


def max_hit_rate(workload: Workload) -> float:
    """Hit rate of an infinite cache: the prompt tokens any eviction rule could at best reuse."""
    prep = _prepare(workload)
    return _hits_infinite(prep) * prep.b / prep.prompt_tokens if prep.prompt_tokens else 0.0


def default_capacities(workload: Workload, n: int = 6) -> list[int]:
    """``n`` capacities in tokens, geometric from 1/32 of the workload's distinct-block footprint
    up to the whole of it (where every eviction rule reaches the maximum)."""
    prep = _prepare(workload)
    top = max(1, prep.num_keys) * prep.b
    caps = np.geomspace(max(prep.b, top / 32), top, n)
    return sorted({max(prep.b, int(c) // prep.b * prep.b) for c in caps})


def capacity_sweep(
    workload: Workload,
    capacities_tokens: Sequence[int] | None = None,
    evictions: Sequence[str] = DEFAULT_EVICTIONS,
    *,
    progress: Callable[[ReplayResult], None] | None = None,
) -> SweepResult:
    """Hit rate of every eviction rule at every capacity (tokens; ``default_capacities`` if None),
    and the infinite-cache maximum. ``progress`` sees each ``ReplayResult`` as it finishes."""
    for p in evictions:
        _check_eviction(p)
    prep = _prepare(workload)
    if capacities_tokens is None:
        capacities_tokens = default_capacities(workload)
    caps = [_capacity_blocks(prep.b, c, None) for c in capacities_tokens]
    best = _hits_infinite(prep) * prep.b
    out = SweepResult(prep.name, prep.b, len(prep.keys), prep.prompt_tokens,
                      list(capacities_tokens), caps,
                      best / prep.prompt_tokens if prep.prompt_tokens else 0.0)
    for p in evictions:
        out.hit_rate[p], out.hit_tokens[p], out.wall_s[p] = [], [], []
        for cap in caps:
            t0 = time.perf_counter()
            hits = _hits_belady(prep, cap) if p == BELADY else _hits_pool(prep, cap, p)
            r = ReplayResult(p, cap, cap * prep.b, len(prep.keys), prep.prompt_tokens,
                             hits * prep.b, time.perf_counter() - t0)
            out.hit_rate[p].append(r.hit_rate)
            out.hit_tokens[p].append(r.hit_tokens)
            out.wall_s[p].append(r.wall_s)
            if progress is not None:
                progress(r)
    return out
