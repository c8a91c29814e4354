"""The scheduler's part of the second tier: where a request's CPU hit ends, ask the store for
the rest of its prefix once, fetch what it holds into the CPU tier, and let the request wait
for it.

``extend`` runs after the planner's CPU lookup. The first time a request's hit is cut short it
reads which blocks past the hit the store holds: an existence query over every rank's object
names, asked when the request arrived (``prefetch``) on a helper thread, which sends every query
queued by then in one call (the requests arriving in one step share a round trip). A lookup
whose answer is not back waits for it at most ``INLINE_WAIT_S``, then lets the request wait a
step, as for a fetch; the answer may be a little old (a block written since reads as absent,
one evicted since fails its fetch and is recomputed). The
longest run of scheduler blocks the CPU tier or the store holds is then completed from the
store: fresh CPU blocks are allocated for the missing ones (the blocks of the run already in
the CPU tier are pinned meanwhile) and a *fetch* goes to every worker. The request waits
(vLLM's "not yet known" answer) until all workers reported the fetch, at most
``fetch_timeout_s``; the blocks every worker read and verified are then cached in the CPU tier
under their keys, and the request's next lookup hits them there, loading through the CPU tier's
own load path. A block any worker failed to read is freed uncached: its tokens are recomputed.
A request asks again only for what its last answer did not cover: the rest of a run longer
than the CPU tier's free blocks (fetched in rounds), or a run that now starts earlier because
its GPU prefix was evicted while it waited; at most ``MAX_ROUNDS`` fetches per request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import numpy as np

from kvtriton.pool import BlockPool
from kvtriton.records import Request
from kvtriton.second_tier.faults import FaultLog
from kvtriton.specs import KVLayout

__all__ = ["MAX_ROUNDS", "Fetch", "StoreFetches", "fetch_run", "fetch_run_loop"]

#: Fetches one request may take: rounds of a run longer than the CPU tier's free blocks, and runs
#: asked again from earlier after its GPU prefix was evicted while it waited.
MAX_ROUNDS = 4


@dataclass(slots=True)
class _Query:
    """An existence query on the executor: ``keys`` asked at ``asked_at`` (the clock's
    seconds) for the request's ``round``-th fetch; ``on_arrival``: asked when the request
    arrived, not by its lookup."""

    keys: list[int]
    answer: Future
    asked_at: float
    on_arrival: bool
    round: int = 1


#: ``_presence``'s answer while the query is still out: the request waits.
_NOT_BACK = object()
#: Seconds a lookup waits in the step for a query that is out before the request waits a step
#: instead: a few loopback round trips (0.1 to 0.2 ms each here), less than a GPU step.
INLINE_WAIT_S = 0.002


@dataclass(slots=True, eq=False)
class Fetch:
    """Blocks read from the store for request ``rid`` into fresh CPU blocks ``cpu`` (group
    ``groups[i]``, key id ``keys[i]``); ``riders``: other requests waiting for these blocks
    (their runs share them), each pinning them too when they land."""

    rid: str
    cpu: list[int]
    groups: list[int]
    keys: list[int]
    event: int = -1
    reports: int = 0
    bad: set[int] = field(default_factory=set)
    abandoned: bool = False
    riders: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Wait:
    """A request waiting, until ``deadline``, for ``fetches`` (its own, and others' that read
    blocks of its run); ``held``: CPU blocks of its run already cached and ``landed``: blocks
    of its fetches that landed, both pinned until its next lookup once all landed."""

    deadline: float
    fetches: list[Fetch]
    held: list[int]
    landed: list[int] = field(default_factory=list)


def fetch_run(in_cpu: np.ndarray, in_store: np.ndarray) -> tuple[int, np.ndarray]:
    """The run a fetch completes: ``in_cpu[j, i]`` says whether block ``i`` of scheduler block
    ``j`` past the CPU hit is in the CPU tier, ``in_store[n]`` whether the store holds the
    ``n``-th block not in it (row-major order). Returns the run's length in scheduler blocks
    (each wholly in one tier or the other) and the flat indices of the blocks to fetch."""
    avail = in_cpu.ravel().copy()
    need = np.flatnonzero(~avail)
    avail[need] = in_store
    rows = avail.reshape(in_cpu.shape).all(axis=1)
    run = len(rows) if rows.all() else int(np.argmin(rows))
    return run, need[need < run * in_cpu.shape[1]]


def fetch_run_loop(in_cpu: np.ndarray, in_store: np.ndarray) -> tuple[int, np.ndarray]:
    """``fetch_run`` block by block: the reference its tests compare against."""
    n_sched, k = in_cpu.shape
    store = iter(in_store.tolist())
    found = [[True if in_cpu[j, i] else next(store) for i in range(k)] for j in range(n_sched)]
    run, take = 0, []
    for j in range(n_sched):
        if not all(found[j]):
            break
        run += 1
        take += [j * k + i for i in range(k) if not in_cpu[j, i]]
    return run, np.asarray(take, dtype=np.int64)


def _subset(asked: list[int], present: np.ndarray, keys: list[int]) -> np.ndarray:
    """``present`` (one bool per key of ``asked``) for ``keys``, a subset of ``asked``."""
    table = dict(zip(asked, present.tolist(), strict=True))
    return np.fromiter((table[k] for k in keys), dtype=bool, count=len(keys))


def check_layout(layout: KVLayout) -> None:
    """``ValueError`` for a layout the second tier does not serve (a sliding-window or Mamba
    group: a hit there needs other blocks than its prefix's)."""
    other = [(g, s.kind) for g, s in enumerate(layout.groups) if s.kind != "full"]
    if other:
        g, kind = other[0]
        raise ValueError(f"KVTritonConnector: kv_connector_extra_config['second_tier'] serves "
                         f"full-attention groups only; group {g} is {kind!r}. Run this model "
                         "with the CPU tier alone (drop 'second_tier')")


#: Which of a list of key ids the store holds for every rank (a bool array), or None when it
#: could not say (a fault, counted where it happened).
StoreQuery = Callable[[list[int]], "np.ndarray | None"]


class StoreFetches:
    """Existence queries and fetches of one scheduler, over ``query`` (the store: Mooncake's in
    vLLM, ``kvtriton.sim.second_tier.SimStore`` in the simulator); ``clock``: seconds now (the
    simulator's clock there). With an ``executor`` the queries run on it, asked ahead; without
    one each runs in the lookup. ``query_latency_s``: in the simulator (whose executor answers at
    once), the seconds after which an answer counts as back."""

    def __init__(self, layout: KVLayout, cpu_pool: BlockPool, query: StoreQuery,
                 faults: FaultLog, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 close: Callable[[], object] | None = None,
                 executor: Executor | None = None,
                 query_latency_s: float | None = None) -> None:
        check_layout(layout)
        self._layout = layout
        self._pool = cpu_pool
        self._query = query
        self.faults = faults
        self._clock = clock
        self._close = close
        # Queries asked when a request arrived, answered off the scheduler's step (``prefetch``).
        self._executor = executor
        self._query_latency_s = query_latency_s
        self._ahead: dict[str, _Query] = {}
        self._pending: list[tuple[list[int], Future]] = []  # asked, not yet sent
        self._pending_lock = threading.Lock()
        self._query_waits: set[str] = set()  # lookups waiting for their query's answer
        self._timeout_s = timeout_s
        # Requests done asking (until they finish) -> the token their last run started at.
        self._asked: dict[str, int] = {}
        self._rounds: dict[str, int] = {}
        self._room_until: dict[str, float] = {}  # rid -> until when it waits for free blocks
        # Blocks a fetch cached for a request still waiting, pinned until its next lookup has
        # pinned its hit: another request's fetch, allocated first in that step, would evict
        # them otherwise.
        self._landed: dict[str, list[int]] = {}
        self._waiting: dict[str, _Wait] = {}
        self._inflight: dict[int, Fetch] = {}  # key id -> the fetch reading it
        self._queued: list[Fetch] = []
        self._events: dict[int, Fetch] = {}
        self._next_event = 0
        self.stats = dict.fromkeys(
            ("second_tier_queries", "second_tier_queries_ahead", "second_tier_query_blocks",
             "second_tier_found_blocks", "second_tier_fetches", "second_tier_blocks_fetched",
             "second_tier_blocks_failed", "second_tier_query_waits"), 0)

    # ---- lookup ------------------------------------------------------------------------------

    def still_waiting(self, rid: str) -> bool:
        """Whether ``rid`` waits for its fetch or its query's answer with time left: its lookup
        can answer "not yet" without looking up the CPU tier again."""
        w = self._waiting.get(rid)
        if w is not None:
            return self._clock() < w.deadline
        if rid in self._query_waits:
            q = self._ahead.get(rid)
            return (q is not None and not self._back(q)
                    and self._clock() < q.asked_at + self._timeout_s)
        return False

    def extend(self, req: Request, num_computed_tokens: int, cpu_hit_tokens: int) -> bool:
        """After the CPU lookup of ``req`` (``cpu_hit_tokens`` past ``num_computed_tokens``):
        True if the request must wait for a fetch (one just queued or in flight)."""
        rid = req.request_id
        if (landed := self._landed.pop(rid, None)) is not None:
            self._pool.free_blocks(landed)  # the lookup just now pinned what it hits
        w = self._waiting.get(rid)
        if w is not None:
            if self._clock() < w.deadline:
                return True
            self._stop_waiting(rid)  # it runs without; the fetches still land in the tier
            self.faults.fault("timeout", detail=f"request {rid!r}")
            return False
        start = num_computed_tokens + cpu_hit_tokens
        if start >= self._asked.get(rid, start + 1) or self._rounds.get(rid, 0) >= MAX_ROUNDS:
            return False
        # Asked before, from further on: its GPU prefix left the GPU while it waited (vLLM may
        # evict a waiting request's cached blocks), so the run now starts earlier.
        self._rounds[rid] = self._rounds.get(rid, 0) + 1
        f, rides, held, whole = self._plan(req, start, self._rounds[rid])
        if f is _NOT_BACK:
            self._rounds[rid] -= 1
            return True
        if f is None and not rides and not whole:
            # The store holds more, but other requests' hits and fetches pin every CPU block:
            # their loads release them within a few steps. Wait for room, at most
            # fetch_timeout_s from the first wait.
            self._rounds[rid] -= 1
            until = self._room_until.setdefault(rid, self._clock() + self._timeout_s)
            if self._clock() < until:
                return True
        self._room_until.pop(rid, None)
        if (f is None and not rides) or whole:
            self._asked[rid] = start
        if f is None and not rides:
            return False
        if f is not None:
            self._queued.append(f)
            self._inflight.update(dict.fromkeys(f.keys, f))
            rides.append(f)
        for g in rides:
            if g.rid != rid:
                g.riders.append(rid)
        self._waiting[rid] = _Wait(self._clock() + self._timeout_s, rides, held)
        return True

    def _plan(self, req: Request, start: int, round_no: int
              ) -> tuple[Fetch | object | None, list[Fetch], list[int], bool]:
        """What completes ``req``'s run from token ``start``: its own fetch (None: nothing to
        fetch; ``_NOT_BACK``: the store's answer is not back yet), the fetches in flight that
        already read other blocks of the run (they are not read twice), the run's CPU blocks
        it pinned, and whether that is the whole run: a run longer than the CPU tier's free
        blocks is fetched in rounds, the next asked for once this one landed and was looked
        up. ``round_no``: which of the request's fetches this is (an answer asked for an
        earlier one is not used)."""
        layout, pool = self._layout, self._pool
        sbs, hbs = layout.scheduler_block_size, layout.hash_block_size
        n_keys = min(req.keys.shape[1], req.num_tokens // hbs)
        end = min(n_keys * hbs, req.num_tokens - 1) // sbs * sbs
        if start % sbs or end <= start:
            return None, [], [], True
        first, n_sched = start // sbs, (end - start) // sbs
        # Per scheduler block j of the run and group g: the primary key of each group block.
        per_group = []
        for g, spec in enumerate(layout.groups):
            r, k = spec.block_size // hbs, sbs // spec.block_size
            idx = np.arange(first * k, (first + n_sched) * k)
            per_group.append(req.keys[g, (idx + 1) * r - 1].reshape(n_sched, k))
        keys = np.concatenate(per_group, axis=1)  # [n_sched, blocks per scheduler block]
        groups = np.concatenate([np.full(p.shape[1], g) for g, p in enumerate(per_group)])
        flat = keys.ravel().tolist()
        in_cpu = np.fromiter((k in pool for k in flat), dtype=bool, count=len(flat))
        need = np.flatnonzero(~in_cpu)
        present = self._presence(req.request_id, [flat[i] for i in need.tolist()], round_no)
        if present is _NOT_BACK:
            return _NOT_BACK, [], [], False
        self.stats["second_tier_queries"] += 1
        self.stats["second_tier_query_blocks"] += len(need)
        if present is None:
            return None, [], [], True
        run, take = fetch_run(in_cpu.reshape(keys.shape), present)
        inflight = self._inflight
        rides = list({id(g): g for g in (inflight.get(flat[i]) for i in take.tolist())
                      if g is not None}.values())
        if rides:
            take = take[[flat[i] not in inflight for i in take.tolist()]]
        held = [pool.get_cached_block(flat[i]) for i in
                np.flatnonzero(in_cpu[:run * keys.shape[1]]).tolist()]
        held = list(dict.fromkeys(b for b in held if b is not None))
        if held:
            pool.touch(held)
        whole = len(take) <= pool.num_free_blocks
        take = take[:pool.num_free_blocks]
        if not len(take) and not rides:
            if held:
                pool.free_blocks(held)
            return None, [], [], whole
        if not len(take):
            return None, rides, held, whole
        self.stats["second_tier_found_blocks"] += len(take)
        cpu = pool.get_new_blocks(len(take))
        return Fetch(req.request_id, cpu, groups[take % keys.shape[1]].tolist(),
                     [flat[i] for i in take.tolist()]), rides, held, whole

    def prefetch(self, rid: str, keys: Iterable[int], asked_at: float | None = None) -> None:
        """Ask the store about ``keys`` (a request that just arrived: its prefix's) on the
        executor, so that its lookup reads the answer instead of a round trip to the master
        inside the scheduler's step. ``asked_at``: when (the clock's seconds; default now).
        Without an executor this does nothing: lookups ask themselves."""
        if self._executor is None or rid in self._ahead:
            return
        ks = list(dict.fromkeys(int(k) for k in keys))
        self._ahead[rid] = self._ask(ks, self._clock() if asked_at is None else asked_at,
                                     True, 1)

    def _ask(self, keys: list[int], asked_at: float, on_arrival: bool, round_no: int
             ) -> _Query:
        """Queue ``keys`` for the executor, which answers every query queued by the time it
        runs in one call to the store (the requests that arrive in one step share a round
        trip)."""
        answer: Future = Future()
        with self._pending_lock:
            self._pending.append((keys, answer))
        self._executor.submit(self._answer_pending)
        return _Query(keys, answer, asked_at, on_arrival, round_no)

    def _answer_pending(self) -> None:
        with self._pending_lock:
            batch, self._pending = self._pending, []
        if not batch:
            return  # an earlier call answered these
        union = list(dict.fromkeys(k for keys, _ in batch for k in keys))
        try:
            present = self._query(union)
        except Exception as e:  # a future left unanswered would hold its request to the timeout
            self.faults.fault("error", detail=f"existence query: {e}")
            present = None
        for keys, answer in batch:
            answer.set_result(None if present is None else _subset(union, present, keys))

    def _back(self, q: _Query, wait: bool = False) -> bool:
        """Whether ``q``'s answer is back; ``wait``: after waiting for it up to
        ``INLINE_WAIT_S`` (the simulator's clock does not move: its answer counts as back if it
        is due by then)."""
        if self._query_latency_s is not None:
            slack = INLINE_WAIT_S if wait else 0.0
            return self._clock() + slack >= q.asked_at + self._query_latency_s
        if wait:
            futures.wait([q.answer], timeout=INLINE_WAIT_S)
        return q.answer.done()

    def pending_queries(self) -> list[float]:
        """When each query not back yet was asked (the simulator wakes for them)."""
        return [q.asked_at for q in self._ahead.values() if not self._back(q)]

    def _presence(self, rid: str, keys: list[int], round_no: int = 1
                  ) -> np.ndarray | object | None:
        """Whether the store holds each of ``keys`` for the request's ``round_no``-th fetch;
        None when it could not say (a fault, counted), ``_NOT_BACK`` while the query is out.
        The first fetch reads the query asked on arrival; a query is asked now when none
        covers ``keys`` (a request that grew since it arrived) or the one there answered an
        earlier round (since then this replica wrote blocks through that it then held on the
        GPU alone: a request whose GPU prefix was evicted while it waited needs them).
        Without an executor: a query now."""
        if self._executor is None:
            return self._query(keys)
        q = self._ahead.get(rid)
        if q is None or q.round != round_no or not set(keys).issubset(q.keys):
            q = self._ahead[rid] = self._ask(keys, self._clock(), False, round_no)
        if not self._back(q, wait=True):
            if self._clock() < q.asked_at + self._timeout_s:
                self.stats["second_tier_query_waits"] += rid not in self._query_waits
                self._query_waits.add(rid)
                return _NOT_BACK
            self._query_waits.discard(rid)
            del self._ahead[rid]  # the request runs without the store's answer
            self.faults.fault("timeout", detail=f"existence query of request {rid!r}")
            return None
        self._query_waits.discard(rid)
        answer = q.answer.result()
        if answer is None:
            return None
        self.stats["second_tier_queries_ahead"] += q.on_arrival
        return _subset(q.keys, answer, keys)

    # ---- per step and reports ----------------------------------------------------------------

    def issue(self) -> list[Fetch]:
        """The fetches queued since the last step, each under a new event."""
        out, self._queued = self._queued, []
        for f in out:
            f.event = self._next_event
            self._next_event += 1
            self._events[f.event] = f
            self.stats["second_tier_fetches"] += 1
        return out

    def apply(self, reports: dict[int, int], bad: dict[int, list[int]], world_size: int) -> None:
        """Workers' fetch reports (event -> how many reported; event -> failed indices): a fetch
        reported by all ``world_size`` completes."""
        for ev, n in reports.items():
            f = self._events.get(ev)
            if f is None:
                continue
            f.reports += n
            f.bad.update(bad.get(ev, ()))
            if f.reports >= world_size:
                del self._events[ev]
                self._complete(f)

    def _complete(self, f: Fetch) -> None:
        pool = self._pool
        good: list[int] = []
        if not f.abandoned:
            good = [i for i in range(len(f.cpu)) if i not in f.bad and f.keys[i] not in pool]
            if good:
                pool.cache_blocks([f.cpu[i] for i in good], [[f.keys[i]] for i in good],
                                  [f.groups[i] for i in good])
            self.stats["second_tier_blocks_fetched"] += len(good)
            self.stats["second_tier_blocks_failed"] += len(f.bad)
        for k in f.keys:
            if self._inflight.get(k) is f:
                del self._inflight[k]
        landed = [f.cpu[i] for i in sorted(good, reverse=True)]  # tail first, when let go
        owner_waits = False
        for rid in (f.rid, *f.riders):
            w = self._waiting.get(rid)
            if w is None or not any(g is f for g in w.fetches):
                continue
            w.fetches = [g for g in w.fetches if g is not f]
            if rid == f.rid:
                owner_waits = True  # the owner's pins are the blocks' first references
            elif landed:
                pool.touch(landed)
            w.landed += landed
            if not w.fetches:
                del self._waiting[rid]
                self._landed[rid] = w.landed + w.held
        kept = set(good) if owner_waits else set()
        rest = [b for i, b in enumerate(f.cpu) if i not in kept]
        if rest:
            pool.free_blocks(rest[::-1])  # tail first: a chain's head outlives its tail

    def _stop_waiting(self, rid: str) -> None:
        """``rid`` no longer waits: what it pinned goes; its fetches still land (a queued
        own fetch is dropped by ``forget``)."""
        w = self._waiting.pop(rid, None)
        if w is None:
            return
        for g in w.fetches:
            if g.rid == rid:
                g.rid = ""  # its blocks land unpinned: nobody waits for them as the owner
            else:
                g.riders.remove(rid)
        if w.landed or w.held:
            self._pool.free_blocks(w.landed + w.held)

    # ---- lifecycle ---------------------------------------------------------------------------

    def forget(self, rid: str) -> None:
        """``rid`` finished: it may ask again if it comes back; a fetch in flight completes."""
        self._asked.pop(rid, None)
        self._ahead.pop(rid, None)
        self._query_waits.discard(rid)
        self._rounds.pop(rid, None)
        self._room_until.pop(rid, None)
        if (landed := self._landed.pop(rid, None)) is not None:
            self._pool.free_blocks(landed)
        w = self._waiting.get(rid)
        own = [g for g in w.fetches if g.rid == rid and g.event < 0 and not g.riders] \
            if w is not None else []
        self._stop_waiting(rid)
        for g in own:  # queued, never issued, nobody else waits for it: dropped
            self._queued.remove(g)
            g.abandoned = True
            self._complete(g)

    def reset(self) -> None:
        """Release every pin and queued fetch; those in flight are freed uncached when
        reported."""
        for rid in list(self._waiting):
            self._stop_waiting(rid)
        for f in self._queued:
            f.abandoned = True
            self._complete(f)
        self._queued.clear()
        for f in self._events.values():
            f.abandoned = True
        self._inflight.clear()
        for landed in self._landed.values():
            self._pool.free_blocks(landed)
        self._landed.clear()
        self._asked.clear()
        self._ahead.clear()
        self._query_waits.clear()
        self._rounds.clear()
        self._room_until.clear()

    def close(self) -> None:
        """Let the store go (the scheduler's client leaves the master)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._close is not None:
            self._close()
            self._close = None

    def has_pending(self) -> bool:
        return bool(self._queued or self._events)

    def referenced_keys(self) -> list[int]:
        """Key ids of fetches queued or in flight (the keys they will be cached under) and of
        queries asked ahead (their answers are looked up by key id)."""
        return [*(k for f in (*self._queued, *self._events.values()) for k in f.keys),
                *(k for q in self._ahead.values() for k in q.keys)]
