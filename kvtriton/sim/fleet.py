"""A fleet in the serving loop: N replicas on one clock, a router in front, and optionally one
second tier they all share.

Each replica is a whole ``ServingLoop`` (its own GPU prefix cache, CPU tier, planner and
scheduler, its own host links); the fleet owns the arrivals. A request is routed when it
arrives, to the replica its router picks from what that router reads at that moment; the turn
after it arrives (after its think time) once it finished, and is routed again (a session may
change replicas, unless the router keeps it). The replicas advance in time order: the fleet
steps the replica that is furthest behind, after routing every arrival up to that time; a
replica with nothing to do waits until a request is routed to it or a transfer of its own
completes. So when a request is routed, every replica's state is at most one of its steps past
the arrival (a router in a server reads signals as old as its replicas' last reports).

With ``shared``, every replica's second tier is one ``StoreTier``: one store's contents, and
every replica's write-through and fetches queued on the store's two links.
"""

from __future__ import annotations

import heapq
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.workload import Workload, WorkloadRequest

__all__ = ["ROUTERS", "Fleet", "Router", "make_router"]


class Router(ABC):
    """Picks the replica of each arriving request. ``signal`` says what it reads: each a
    router in front of vLLM replicas can read at that moment (the request itself, vLLM's
    queue metrics, or the KV events vLLM publishes as blocks are cached and evicted)."""

    name: str
    signal: str

    @abstractmethod
    def pick(self, wr: WorkloadRequest, keys: np.ndarray, replicas: Sequence[ServingLoop]
             ) -> int:
        """The index of the replica ``wr`` goes to (``keys``: its block keys, per group)."""


def load(replica: ServingLoop) -> int:
    """Requests routed to ``replica`` and not finished: waiting, running or not yet admitted
    (vLLM's ``num_requests_waiting`` plus ``num_requests_running``)."""
    return len(replica.sched.seqs) + replica.num_not_admitted


class RoundRobin(Router):
    name, signal = "round_robin", "nothing: replicas in turn"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, wr, keys, replicas) -> int:
        i, self._next = self._next, (self._next + 1) % len(replicas)
        return i


class LeastLoaded(Router):
    name, signal = "least_loaded", "each replica's requests waiting and running"

    def pick(self, wr, keys, replicas) -> int:
        loads = [load(r) for r in replicas]
        return loads.index(min(loads))


class SessionAffinity(Router):
    """A session's turns stay on the replica of its first turn (picked least loaded)."""

    name, signal = "session", "the request's session id; queue lengths for a new session"

    def __init__(self) -> None:
        self._home: dict[str, int] = {}
        self._least = LeastLoaded()

    def pick(self, wr, keys, replicas) -> int:
        if wr.session is None:
            return self._least.pick(wr, keys, replicas)
        home = self._home.get(wr.session)
        if home is None:
            home = self._home[wr.session] = self._least.pick(wr, keys, replicas)
        return home


class PrefixAware(Router):
    """The replica caching the longest prefix of the request (GPU or CPU tier), among those
    whose load is at most ``load_cap`` times the mean plus one; ties go to the least loaded.
    What llm-d's prefix-cache scorer and Dynamo's KV router read: the block hashes each
    replica reported cached (vLLM's KV events), and queue lengths."""

    name = "prefix"
    signal = "block hashes each replica holds (vLLM KV events) and queue lengths"

    def __init__(self, load_cap: float = 1.5) -> None:
        if not load_cap >= 1.0:
            raise ValueError(f"load_cap must be at least 1 (the mean load), got {load_cap!r}")
        self.load_cap = load_cap

    @staticmethod
    def cached_prefix(replica: ServingLoop, keys: np.ndarray) -> int:
        """Leading blocks of ``keys`` (group 0) ``replica`` holds in its GPU or CPU tier."""
        gpu, cpu = replica.gpu, replica.cpu
        n = 0
        for k in keys[0].tolist():
            if k not in gpu and (cpu is None or k not in cpu):
                break
            n += 1
        return n

    def pick(self, wr, keys, replicas) -> int:
        loads = [load(r) for r in replicas]
        cap = self.load_cap * sum(loads) / len(loads) + 1
        best, best_key = 0, None
        for i, r in enumerate(replicas):
            if loads[i] > cap:
                continue
            key = (self.cached_prefix(r, keys), -loads[i])
            if best_key is None or key > best_key:
                best, best_key = i, key
        return best


