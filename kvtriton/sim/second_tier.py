"""The second tier in the serving loop: a store under the CPU tier, as ``vllm serve`` runs it
with ``second_tier`` (Mooncake Store), so that a setup with ``shared`` means one thing in both.

The loop uses the connector's own scheduler part (``kvtriton.second_tier.fetches.StoreFetches``:
the existence query where the CPU hit ends, fetches into the CPU tier, the request waiting for
them) over ``SimStore``, a store of ``capacity_blocks`` blocks that forgets its least recently
used block when full (Mooncake evicts approximately so at its watermark). Every block the CPU
tier caches is written through (its bytes count on the store link; the write is off the
request's path, as the connector's is). A fetch completes after ``StoreCost.fetch_s``: the
store link's per-call latency and bytes over its bandwidth, queued behind earlier fetches. An
existence query, asked when a request arrives as the connector asks it, is back one call's
latency later (``AnsweredAtOnce`` answers it; ``StoreFetches`` waits out the latency).

``LOOPBACK_TCP`` is what this project measured: Mooncake Store over loopback TCP on its 2-core
CI machine (``bench/results/second_tier.json``: batched get of 2 MiB blocks, and the latency
of a one-block call). No RDMA profile is given: none was measured here and the references
carry no figure to label one with.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from kvtriton.sim.clock import Link

__all__ = ["LOOPBACK_TCP", "AnsweredAtOnce", "SimStore", "StoreCost", "StoreTier"]


@dataclass(frozen=True)
class StoreCost:
    """The store link: ``bandwidth_bytes_per_s`` of batched reads, ``latency_s`` per call."""

    bandwidth_bytes_per_s: float
    latency_s: float
    source: str

    def fetch_s(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth_bytes_per_s

    @classmethod
    def from_results(cls, doc: dict, source: str) -> StoreCost:
        """The link ``bench.second_tier`` measured (its JSON ``doc``): the batched get of its
        largest objects for the bandwidth, a one-object get of its smallest for the latency."""
        rows = sorted(doc["raw"], key=lambda r: r["object_bytes"])
        small, big = rows[0], rows[-1]
        return cls(big["get_batched_gb_s"] * 1e9,
                   small["object_bytes"] / (small["get_single_gb_s"] * 1e9), source)

    def rounded(self) -> StoreCost:
        """Two significant digits of each figure (how ``LOOPBACK_TCP`` carries them)."""
        return StoreCost(float(f"{self.bandwidth_bytes_per_s:.2g}"),
                         float(f"{self.latency_s:.2g}"), self.source)


#: Mooncake Store on loopback TCP, 2 cores: ``StoreCost.from_results`` of
#: bench/results/second_tier.json, to two digits (batched get of 2 MiB blocks; a one-object get
#: of 4 KiB for the per-call latency). The wheel carries no results, so the two figures are
#: written here; tests/sim/test_second_tier.py fails when they differ from that file's (whose
#: commit its MANIFEST.json records).
LOOPBACK_TCP = StoreCost(2.1e9, 1.5e-4, "measured: Mooncake Store, loopback TCP, 2-core machine "
                                       "(bench/results/second_tier.json)")


class AnsweredAtOnce(Executor):
    """Runs each call as it is submitted: the simulator's existence queries, whose modeled
    delay ``StoreFetches`` applies (its ``query_latency_s``) on the serving loop's clock."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        out: Future = Future()
        out.set_result(fn(*args, **kwargs))
        return out


class SimStore:
    """Key ids the store holds, least recently used first; ``capacity_blocks`` of them."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.blocks_written = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def write(self, keys: np.ndarray | list[int]) -> None:
        """Write ``keys`` through (a key held already is not written again, only used)."""
        held = self._keys
        for k in map(int, keys):
            if k in held:
                held.move_to_end(k)
                continue
            held[k] = None
            self.blocks_written += 1
            if len(held) > self.capacity_blocks:
                held.popitem(last=False)
                self.evicted += 1

    def query(self, keys: list[int]) -> np.ndarray:
        """Which of ``keys`` the store holds; those it holds count as used."""
        held = self._keys
        out = np.fromiter((k in held for k in keys), dtype=bool, count=len(keys))
        for k, h in zip(keys, out.tolist(), strict=True):
            if h:
                held.move_to_end(k)
        return out


@dataclass
class StoreTier:
    """The store as replicas reach it: its contents and its two links (puts in, gets out),
    each transfer queued behind the ones before it. A fleet's replicas share one."""

    store: SimStore
    cost: StoreCost
    puts: Link = field(default_factory=Link)
    gets: Link = field(default_factory=Link)

    def put(self, now: float, keys, nbytes: int) -> None:
        """Replica's write-through of ``keys`` (``nbytes`` in all) at ``now``."""
        self.store.write(keys)
        self.puts.submit(now, nbytes, nbytes / self.cost.bandwidth_bytes_per_s)

    def get(self, now: float, nbytes: int) -> float:
        """A fetch of ``nbytes`` asked at ``now``; when it completes."""
        return self.gets.submit(now, nbytes, self.cost.fetch_s(nbytes))
