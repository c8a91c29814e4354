"""A serving loop close to vLLM's scheduler, driving ``OffloadPlanner`` as vLLM drives a connector.

The scheduler step itself (``kvtriton.sim.batch_scheduler.BatchScheduler``, vLLM 0.32's setup):
running requests first (decode, or the next chunk of a prefill), then requests whose CPU load
landed, then waiting ones in arrival order while the token budget, the GPU blocks and
``max_running`` allow. A new request is looked up in the GPU prefix cache, then in the CPU tier;
a CPU hit allocates its blocks and waits for the load (asynchronous, as in vLLM: it is computed
from a later step on, once the waiting phase reaches it and its chunk fits), unless its bytes
fit the step's ``sync_load_budget_bytes`` (``kvtriton.sync_loads``): then it is computed in the
step that admits it, which starts its compute once that load landed on the host link. With
``reserve_full_isl`` (the default, as vLLM's ``scheduler_reserve_full_isl``) a request is
admitted only when its whole sequence fits. When the GPU runs out of blocks for a running
request the newest running request is preempted (recompute: its blocks are freed and it starts
over).
``build_meta`` is called before the step's tokens count as computed. Finished requests free their
blocks tail first. A request that needs more blocks than the whole GPU pool is rejected.

The clock (``kvtriton.sim.clock.ServingClock``, shared with ``VllmLoop``) adds the workload and
time: arrivals (a conversation's next turn arrives its think time after the previous one
finished), modeled compute time per step, stores and loads that complete after their modeled
transfer time on a per-direction link and reach the planner at the first step boundary after
that, and the run's metrics. This module adds the CPU tier's setup signals (next-use oracle,
hints, waiting-queue lookahead) and the clean-end check. Time is modeled
(``kvtriton.sim.cost``), except the planner's own cost, which is measured. A run ends clean: it
steps on until the planner has nothing pending (the last finish flush issued, every transfer
reported), then both pools must be all free (``UncleanEndError`` otherwise).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from kvtriton.eviction import EvictionQueue
from kvtriton.planner import OffloadPlanner
from kvtriton.pool import BlockPool
from kvtriton.records import Request
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.fetches import StoreFetches
from kvtriton.setups import TierSetup
from kvtriton.sim.batch_scheduler import BatchScheduler
from kvtriton.sim.clock import ServingClock, gpu_blocks_for
from kvtriton.sim.cost import ServingCost
from kvtriton.sim.errors import UncleanEndError
from kvtriton.sim.hooks import IntegrityHook
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.next_use import NextUse, NextUseQueue
from kvtriton.sim.scheduler import SeqBlocks
from kvtriton.sim.second_tier import (
    LOOPBACK_TCP,
    AnsweredAtOnce,
    SimStore,
    StoreCost,
    StoreTier,
)
from kvtriton.sim.workload import Workload, WorkloadRequest, causal_sessions
from kvtriton.specs import KVLayout
from kvtriton.tier_signals import SignalBook, cpu_queue

__all__ = ["POOL_BYTES_PER_BLOCK", "ServingLoop", "gpu_blocks_for", "num_keys"]

# Memory per block of a pool at most: its lists and free queue (73 to 110 bytes measured, by
# eviction rule, plus the int objects the queue creates as it runs) and the planner's per-block
# arrays (8 bytes).
POOL_BYTES_PER_BLOCK = 160


def num_keys(keys: list[np.ndarray]) -> int:
    """Distinct dense key ids a workload's key arrays use (one past the largest)."""
    return max((int(k.max()) + 1 for k in keys if k.size), default=0)


@dataclass(slots=True, eq=False, kw_only=True)
class _Seq(SeqBlocks):
    """A workload request in the scheduler; times in modeled seconds."""

    wr: WorkloadRequest
    arrival_s: float
    first_token_s: float | None = None
    output_done: int = 0  # output tokens sampled


