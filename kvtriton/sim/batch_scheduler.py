"""vLLM 0.32's step policy over the scheduler core: ``BatchScheduler``.

``BatchScheduler`` is ``KVScheduler`` (``kvtriton.sim.scheduler``) plus the queues and the policy
that sequence its operations: running requests first (decode, or the next chunk of a prefill),
then requests whose CPU load landed, then waiting ones in arrival order while the token budget,
the GPU blocks and ``max_running`` allow; when the GPU runs out of blocks for a running request
the newest running request is preempted (recompute). A CPU hit holds its blocks while its load
runs and is scheduled, without preempting anyone, once the waiting phase of a step after the
load landed reaches it. By default a request is admitted only when its whole sequence fits
(vLLM's ``scheduler_reserve_full_isl``). The serving-loop simulator (``kvtriton.sim.loop``) and
the memory soak (``bench/conformance/planner_soak.py``) drive it step by step, each with its own
clock, workload and report delays; the policy sits apart from the core because the tests' planner
driver calls the core's operations one by one, with none of it.

Lengths are in tokens unless named blocks (of the group's own block size).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping

from kvtriton.lookup import Hit
from kvtriton.planner import OffloadPlanner
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.records import PlannerMeta, Transfer
from kvtriton.sim.hooks import IntegrityHook
from kvtriton.sim.scheduler import KVScheduler, SeqBlocks
from kvtriton.specs import KVLayout
from kvtriton.sync_loads import SyncLoadBudget, split_sync_loads

__all__ = ["BatchScheduler"]


#: ``_admit``'s answer for a request vLLM skips this step (its lookup is not known yet).
SKIP = -1


class BatchScheduler(KVScheduler):
    """``KVScheduler`` with waiting, running and loading queues and vLLM's step policy.

    A caller ``add``s requests as they arrive, then per step: ``schedule_step`` (which requests
    run how many tokens, and the planner's transfers for the step), its own compute and transfer
    timing, ``advance`` (the scheduled tokens count as computed; sampled tokens, finishes) and
    ``deliver`` (worker reports that arrived). ``prompt_tokens``, ``gpu_hit_tokens`` and
    ``cpu_hit_tokens`` count each request's first admission; ``prefill_tokens`` the prompt tokens
    computed (recomputation after a preemption included); ``token_budget`` caps the tokens of a
    step, ``max_running`` the running requests.

    The step follows vLLM 0.32's ``Scheduler.schedule()``:

    - Running requests first, in order; when one's chunk does not fit, the newest running
      request is preempted (recompute), until it fits or the request preempted itself. After a
      preemption no waiting request is scheduled that step.
    - Then the requests holding blocks for a CPU load (``loading``; vLLM's
      ``kv_holding_waiting``), in admission order, before any fresh request: one whose load is
      still in flight is skipped; one whose load landed has its loaded blocks registered in the
      GPU prefix cache when it is reached (vLLM's ``_update_waiting_for_remote_kv``), and its
      first chunk is allocated without preempting anyone. If that allocation fails, the
      waiting phase stops and the request keeps its blocks for a later step. It is never a
      preemption victim: only running requests are.
    - Then waiting requests in arrival order: the GPU prefix-cache lookup, then always the
      CPU lookup (vLLM asks the connector before it tries to allocate), then allocation. A CPU
      hit allocates its blocks and waits for its load; GPU-hit pages its CPU hit leaves out of
      a sliding window are not taken (vLLM skips them).
    - Same-step loads (``sync_load_budget_bytes``, ``kvtriton.sync_loads``): a CPU hit whose
      bytes fit what is left of the step's budget is computed in the step that admits it,
      like a GPU hit, once its load landed before the step's compute (the loop puts that load
      on the step's critical path: ``sync_load``); it takes no in-flight reservation and never
      waits in ``loading``.
    - ``reserve_full_isl`` (vLLM's ``scheduler_reserve_full_isl``, on by default there and
      here): a waiting request, or a landed load's request, is scheduled only if the blocks
      its whole sequence needs are free, not only its first chunk's. False: the first chunk
      must fit (vLLM with ``scheduler_reserve_full_isl=False``).
    - A CPU hit is admitted only if its blocks fit in the free blocks minus what in-flight
      prefills still need to hold their whole sequence (vLLM's
      ``_inflight_prefill_reserved_blocks``): a load holds its blocks for the whole transfer
      and cannot be preempted, so it must not take blocks a prefill already admitted relies on.

    Not modeled: vLLM registers a chunk's full blocks in the prefix cache when it allocates
    them, so a request admitted later in the same step can hit blocks another computes in that
    step; here blocks join the prefix cache once computed (``advance``), from the next step.
    """

    def __init__(self, layout: KVLayout, gpu: BlockPool, planner: OffloadPlanner | None, *,
                 token_budget: int, max_running: int, null_out_of_window: bool = True,
                 count_recomputed: bool = False, integrity: IntegrityHook | None = None,
                 reserve_full_isl: bool = True, sync_load_budget_bytes: int = 0) -> None:
        super().__init__(layout, gpu, planner, null_out_of_window=null_out_of_window,
                         count_recomputed=count_recomputed, integrity=integrity)
        self.token_budget = token_budget
        self.max_running = max_running
        self.reserve_full_isl = reserve_full_isl
        self.sync_budget = SyncLoadBudget(layout, sync_load_budget_bytes)
        #: The last ``schedule_step``'s same-step loads (their pairs; event -1 when none), and
        #: how many requests were loaded so, all steps together.
        self.sync_load = Transfer()
        self.sync_loads = 0
        # Admitted this step on a same-step load, with the token its load starts at.
        self._sync_seqs: list[tuple[SeqBlocks, int]] = []
        self._sync_landed: list[str] = []  # landed, not yet reported to the planner
        self.seqs: dict[str, SeqBlocks] = {}  # every request not finished, in arrival order
        self.waiting: deque[SeqBlocks] = deque()
        self.running: list[SeqBlocks] = []
        # Requests holding blocks for a CPU load, in admission order (vLLM's kv_holding_waiting):
        # the load in flight (``pending_ext`` > 0), or landed and not yet scheduled.
        self.loading: dict[str, SeqBlocks] = {}
        self._landed_unregistered: set[str] = set()  # landed, blocks not yet in the prefix cache
        self._finished_last: set[str] = set()
        #: The requests the last ``schedule_step`` preempted: a step that preempted changed the
        #: state even when it scheduled nothing (vLLM skips the waiting phase in such a step).
        self.last_preempted: set[str] = set()
        self.prompt_tokens = 0
        self.gpu_hit_tokens = 0
        self.cpu_hit_tokens = 0
        #: Per request id, at its first admission: (prompt tokens, GPU hit, CPU hit tokens).
        self.first_admit_tokens: dict[str, tuple[int, int, int]] = {}
        self.prefill_tokens = 0
        self.preemptions = 0
        #: Called with a request the first time it is admitted (its lookup ran, it got blocks).
        self.on_first_admit: Callable[[SeqBlocks], None] | None = None
        # Per group, the tokens whose blocks a reservation counts at most (None: all of them):
        # vLLM caps a sliding window's admission at the blocks it can hold at once
        # (SlidingWindowSpec.max_admission_blocks_per_request: window - 1 plus one step's tokens,
        # plus one block), as its pages are recycled while the prefill runs. Mamba states are
        # recycled too (all but the last are dropped once computed): capped at one step's
        # states plus the one kept (kvtriton's own model; vLLM's Mamba groups are not
        # cross-checked).
        self._hold_cap: list[int | None] = []
        for spec in layout.groups:
            if spec.kind == "sliding_window":
                blocks = -(-(spec.sliding_window - 1 + token_budget) // spec.block_size) + 1
            elif spec.kind == "mamba":
                blocks = -(-token_budget // spec.block_size) + 1
            else:
                self._hold_cap.append(None)
                continue
            self._hold_cap.append(blocks * spec.block_size)

    @property
    def busy(self) -> bool:
        """Whether a request waits, runs or waits for its load."""
        return bool(self.waiting or self.running or self.loading)

    def add(self, seq: SeqBlocks) -> None:
        """A request arrives: it waits behind those already waiting."""
        self.empty_tables(seq)
        self.seqs[seq.req.request_id] = seq
        self.waiting.append(seq)

    # ---- scheduling -------------------------------------------------------------------------

    def blocks_to_hold(self, tables: Iterable[list[int]], tokens: int, computed: int = 0
                       ) -> list[int]:
        """Per group, the blocks a request holding ``tables`` (with ``computed`` tokens
        computed) still needs to hold ``tokens`` tokens: ``blocks_needed``, with recycled
        groups capped at what they hold at once (vLLM's ``get_num_blocks_to_allocate`` with
        ``apply_admission_cap``, the count of ``scheduler_reserve_full_isl`` and of the in-flight
        prefill reservation)."""
        return [self._group_blocks_needed(g, table, tokens if cap is None else min(tokens, cap),
                                          computed)
                for g, (cap, table) in enumerate(zip(self._hold_cap, tables, strict=True))]

    def _inflight_reserved(self, scheduled: Mapping[str, int]) -> int:
        """Blocks that requests still prefilling need to hold their whole sequence (vLLM's
        ``_inflight_prefill_reserved_blocks``): running requests whose sequence this step's
        chunk does not complete, and every request holding blocks for a CPU load. (The waiting
        phase runs only when every running request was scheduled, so a running request not in
        ``scheduled`` does not occur here.)"""
        total = 0
        for seq in self.running:
            req = seq.req
            if req.num_computed_tokens + scheduled.get(req.request_id, 0) < req.num_tokens:
                total += sum(self.blocks_to_hold(seq.tables, req.num_tokens,
                                                 req.num_computed_tokens))
        for seq in self.loading.values():
            req = seq.req
            total += sum(self.blocks_to_hold(seq.tables, req.num_tokens,
                                             req.num_computed_tokens + seq.pending_ext))
        return total

    def _past_window(self, hit: Hit, computed: int) -> Hit:
        """``hit`` with the GPU-hit pages a CPU hit reaching ``computed`` tokens leaves out of
        the window as null pages: vLLM skips a sliding window's cached blocks that are already
        out of the window at the local plus external hit (``add_local_computed_blocks``), so
        they are neither touched nor held. (Mamba: the states before ``computed``'s.)"""
        if not self.null_out_of_window:
            return hit
        blocks = []
        for g, table in enumerate(hit.blocks):
            skip = self._out_of_window(g, 0, len(table), computed)
            blocks.append([NULL_BLOCK] * skip + table[skip:] if skip else table)
        return Hit(hit.num_tokens, tuple(blocks), hit.iterations)

    def _admit(self, seq: SeqBlocks, budget: int, scheduled: Mapping[str, int]) -> int | None:
        """Schedule a waiting request; the tokens scheduled (0 while its load runs), None if it
        does not fit, or ``SKIP`` while it waits for a fetch from the second tier.
        ``scheduled``: the step's tokens so far."""
        req = seq.req
        hit = self.gpu_hit(req)
        local = hit.num_tokens
        # The CPU lookup comes first, whether or not anything then fits: vLLM calls the
        # connector's get_num_new_matched_tokens before allocate_slots, and the lookup pins
        # and touches the CPU blocks it matches (their eviction order changes) even when the
        # request then waits.
        ext = self.cpu_hit(req, local)
        if ext is None:
            return SKIP  # vLLM skips it this step: its blocks from the store are on their way
        computed = local + ext
        rid = req.request_id
        sync = bool(ext) and self.sync_budget.reserve(rid, local, ext, req.num_tokens)
        if ext:
            hit = self._past_window(hit, computed)
        if sync:
            target = computed + min(req.num_tokens - computed, budget)
        else:
            target = computed if ext else local + min(req.num_tokens - local, budget)
        hit_blocks = [b for blocks in hit.blocks for b in blocks if b != NULL_BLOCK]
        # Touching a free cached hit block takes it out of the free queue: it counts as taken
        # (vLLM's num_evictable_blocks).
        touched = self.gpu.count_free(hit_blocks)
        free = self.gpu.num_free_blocks
        if self.reserve_full_isl and \
                sum(self.blocks_to_hold(hit.blocks, req.num_tokens, computed)) + touched > free:
            self.sync_budget.release(rid)
            return None
        if ext and not sync:
            # An async load holds its blocks for the whole transfer and cannot be preempted:
            # vLLM admits it only into the free blocks in-flight prefills do not need
            # (reserved_blocks = _inflight_prefill_reserved_blocks()).
            free -= self._inflight_reserved(scheduled)
        if sum(self.blocks_needed(hit.blocks, target, computed=computed)) + touched > free:
            self.sync_budget.release(rid)
            return None
        self.install_hit(seq, hit)
        self.grow(seq, target, computed=computed)
        self.after_alloc(seq, ext)
        req.num_computed_tokens = computed if sync else local
        if not seq.admitted_once:
            seq.admitted_once = True
            self.prompt_tokens += req.num_prompt_tokens
            self.gpu_hit_tokens += local
            self.cpu_hit_tokens += ext
            self.first_admit_tokens[req.request_id] = (req.num_prompt_tokens, local, ext)
            if self.on_first_admit is not None:
                self.on_first_admit(seq)
        if sync:
            self._sync_seqs.append((seq, local))
            self.running.append(seq)
            return target - computed
        if ext:
            seq.pending_ext = ext
            self.loading[req.request_id] = seq
            return 0
        self.running.append(seq)
        return target - local

    def _schedule_loaded(self, seq: SeqBlocks, budget: int) -> int | None:
        """The first chunk of a request whose load landed, reached in the waiting phase: its
        loaded blocks join the GPU prefix cache (once), then its chunk is allocated from the
        free blocks, preempting nobody (vLLM: allocate_slots, None stops the waiting phase).
        The tokens scheduled, or None if they do not fit (it keeps its blocks)."""
        req = seq.req
        if req.request_id in self._landed_unregistered:
            self._landed_unregistered.discard(req.request_id)
            self.cache_computed(seq, computed_here=False)
        free = self.gpu.num_free_blocks
        if self.reserve_full_isl and sum(self.blocks_to_hold(
                seq.tables, req.num_tokens, req.num_computed_tokens)) > free:
            return None
        n = min(req.num_tokens - req.num_computed_tokens, budget)
        if not self.try_grow(seq, req.num_computed_tokens + n):
            return None
        return n

    def preempt(self, seq: SeqBlocks) -> None:
        """Preempt a running request by recompute: it waits again, ahead of every other."""
        self.running.remove(seq)
        super().preempt(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _schedule(self) -> tuple[dict[str, int], set[str]]:
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        for seq in list(self.running):
            rid = seq.req.request_id
            if rid in preempted or budget <= 0:
                continue
            req = seq.req
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.try_grow(seq, req.num_computed_tokens + n):
                victim = self.running[-1]
                self.preempt(victim)
                preempted.add(victim.req.request_id)
                if victim is seq:
                    break
            if rid in preempted:
                continue
            scheduled[rid] = n
            budget -= n
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        return scheduled, preempted

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        """vLLM's waiting phase: requests holding blocks for a load first, then fresh ones;
        it stops at the first that does not fit, or when the budget or ``max_running`` is
        spent."""
        for rid, seq in list(self.loading.items()):
            if budget <= 0 or len(self.running) >= self.max_running:
                return
            if seq.pending_ext:
                continue  # its load is in flight: skipped this step
            n = self._schedule_loaded(seq, budget)
            if n is None:
                return
            del self.loading[rid]
            self.running.append(seq)
            scheduled[rid] = n
            budget -= n
        skipped: list[SeqBlocks] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = self._admit(seq, budget, scheduled)
            if n is None:
                break
            self.waiting.popleft()
            if n == SKIP:
                skipped.append(seq)  # vLLM's skip_request: back at the front, in order
                continue
            if n:
                scheduled[seq.req.request_id] = n
                budget -= n
        self.waiting.extendleft(reversed(skipped))

    def schedule_step(self, step_no: int = -1) -> tuple[dict[str, int], PlannerMeta | None]:
        """Tokens scheduled per request id this step, and the planner's transfers for it (None
        without a planner). ``build_meta`` runs before the step's tokens count as computed.
        The step's same-step loads are taken out of the returned load into ``sync_load``; they
        have landed when this returns (their blocks are in the GPU prefix cache). ``step_no``
        names the step in integrity errors."""
        scheduled, preempted = self._schedule()
        self.last_preempted = preempted
        finished, self._finished_last = self._finished_last, set()
        step = self.step_output(self.seqs.values(), scheduled, preempted=preempted,
                                finished=finished)
        queued = self.planner.queued_loads() if self._sync_seqs else {}
        meta = self.build_meta(step) if self.planner is not None else None
        self.sync_budget.new_step()
        self.sync_load = Transfer()
        if self._sync_seqs:
            sync = [seq.req.request_id for seq, _ in self._sync_seqs]
            meta, self.sync_load = split_sync_loads(meta, queued, sync)
            for seq, start in self._sync_seqs:
                self._sync_landed_now(seq, start, step_no)
            self.sync_loads += len(sync)
            self._sync_seqs = []
        return scheduled, meta

    def _sync_landed_now(self, seq: SeqBlocks, start: int, step_no: int) -> None:
        """``seq``'s same-step load (tokens ``start`` to its computed ones) landed: its blocks
        join the GPU prefix cache (not computed here), as a landed asynchronous load's do; the
        planner hears of it in the step's ``deliver``."""
        req = seq.req
        if self.integrity is not None:
            self.integrity.check_load(req.request_id, req.keys, seq.tables, start,
                                      req.num_computed_tokens, step_no)
        self.cache_computed(seq, computed_here=False)
        self._sync_landed.append(req.request_id)

    # ---- after the step's compute -----------------------------------------------------------

    def advance(self, scheduled: dict[str, int], sampled: Callable[[SeqBlocks], bool]
                ) -> list[SeqBlocks]:
        """The scheduled tokens are computed: full blocks join the GPU prefix cache. A request
        whose tokens are all computed samples one; ``sampled(seq)`` says whether that was its
        last (it finishes) or the sequence grows by it. Returns the finished requests."""
        done = []
        for rid, n in scheduled.items():
            seq = self.seqs[rid]
            req = seq.req
            if req.num_computed_tokens < req.num_prompt_tokens:
                self.prefill_tokens += n
            req.num_computed_tokens += n
            self.cache_computed(seq)
            if req.num_computed_tokens == req.num_tokens:
                if sampled(seq):
                    self.finish(seq)
                    done.append(seq)
                else:
                    req.num_tokens += 1
        return done

    def finish(self, seq: SeqBlocks) -> None:
        """A running request finished: the next step reports it."""
        rid = seq.req.request_id
        self.running.remove(seq)
        super().finish(seq)
        self._finished_last.add(rid)
        del self.seqs[rid]

    def deliver(self, finished_loads: list[str],
                completed_stores: Mapping[int, int] | Iterable[int], step: int) -> None:
        """Worker reports to the planner; each finished load is checked by the integrity hook
        (``step`` names the step in its errors), then its tokens count as computed. The request
        stays in ``loading``, holding its blocks, until the waiting phase of a later step
        reaches it and its first chunk fits (see ``_schedule_loaded``); it does not join
        ``running`` here, so it can neither preempt nor be preempted before then."""
        landed, self._sync_landed = self._sync_landed, []
        if not finished_loads and not completed_stores and not landed:
            return
        if self.integrity is not None:
            for rid in finished_loads:
                seq = self.loading[rid]
                start = seq.req.num_computed_tokens
                self.integrity.check_load(rid, seq.req.keys, seq.tables, start,
                                          start + seq.pending_ext, step)
        # Same-step loads after the others, in the order the connector hands them over.
        self.apply_reports(finished_loads=[*finished_loads, *landed],
                           completed_stores=completed_stores)
        for rid in finished_loads:
            seq = self.loading[rid]
            seq.req.num_computed_tokens += seq.pending_ext
            seq.pending_ext = 0
            self._landed_unregistered.add(rid)