ROUTERS: dict[str, Callable[[], Router]] = {
    "round_robin": RoundRobin, "least_loaded": LeastLoaded, "session": SessionAffinity,
    "prefix": PrefixAware}


def make_router(name: str) -> Router:
    """The router named ``name`` (``ROUTERS``); ``prefix:CAP`` sets the prefix router's load
    cap. ``ValueError`` naming the value otherwise."""
    base, _, arg = name.partition(":")
    if base not in ROUTERS or (arg and base != "prefix"):
        raise ValueError(f"unknown router {name!r}; routers: {', '.join(ROUTERS)} "
                         "(prefix:CAP sets the prefix router's load cap)")
    if arg:
        try:
            return PrefixAware(float(arg))
        except ValueError as e:
            raise ValueError(f"router {name!r}: {e}") from None
    return ROUTERS[base]()


@dataclass
class FleetRun:
    """What a fleet run gives: one ``RunMetrics`` per replica and their merge (its ``wall_s``
    the whole run's); ``routed``: requests per replica."""

    replicas: list[RunMetrics]
    merged: RunMetrics
    routed: list[int] = field(default_factory=list)
    #: Of the routed requests' prompt blocks, the share another replica held a longer cached
    #: prefix of than the chosen one did when the request was routed: what the router left
    #: elsewhere, measurable in a fleet from its replicas' KV events.
    prefix_left_elsewhere: float = 0.0


class Fleet:
    """``replicas`` (``ServingLoop``s built over the same ``workload`` and keys) behind
    ``router``; ``run()`` serves the workload."""

    def __init__(self, workload: Workload, keys: list[np.ndarray],
                 replicas: Sequence[ServingLoop], router: Router,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.workload = workload
        self.keys = keys
        self.replicas = list(replicas)
        self.router = router
        self.progress = progress
        self._arrivals, self._successors = workload.arrival_queue()
        self.routed = [0] * len(self.replicas)
        self._left_blocks = self._prompt_blocks = 0
        for r in self.replicas:
            # The fleet owns arrivals: a replica's finished turns release theirs through it.
            r.join_fleet(self._release, self._next_arrival)

    def _next_arrival(self) -> float:
        return self._arrivals[0][0] if self._arrivals else math.inf

    def _release(self, rid: str, now: float) -> None:
        self.workload.release_after(rid, now, self._arrivals, self._successors)

    def _route(self) -> None:
        at, i = heapq.heappop(self._arrivals)
        wr = self.workload.requests[i]
        keys = self.keys[i]
        r = self.router.pick(wr, keys, self.replicas)
        if len(self.replicas) > 1:
            held = [PrefixAware.cached_prefix(x, keys) for x in self.replicas]
            self._left_blocks += max(held) - held[r]
        self._prompt_blocks += keys.shape[1]
        self.replicas[r].accept(at, i)
        self.routed[r] += 1
        self._parked[r] = False

    def _time(self, i: int) -> float:
        """When replica ``i`` next has something to do."""
        r = self.replicas[i]
        if not self._parked[i]:
            return r.now
        return r.next_completion_s

    def run(self) -> FleetRun:
        t0 = time.perf_counter()
        n = len(self.replicas)
        self._parked = [True] * n
        total, steps = len(self.workload), 0
        while True:
            times = [self._time(i) for i in range(n)]
            first = min(range(n), key=times.__getitem__)
            if self._arrivals and self._arrivals[0][0] <= times[first]:
                self._route()
                continue
            if times[first] == math.inf:
                break
            r = self.replicas[first]
            r.now = max(r.now, times[first])
            self._parked[first] = not r.step()
            steps += 1
            if self.progress is not None and steps % 1024 == 0:
                self.progress(sum(x.metrics.finished for x in self.replicas), total)
        for r, routed in zip(self.replicas, self.routed, strict=True):
            r.finish_run(routed)
        merged = RunMetrics.merged([r.metrics for r in self.replicas])
        merged.wall_s = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(merged.finished, total)
        left = self._left_blocks / self._prompt_blocks if self._prompt_blocks else 0.0
        return FleetRun([r.metrics for r in self.replicas], merged, list(self.routed), left)