class ServingLoop(ServingClock):
    """One simulation of one workload under one tier setup; ``run()`` returns its metrics.

    ``integrity``: a hook that moves real bytes (``kvtriton.sim.integrity.IntegrityChecker``),
    attached to both pools. ``reserve_full_isl``: admit a request only when its whole sequence
    fits (vLLM 0.32's default); False admits it on its first chunk."""

    def __init__(self, workload: Workload, keys: list[np.ndarray], layout: KVLayout,
                 setup: TierSetup, cost: ServingCost, *, gpu_blocks: int, cpu_blocks: int,
                 token_budget: int = 8192, max_running: int = 256,
                 integrity: IntegrityHook | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 reserve_full_isl: bool = True, store_blocks: int | None = None,
                 store_cost: StoreCost = LOOPBACK_TCP, fetch_timeout_s: float = 5.0,
                 store_tier: StoreTier | None = None, sync_load_budget_bytes: int = 0) -> None:
        super().__init__(workload, layout, cost, RunMetrics(setup=setup.name),
                         gpu_blocks=gpu_blocks, progress=progress)
        self.setup = setup
        self.gpu = BlockPool(gpu_blocks + 1)
        self.cpu: BlockPool | None = None
        self.planner: OffloadPlanner | None = None
        self._index = {wr.request_id: i for i, wr in enumerate(workload.requests)}
        self._next_use: NextUse | None = None
        self._signals: SignalBook | None = None
        self._session_of: list[str] = []
        if setup.planner is not None:
            if setup.infinite_cpu:
                cpu_blocks = num_keys(keys)
            self.cpu = BlockPool(cpu_blocks + 1, eviction=self._cpu_queue(setup, keys),
                                 medium="CPU")
            # The step's token budget sets how far a lazy tier walks the GPU free queue, as the
            # connector takes it from vLLM's max_num_batched_tokens (not the config's default).
            config = replace(setup.planner, max_num_batched_tokens=token_budget)
            self.planner = OffloadPlanner(layout, self.gpu, self.cpu, config)
            self.world_size = setup.planner.world_size
        self.integrity = integrity
        if integrity is not None:
            integrity.attach(self.gpu, self.cpu)
        self.sched = BatchScheduler(layout, self.gpu, self.planner, token_budget=token_budget,
                                    max_running=max_running, null_out_of_window=True,
                                    count_recomputed=True, integrity=integrity,
                                    reserve_full_isl=reserve_full_isl,
                                    sync_load_budget_bytes=sync_load_budget_bytes)
        self.sched.on_first_admit = self._first_admit
        self._keys = keys
        self.step_no = 0
        self._finished_unsent = False  # a request finished in the last step
        self.store: SimStore | None = None
        if setup.second_tier:
            if store_tier is None:
                if store_blocks is None:
                    raise ValueError(f"setup {setup.name!r} has a shared second tier: give "
                                     "its capacity (store_blocks)")
                store_tier = StoreTier(SimStore(store_blocks), store_cost)
            self._add_second_tier(store_tier, fetch_timeout_s)

    def _add_second_tier(self, tier: StoreTier, timeout_s: float) -> None:
        """The store under the CPU tier (``kvtriton.sim.second_tier``; a fleet's replicas
        share ``tier``): written through as the CPU tier caches, fetched from by the
        connector's own ``StoreFetches``."""
        if self.cpu is None:
            raise ValueError(f"setup {self.setup.name!r}: a second tier needs a CPU tier")
        self.store_tier, self.store, self.store_cost = tier, tier.store, tier.cost
        # The tier serves full-attention groups alone (``check_layout``): one block size.
        block_bytes = self.layout.group_block_bytes[0]
        self.cpu.add_batch_listener(
            on_insert_many=lambda keys, _: tier.put(self.now, keys, len(keys) * block_bytes))
        self.sched.second_tier = StoreFetches(self.layout, self.cpu, tier.store.query,
                                              FaultLog("simulator"), timeout_s,
                                              clock=lambda: self.now, executor=AnsweredAtOnce(),
                                              query_latency_s=tier.cost.latency_s)

    def _cpu_queue(self, setup: TierSetup, keys: list[np.ndarray]) -> EvictionQueue:
        """The CPU pool's eviction as the setup builds it (``kvtriton.tier_signals``), with the
        next-use oracle from the trace, and the signal book where hints or the lookahead
        reorder it."""
        oracle = None
        if setup.cpu_eviction == "nextuse":
            self._next_use = NextUse(keys, num_keys(keys))
            oracle = NextUseQueue(self._next_use)
        queue, hinted = cpu_queue(setup, oracle)
        if hinted is not None:
            self._signals = SignalBook(hinted, self._free_cpu_block, hints=setup.hints,
                                       lookahead=setup.lookahead,
                                       session_idle_s=setup.session_idle_s)
            if setup.sessions:
                self._session_of = causal_sessions(self.workload)
        return queue

    def _first_admit(self, seq: _Seq) -> None:
        self.metrics.queue_by_request[seq.req.request_id] = self.now - seq.arrival_s
        i = self._index[seq.req.request_id]
        if self._next_use is not None:
            self._next_use.consume(i)
        if self._signals is not None:
            self._signals.admitted(i, self._keys[i])

    def _free_cpu_block(self, key: int) -> int | None:
        """The free CPU block caching ``key`` (a hint moves it now), or None."""
        b = self.cpu.get_cached_block(key)
        return b if b is not None and self.cpu.is_free(b) else None

    def _end_turn(self, seq: _Seq) -> None:
        """A finished turn's blocks are protected for its session's next turn
        (``SignalBook.turn_ended``; the session as the server knows it: ``causal_sessions``)."""
        i = self._index[seq.req.request_id]
        self._signals.turn_ended(self._session_of[i], self._keys[i], self.now)

    def _apply_hint(self, seq: _Seq) -> None:
        """A finished turn's hint reaches the CPU tier (``SignalBook.finished``)."""
        i = self._index[seq.req.request_id]
        hint = seq.wr.hint
        self._signals.finished(i, self._keys[i], hint)
        self.metrics.hints[hint or "none"] = self.metrics.hints.get(hint or "none", 0) + 1

    @staticmethod
    def bytes_needed(gpu_blocks: int, cpu_blocks: int) -> int:
        """Memory the pools of a loop of these sizes take at most (integrity tensors aside)."""
        return (gpu_blocks + cpu_blocks + 2) * POOL_BYTES_PER_BLOCK

    # ---- arrivals -----------------------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        for at, i, wr in self._due_arrivals():
            req = Request(wr.request_id, self._keys[i], num_prompt_tokens=wr.prompt_len,
                          num_tokens=wr.prompt_len)
            self.sched.add(_Seq(req, wr=wr, arrival_s=at, hint=wr.hint))
            if self.sched.second_tier is not None:  # the connector asks as the request arrives
                self.sched.second_tier.prefetch(wr.request_id, self._keys[i].ravel(), at)
            if self._signals is not None:
                self._signals.arrived(i, self._keys[i])

    def _chunks(self, scheduled: dict[str, int]):
        """The step's chunks as ``ServingClock._step_seconds`` takes them."""
        for rid, n in scheduled.items():
            req = self.sched.seqs[rid].req
            yield n, req.num_computed_tokens, req.num_prompt_tokens

    def _sampled(self, seq: _Seq) -> bool:
        """A token was sampled for ``seq``; whether it was its last."""
        seq.output_done += 1
        if seq.first_token_s is None:
            seq.first_token_s = self.now
            self.metrics.ttft_s.append(self.now - seq.arrival_s)
            self.metrics.ttft_by_request[seq.req.request_id] = self.now - seq.arrival_s
        return seq.output_done >= max(1, seq.wr.output_len)

    # ---- one step -------------------------------------------------------------------------------

    def _has_work(self) -> bool:
        """Whether vLLM's engine core would take a step now (``Scheduler.has_requests``): a
        request waits, runs or loads, one finished in the last step (the step after tells the
        workers), or the planner or the second tier has work pending."""
        sched = self.sched
        return bool(sched.busy or self._finished_unsent
                    or (self.planner is not None and self.planner.has_pending_work())
                    or (sched.second_tier is not None and sched.second_tier.has_pending()))

    def step(self) -> bool:
        """Run one scheduler step; False when everything is done: every request finished or
        rejected, and the planner has nothing pending. Idle (no ``_has_work``), the loop
        schedules nothing until the next arrival, as vLLM's engine core: a step taken anyway
        would run ``build_meta``, where a lazy tier walks the GPU free queue and stores more of
        it than the engine does."""
        if self.integrity is not None:
            self.integrity.begin_step(self.step_no)
        self._admit_arrivals()
        sched = self.sched
        if not self._has_work() and not self._completions:
            return self._wait_for_next_event(False, 0)
        self._finished_unsent = False
        if self.setup.sessions:
            self._signals.expire(self.now)
        scheduled, meta = sched.schedule_step(self.step_no)
        ready = self._submit_sync_load(sched.sync_load)
        if meta is not None:
            self.metrics.build_meta_ms.append(sched.last_build_meta_s * 1e3)
            self._submit_transfers(meta)
        if sched.second_tier is not None:
            self._submit_fetches()
        if scheduled:
            # The step's compute starts once its same-step loads landed.
            self.now = max(self.now, ready) + self._step_seconds(self._chunks(scheduled))
            for seq in sched.advance(scheduled, self._sampled):
                self._finished_unsent = True
                self.metrics.finished += 1
                if self.setup.hints:
                    self._apply_hint(seq)
                elif self.setup.sessions:
                    self._end_turn(seq)
                self._release_successors(seq.req.request_id)
            self.metrics.steps += 1
        elif sched.last_preempted:
            # Nothing ran, but the step freed a preempted request's blocks and skipped the
            # waiting phase, as vLLM does: the next step schedules into that room. No time
            # passes, and it is not a deadlock for want of an event to wait for.
            pass
        else:
            if sched.second_tier is not None:  # requests waiting for the store's answer
                for t in sched.second_tier.pending_queries():
                    self._push_completion(t + self.store_cost.latency_s, "query", -1, [])
            if not self._wait_for_next_event(sched.busy, len(sched.seqs)):
                return False
        if self.planner is not None:
            loads, stores = self._due_reports()
            sched.deliver(loads, stores, self.step_no)
            if self.fetches_done:
                world = self.world_size
                sched.second_tier.apply(dict.fromkeys(self.fetches_done, world), {}, world)
                self.fetches_done.clear()
        self.step_no += 1
        # A finish flush is issued by the next build_meta, even when nothing else is in flight.
        return bool(self._pending() or sched.busy
                    or (self.planner is not None and self.planner.has_pending_work())
                    or (sched.second_tier is not None and sched.second_tier.has_pending()))

    def _submit_fetches(self) -> None:
        """The step's fetches from the store: each completes after its modeled time on the store
        link, behind the fetches before it."""
        per = self.layout.group_block_bytes
        for f in self.sched.second_tier.issue():
            nbytes = sum(per[g] for g in f.groups)
            done = self.store_tier.get(self.now, nbytes)
            self._push_completion(done, "fetch", f.event, [])

    def _check_clean_end(self) -> None:
        """``UncleanEndError`` unless every request left, the planner has nothing pending and
        both pools are all free (cached keys may remain). O(1)."""
        problems = []
        if self.sched.seqs or self.sched.busy:
            problems.append(f"{len(self.sched.seqs)} requests still in the scheduler")
        if self._arrivals or self._successors:
            problems.append(f"{len(self._arrivals) + len(self._successors)} requests never "
                            "arrived")
        if self.planner is not None and self.planner.has_pending_work():
            problems.append(f"the planner still has work pending "
                            f"({self.planner.pending_store_blocks()} blocks to store, "
                            f"{len(self.planner.loads_in_flight())} loads in flight)")
        problems += [f"{pool.num_used_blocks} of {pool.num_blocks - 1} {pool.medium} blocks "
                     "still held" for pool in (self.gpu, self.cpu)
                     if pool is not None and pool.num_used_blocks]
        if problems:
            raise UncleanEndError(f"setup {self.setup.name!r}: the run ended at step "
                                  f"{self.step_no} with " + "; ".join(problems))

    def _end_run(self) -> None:
        self._check_clean_end()
        m, sched = self.metrics, self.sched
        m.prompt_tokens, m.prefill_tokens = sched.prompt_tokens, sched.prefill_tokens
        m.gpu_hit_tokens, m.cpu_hit_tokens = sched.gpu_hit_tokens, sched.cpu_hit_tokens
        m.tokens_by_request = sched.first_admit_tokens
        m.recomputed_tokens, m.preemptions = sched.recomputed_tokens, sched.preemptions
        m.sync_loads = sched.sync_loads
        m.planner_s = sched.planner_s
        if self.planner is not None:
            m.planner = self.planner.stats.as_dict()
            m.planner["running_evictions"] = self.planner.selector.running_evictions
        if self._signals is not None:
            m.planner["protect_overflow"] = self._signals.queue.protect_overflow
            if self.setup.sessions:
                m.planner["sessions_expired"] = self._signals.sessions_expired
