"""The serving-loop skeleton both schedulers share: arrivals, the modeled clock, the host link,
transfer completions, step time and the end of a run.

``ServingClock`` owns everything of a simulation that is not a scheduling decision. A loop
(``kvtriton.sim.loop.ServingLoop`` with kvtriton's scheduler, ``kvtriton.sim.vllm_loop.VllmLoop``
with vLLM's) subclasses it and writes ``step()``: admit the due arrivals, schedule, submit the
step's transfers, advance the clock by the step's modeled time (or to the next event when
nothing ran), deliver the reports that are due. So the two loops cannot drift in how time,
transfers or arrivals are modeled. Times are modeled seconds (``kvtriton.sim.cost``).
"""

from __future__ import annotations

import heapq
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from math import inf

from kvtriton.records import PlannerMeta, Transfer
from kvtriton.sim.cost import ServingCost
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import KVLayout

__all__ = ["PROGRESS_EVERY", "Link", "ServingClock", "gpu_blocks_for"]

#: Steps between two progress callbacks.
PROGRESS_EVERY = 256


def gpu_blocks_for(layout: KVLayout, wr: WorkloadRequest) -> int:
    """GPU blocks ``wr`` holds at its full length in every group: a request needing more than
    the whole GPU pool is rejected, as a server rejects a prompt longer than its context."""
    return sum(-(-wr.total_len // g.block_size) for g in layout.groups)


@dataclass(slots=True)
class Link:
    """One direction of the host link: transfers queue behind each other."""

    free_at: float = 0.0
    bytes: int = 0

    def submit(self, now: float, nbytes: int, seconds: float) -> float:
        """Queue ``nbytes`` taking ``seconds`` at ``now``; returns when it completes."""
        self.free_at = max(now, self.free_at) + seconds
        self.bytes += nbytes
        return self.free_at


class ServingClock(ABC):
    """One workload's clock under one tier setup: a subclass supplies ``step()`` (one scheduler
    step, False when everything is done) and ``_end_run()`` (its end-of-run checks and
    counters); ``run()`` drives it and returns the metrics.

    ``gpu_blocks``: the GPU pool's usable blocks (a request needing more is rejected);
    ``world_size``: how many workers report each store."""

    def __init__(self, workload: Workload, layout: KVLayout, cost: ServingCost,
                 metrics: RunMetrics, *, gpu_blocks: int, world_size: int = 1,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.workload = workload
        self.layout = layout
        self.cost = cost
        self.metrics = metrics
        self.progress = progress
        self.world_size = world_size
        self._gpu_capacity = gpu_blocks
        self._arrivals, self._successors = workload.arrival_queue()
        self._completions: list[tuple[float, int, str, int, list[str]]] = []
        self._seq_no = 0
        self._d2h, self._h2d = Link(), Link()
        self.fetches_done: list[int] = []  # second-tier fetch events completed, not yet applied
        self.now = 0.0
        # In a fleet (``kvtriton.sim.fleet``): who releases a finished request's next turns
        # (request id, now), and when the fleet's next arrival is (a replica with nothing to
        # do waits for it instead of running its clock past it).
        self.on_release: Callable[[str, float], None] | None = None
        self.next_external: Callable[[], float] | None = None

    # ---- a fleet's view (``kvtriton.sim.fleet``): what a router reads, how a request comes in ----

    def join_fleet(self, on_release: Callable[[str, float], None],
                   next_arrival: Callable[[], float]) -> None:
        """The fleet owns the arrivals from now on: this replica forgets its own, calls
        ``on_release(request id, now)`` when a turn finishes (the fleet releases its next
        turns), and waits for ``next_arrival()`` when it has nothing to do."""
        self._arrivals, self._successors = [], {}
        self.on_release = on_release
        self.next_external = next_arrival

    def accept(self, at: float, index: int) -> None:
        """The fleet routed request ``index`` of the workload here, arriving at ``at`` (s)."""
        heapq.heappush(self._arrivals, (at, index))
        self.now = max(self.now, at)

    @property
    def num_not_admitted(self) -> int:
        """Requests routed here that have not reached the scheduler yet."""
        return len(self._arrivals)

    @property
    def next_completion_s(self) -> float:
        """When the next transfer completes (s; ``inf``: none in flight)."""
        return self._completions[0][0] if self._completions else inf

    # ---- arrivals ------------------------------------------------------------------------------

    def _due_arrivals(self) -> Iterator[tuple[float, int, WorkloadRequest]]:
        """The requests that have arrived by now, as ``(arrival time, index, request)``; a
        request larger than the whole GPU pool is counted rejected and not yielded (the turns
        after it are released)."""
        while self._arrivals and self._arrivals[0][0] <= self.now:
            at, i = heapq.heappop(self._arrivals)
            wr = self.workload.requests[i]
            if gpu_blocks_for(self.layout, wr) > self._gpu_capacity:
                self.metrics.rejected += 1
                self._release_successors(wr.request_id)
                continue
            yield at, i, wr

    def _release_successors(self, rid: str) -> None:
        """``rid`` finished: the turns waiting for it arrive after their think time."""
        if self.on_release is not None:
            self.on_release(rid, self.now)
        else:
            self.workload.release_after(rid, self.now, self._arrivals, self._successors)

    # ---- transfers -----------------------------------------------------------------------------

    def _submit_transfers(self, meta: PlannerMeta) -> None:
        """The step's store and load: each completes after its modeled time on its link."""
        per = self.layout.group_block_bytes
        if len(meta.store):
            nbytes = sum(per[g] for g in meta.store.groups)
            done = self._d2h.submit(self.now, nbytes, self.cost.d2h_s(nbytes))
            self._push_completion(done, "store", meta.store.event, [])
        if len(meta.load):
            nbytes = sum(per[g] for g in meta.load.groups)
            done = self._h2d.submit(self.now, nbytes, self.cost.h2d_s(nbytes))
            self._push_completion(done, "load", meta.load.event,
                                  meta.load_event_to_reqs[meta.load.event])

    def _submit_sync_load(self, load: Transfer) -> float:
        """The step's same-step loads (``kvtriton.sync_loads``), on the host link ahead of the
        step's other transfers: when they have landed, which is when the step's compute can
        start (``now`` when there are none). Their requests are computed in this step, so no
        completion is queued: the scheduler reports them to the planner itself."""
        if not len(load):
            return self.now
        nbytes = sum(self.layout.group_block_bytes[g] for g in load.groups)
        return self._h2d.submit(self.now, nbytes, self.cost.h2d_s(nbytes))

    def _push_completion(self, at: float, kind: str, event: int, reqs: list[str]) -> None:
        self._seq_no += 1
        heapq.heappush(self._completions, (at, self._seq_no, kind, event, reqs))

    def _due_reports(self) -> tuple[list[str], dict[int, int]]:
        """Transfers completed by now: request ids whose loads landed (in completion order),
        and per store event the workers reporting it."""
        loads, stores = [], {}
        while self._completions and self._completions[0][0] <= self.now:
            _, _, kind, event, reqs = heapq.heappop(self._completions)
            if kind == "store":
                stores[event] = self.world_size
            elif kind == "fetch":
                self.fetches_done.append(event)
            elif kind == "query":
                pass  # a second-tier existence query is back: the loop only had to wake
            else:
                loads += reqs
        return loads, stores

    # ---- time ----------------------------------------------------------------------------------

    def _step_seconds(self, chunks: Iterable[tuple[int, int, int]]) -> float:
        """Modeled seconds of a step computing ``chunks``: per request ``(tokens, tokens
        computed before, prompt tokens)``. One token past the prompt is a decode."""
        cost = self.cost
        seconds = cost.step_overhead_s
        decode_ctx = []
        for n, before, prompt in chunks:
            if n == 1 and before >= prompt:
                decode_ctx.append(before)
            else:
                seconds += cost.prefill_s(n, before)
        if decode_ctx:
            seconds += cost.decode_step_s(decode_ctx)
        return seconds

    def _wait_for_next_event(self, busy: bool, requests_left: int) -> bool:
        """Nothing ran this step: move the clock to the next arrival or completion. False when
        there is none and the scheduler is not ``busy`` (the run is over); a ``RuntimeError``
        when it is, with nothing to wait for: every later step would repeat this one (a
        scheduling deadlock)."""
        times = [q[0][0] for q in (self._arrivals, self._completions) if q]
        if self.next_external is not None and self.next_external() < min(times, default=inf):
            return False  # the fleet routes its next arrival first, then steps this again
        if not times:
            if busy:
                raise RuntimeError(f"setup {self.metrics.setup!r}: {requests_left} requests "
                                   "left with nothing scheduled and no arrival or transfer to "
                                   "wait for")
            return False
        self.now = max(self.now, min(times))
        return True

    def _pending(self) -> bool:
        """Arrivals or transfer completions still to come."""
        return bool(self._arrivals or self._completions)

    # ---- the run -------------------------------------------------------------------------------

    @abstractmethod
    def step(self) -> bool:
        """One scheduler step; False when everything is done."""

    @abstractmethod
    def _end_run(self) -> None:
        """The subclass's end-of-run checks and counters, before the common ones are set."""

    def run(self) -> RunMetrics:
        """Step until done; the run's metrics (times modeled, ``wall_s`` measured)."""
        t0 = time.perf_counter()
        total = len(self.workload)
        steps = 0
        while self.step():
            steps += 1
            if self.progress is not None and steps % PROGRESS_EVERY == 0:
                self.progress(self.metrics.finished, total)
        m = self.finish_run(total)
        m.wall_s = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(m.finished, total)
        return m

    def finish_run(self, requests: int) -> RunMetrics:
        """The end-of-run checks and counters once stepping is over (``requests``: how many
        came to this loop)."""
        self._end_run()
        m = self.metrics
        m.makespan_s = self.now
        m.requests = requests
        m.bytes_d2h, m.bytes_h2d = self._d2h.bytes, self._h2d.bytes
        return m

