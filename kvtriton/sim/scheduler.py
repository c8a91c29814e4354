"""The KV side of a vLLM-like scheduler step, around ``OffloadPlanner`` as vLLM drives a connector.

One implementation, used by the serving-loop simulator (``kvtriton.sim.loop``), the tests'
planner driver (``tests/helpers/planner_driver.py``) and the memory soak
(``bench/planner/soak.py``):

- ``KVScheduler``: the GPU pool, the planner and per-request block tables (``SeqBlocks``), and the
  operations a caller sequences itself: a GPU prefix-cache lookup and the planner's CPU lookup,
  allocation (null pages where a hit leaves a position unused, as in vLLM), registering newly
  full blocks in the GPU prefix cache (and dropping what a group no longer needs: sliding-window
  pages left behind, Mamba states before the last one, whose saved boundaries are handed to the
  planner), preemption, finish (blocks freed tail first), the ``StepOutput`` and delivering
  worker reports to the planner. The tests' planner driver calls it call by call.
- ``BatchScheduler``: the same plus vLLM 0.32's step policy: running requests first (decode, or
  the next chunk of a prefill), then requests whose CPU load landed, then waiting ones in arrival
  order while the token budget, the GPU blocks and ``max_running`` allow; when the GPU runs out
  of blocks for a running request the newest running request is preempted (recompute). A CPU hit
  holds its blocks while its load runs and is scheduled, without preempting anyone, once the
  waiting phase of a step after the load landed reaches it. By default a request is admitted
  only when its whole sequence fits (vLLM's ``scheduler_reserve_full_isl``). The simulator and
  the soak drive it step by step, each with its own clock, workload and report delays.

Lengths are in tokens unless named blocks (of the group's own block size); ``planner_s`` and
``last_build_meta_s`` are measured wall time in seconds spent inside planner calls.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvtriton.lookup import Hit, find_longest_hit
from kvtriton.planner import OffloadPlanner
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.records import PlannerMeta, Request, StepOutput
from kvtriton.sim.hooks import IntegrityHook
from kvtriton.specs import KVLayout

__all__ = ["BatchScheduler", "KVScheduler", "SeqBlocks"]


@dataclass(slots=True, eq=False)
class SeqBlocks:
    """A request and the GPU blocks the scheduler holds for it, per group (empty until admitted).

    ``tables[g]``: group g's block table, ``NULL_BLOCK`` where a page was never held or was
    dropped; ``new[g]``: its blocks not yet reported to the planner; ``cached[g]``: leading
    positions already registered in the GPU prefix cache; ``handoffs``: Mamba states saved at a
    boundary this step, as (boundary token, GPU block, group); ``pending_ext``: tokens its CPU
    load brings, counted as computed once the load lands; ``admitted_once``: its prompt and hits
    were counted (a resumption after preemption is not a new prompt).
    """

    req: Request
    tables: list[list[int]] = field(default_factory=list)
    new: list[list[int]] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)
    resumed: bool = False  # preempted: its next new blocks are reported as a resumption
    pending_ext: int = 0
    admitted_once: bool = False
    handoffs: list[tuple[int, int, int]] = field(default_factory=list)
    hint: str | None = None  # the turn's continuation hint, told to the planner at its finish


class KVScheduler:
    """Block tables, the GPU prefix cache and the planner calls of a scheduler step.

    ``null_out_of_window``: at allocation, positions a hit of ``computed`` tokens leaves unused
    get ``NULL_BLOCK`` instead of a real block, as in vLLM: sliding-window pages whose tokens are
    already out of the window, and Mamba states before the one at the hit's boundary. A CPU
    load writes only the other positions, so a real block there would be registered in the GPU
    prefix cache (and a Mamba one handed to the planner) holding bytes nothing wrote. The
    default; False gives every position a real block (tests of allocation only).
    ``count_recomputed``: count in ``recomputed_tokens`` the tokens of blocks computed whose key
    was computed before. ``integrity``: told of every block computed and handed every step's
    transfers; a ``BatchScheduler`` also asks it to check every load as it lands.
    """

    def __init__(self, layout: KVLayout, gpu: BlockPool, planner: OffloadPlanner | None, *,
                 null_out_of_window: bool = True, count_recomputed: bool = False,
                 integrity: IntegrityHook | None = None) -> None:
        self.layout = layout
        self.gpu = gpu
        self.planner = planner
        self.null_out_of_window = null_out_of_window
        self.integrity = integrity
        self.planner_s = 0.0
        self.last_build_meta_s = 0.0
        self.recomputed_tokens = 0
        # Key id -> computed before; grown on demand (key ids are dense).
        self._ever_computed = np.zeros(0, dtype=bool) if count_recomputed else None
        self._ratio = [g.block_size // layout.hash_block_size for g in layout.groups]
        self._block_sizes = [g.block_size for g in layout.groups]

    def empty_tables(self, seq: SeqBlocks) -> None:
        """Give ``seq`` one empty table per group."""
        G = self.layout.num_groups
        seq.tables = [[] for _ in range(G)]
        seq.new = [[] for _ in range(G)]
        seq.cached = [0] * G

    # ---- lookups ----------------------------------------------------------------------------

    def gpu_hit(self, req: Request) -> Hit:
        """The GPU prefix-cache hit of ``req``, capped so its last token is recomputed."""
        hbs = self.layout.hash_block_size
        keys = req.keys[:, :min(req.keys.shape[1], req.num_tokens // hbs)].tolist()
        return find_longest_hit(self.layout, self.gpu, keys, req.num_tokens - 1)

    def cpu_hit(self, req: Request, local: int) -> int:
        """Tokens past the ``local`` GPU-hit tokens the CPU tier offers (0 without a planner)."""
        if self.planner is None:
            return 0
        t0 = time.perf_counter()
        ext, _ = self.planner.get_num_new_matched_tokens(req, local)
        self.planner_s += time.perf_counter() - t0
        return ext

    # ---- allocation ---------------------------------------------------------------------------

    def _out_of_window(self, g: int, held: int, n: int, computed: int) -> int:
        """How many of the ``n`` positions after the ``held`` ones get null pages: those before
        the window at ``computed`` tokens (sliding window), before the state saved at boundary
        ``computed`` (Mamba; ``computed`` is a scheduler-block multiple)."""
        spec = self.layout.groups[g]
        if not self.null_out_of_window or spec.kind == "full":
            return 0
        if spec.kind == "sliding_window":
            skip = max(0, computed - spec.sliding_window + 1) // spec.block_size
        else:
            skip = max(0, computed // spec.block_size - 1)
        return max(0, min(skip, held + n) - held)

    def _group_blocks_needed(self, g: int, table: list[int], tokens: int, computed: int) -> int:
        n = max(0, -(-tokens // self.layout.groups[g].block_size) - len(table))
        return n - self._out_of_window(g, len(table), n, computed) if n else 0

    def blocks_needed(self, tables: Iterable[list[int]], tokens: int, computed: int = 0
                      ) -> list[int]:
        """Per group, the GPU blocks ``grow(seq, tokens, computed=computed)`` would take from
        the pool for a request holding ``tables``."""
        return [self._group_blocks_needed(g, table, tokens, computed)
                for g, (_, table) in enumerate(zip(self.layout.groups, tables, strict=True))]

    def install_hit(self, seq: SeqBlocks, hit: Hit) -> None:
        """Take the GPU hit's blocks as ``seq``'s tables (a free cached block leaves the free
        queue), all of them reported as new, the hit's positions as already cached."""
        self.gpu.touch([b for blocks in hit.blocks for b in blocks if b != NULL_BLOCK])
        seq.tables = [list(blocks) for blocks in hit.blocks]
        seq.new = [list(blocks) for blocks in hit.blocks]
        seq.cached = [len(blocks) for blocks in hit.blocks]

    def grow(self, seq: SeqBlocks, tokens: int, *, computed: int = 0) -> None:
        """Extend ``seq``'s tables to hold ``tokens`` tokens (the blocks must be free: see
        ``blocks_needed``). With ``null_out_of_window``, positions a hit of ``computed`` tokens
        (already computed: a GPU or CPU hit) leaves unused get null pages."""
        for g, spec in enumerate(self.layout.groups):
            table = seq.tables[g]
            n = -(-tokens // spec.block_size) - len(table)
            if n <= 0:
                continue
            nulls = self._out_of_window(g, len(table), n, computed)
            blocks = [NULL_BLOCK] * nulls + self.gpu.get_new_blocks(n - nulls)
            table += blocks
            seq.new[g] += blocks

    def try_grow(self, seq: SeqBlocks, tokens: int) -> bool:
        """``grow`` if the free blocks allow it; whether they did."""
        if all(-(-tokens // size) <= len(table)
               for size, table in zip(self._block_sizes, seq.tables, strict=True)):
            return True  # every table already holds ``tokens`` (most decode steps)
        if sum(self.blocks_needed(seq.tables, tokens)) > self.gpu.num_free_blocks:
            return False
        self.grow(seq, tokens)
        return True

    def after_alloc(self, seq: SeqBlocks, ext: int) -> None:
        """Tell the planner ``seq``'s tables after allocation and the ``ext`` CPU-hit tokens it
        accepted."""
        if self.planner is None:
            return
        t0 = time.perf_counter()
        self.planner.update_state_after_alloc(seq.req, tuple(seq.tables), ext)
        self.planner_s += time.perf_counter() - t0

    # ---- the GPU prefix cache ---------------------------------------------------------------

    def cache_full_blocks(self, seq: SeqBlocks, upto: int, *, computed_here: bool = True
                          ) -> None:
        """Register the blocks full at ``upto`` tokens in the GPU prefix cache (Mamba states are
        also queued as boundary hand-offs). ``computed_here``: False for blocks that came from a
        CPU load (not computed, and their bytes already arrived).

        The blocks are registered in one ``cache_blocks`` call, in (group, position) order: the
        pool's batch listeners then run once per request and step instead of once per block (a
        prefill chunk fills a hundred blocks), and see the same pairs in the same order."""
        req, gpu = seq.req, self.gpu
        primary = gpu.block_hash
        blocks: list[int] = []
        keys: list[list[int]] = []
        groups: list[int] = []
        n_keys = req.keys.shape[1]
        for g, spec in enumerate(self.layout.groups):
            table, r, start = seq.tables[g], self._ratio[g], seq.cached[g]
            full = min(upto // spec.block_size, len(table), n_keys // r)
            if full <= start:
                continue  # nothing newly full (most decode steps)
            row = req.keys[g, start * r:full * r].tolist()  # one conversion, not one per block
            for pos in range(start, full):
                b = table[pos]
                if b != NULL_BLOCK and primary(b) is None:
                    i = (pos - start) * r
                    key, aliases = row[i + r - 1], row[i:i + r - 1]
                    if computed_here:
                        self._computed(g, b, key, spec.block_size)
                    blocks.append(b)
                    keys.append([key, *aliases])
                    groups.append(g)
                    if spec.kind == "mamba":
                        seq.handoffs.append(((pos + 1) * spec.block_size, b, g))
            seq.cached[g] = full
        if blocks:
            gpu.cache_blocks(blocks, keys, groups)

    def _computed(self, g: int, block: int, key: int, tokens: int) -> None:
        seen = self._ever_computed
        if seen is not None:
            if key >= len(seen):
                grown = np.zeros(max(key + 1, 2 * len(seen)), dtype=bool)
                grown[:len(seen)] = seen
                self._ever_computed = seen = grown
            if seen[key]:
                self.recomputed_tokens += tokens
            seen[key] = True
        if self.integrity is not None:
            self.integrity.fill(g, block, key)

    def drop_unneeded(self, seq: SeqBlocks) -> None:
        """Free what a group no longer needs at the request's computed tokens: sliding-window
        pages out of the window, Mamba states before the last full one. Only positions already
        registered are dropped, so the prefix cache keeps every block computed; the pages are
        freed last position first, as vLLM's ``remove_skipped_blocks`` does."""
        req, gpu = seq.req, self.gpu
        computed = req.num_computed_tokens
        for g, spec in enumerate(self.layout.groups):
            table = seq.tables[g]
            if spec.kind == "sliding_window":
                keep_from = max(0, computed - spec.sliding_window + 1) // spec.block_size
            elif spec.kind == "mamba":
                full = min(computed // spec.block_size, len(table),
                           req.keys.shape[1] // self._ratio[g])
                keep_from = max(0, full - 1)
            else:
                continue
            stop = min(keep_from, seq.cached[g], len(table))
            drop = [table[p] for p in range(stop) if table[p] != NULL_BLOCK]
            if drop:
                for p in range(stop):
                    table[p] = NULL_BLOCK
                gpu.free_blocks(drop[::-1])

    def cache_computed(self, seq: SeqBlocks, *, computed_here: bool = True) -> None:
        """``cache_full_blocks`` at the request's computed tokens, then ``drop_unneeded``."""
        self.cache_full_blocks(seq, seq.req.num_computed_tokens, computed_here=computed_here)
        self.drop_unneeded(seq)

    # ---- leaving the GPU --------------------------------------------------------------------

    def free_seq_blocks(self, seq: SeqBlocks) -> None:
        """Free every block ``seq`` holds, each table tail first (a chain's head, shared by
        most prefixes, is the last to be evicted), and empty its tables."""
        for table in seq.tables:
            live = [b for b in reversed(table) if b != NULL_BLOCK]
            if live:
                self.gpu.free_blocks(live)
        self.empty_tables(seq)

    def preempt(self, seq: SeqBlocks) -> None:
        """Preempt by recompute: its blocks are freed and it starts over; its next table is
        reported as a resumption."""
        self.free_seq_blocks(seq)
        seq.req.num_computed_tokens = 0
        seq.req.num_output_placeholders = 0
        seq.handoffs.clear()
        seq.resumed = True
        if self.planner is not None:
            # It may be scheduled again before the step that reports the preemption.
            self.planner.preempted(seq.req.request_id)

    def finish(self, seq: SeqBlocks) -> None:
        """``seq`` finished or was aborted: the planner is told first, then its blocks are
        freed."""
        if self.planner is not None:
            t0 = time.perf_counter()
            self.planner.request_finished(seq.req, hint=seq.hint)
            self.planner_s += time.perf_counter() - t0
        self.free_seq_blocks(seq)

    # ---- one step ---------------------------------------------------------------------------

    def step_output(self, seqs: Iterable[SeqBlocks], scheduled: dict[str, int], *,
                    preempted: set[str], finished: set[str] | None = None,
                    order: list[str] | None = None) -> StepOutput:
        """The step as the planner sees it: ``scheduled`` tokens per request id, the new blocks,
        resumptions and Mamba hand-offs of ``seqs`` (taken: the next step reports only what
        follows), ``preempted`` and ``finished`` request ids, and the batch ``order`` (default:
        that of ``scheduled``)."""
        new_ids, resumed, handoffs = {}, set(), {}
        for seq in seqs:
            rid = seq.req.request_id
            if any(seq.new):
                new_ids[rid] = tuple(seq.new)
                seq.new = [[] for _ in seq.new]
                if seq.resumed:
                    resumed.add(rid)
                    seq.resumed = False
            if seq.handoffs:
                handoffs[rid] = seq.handoffs
                seq.handoffs = []
        return StepOutput(num_scheduled_tokens=scheduled, new_block_ids=new_ids,
                          preempted_req_ids=preempted, resumed_req_ids=resumed,
                          finished_req_ids=set() if finished is None else finished,
                          boundary_handoffs=handoffs,
                          order=list(scheduled) if order is None else order)

    def build_meta(self, step: StepOutput) -> PlannerMeta:
        """The planner's transfers for ``step`` (its duration in ``last_build_meta_s``), handed
        to the integrity hook to execute."""
        t0 = time.perf_counter()
        meta = self.planner.build_meta(step)
        self.last_build_meta_s = time.perf_counter() - t0
        self.planner_s += self.last_build_meta_s
        if self.integrity is not None:
            self.integrity.execute(meta)
        return meta

    def apply_reports(self, *, finished_loads: Iterable[str] = (),
                      completed_stores: Mapping[int, int] | Iterable[int] = (),
                      failed_loads: Iterable[str] = (), failed_stores: Iterable[int] = ()
                      ) -> None:
        """Worker reports, to the planner (``OffloadPlanner.update_connector_output``)."""
        t0 = time.perf_counter()
        self.planner.update_connector_output(
            finished_loads=finished_loads, completed_stores=completed_stores,
            failed_stores=failed_stores, failed_loads=failed_loads)
        self.planner_s += time.perf_counter() - t0


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
                 reserve_full_isl: bool = True) -> None:
        super().__init__(layout, gpu, planner, null_out_of_window=null_out_of_window,
                         count_recomputed=count_recomputed, integrity=integrity)
        self.token_budget = token_budget
        self.max_running = max_running
        self.reserve_full_isl = reserve_full_isl
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
        """Schedule a waiting request; the tokens scheduled (0 while its load runs), or None if
        it does not fit. ``scheduled``: the step's tokens so far."""
        req = seq.req
        hit = self.gpu_hit(req)
        local = hit.num_tokens
        # The CPU lookup comes first, whether or not anything then fits: vLLM calls the
        # connector's get_num_new_matched_tokens before allocate_slots, and the lookup pins
        # and touches the CPU blocks it matches (their eviction order changes) even when the
        # request then waits.
        ext = self.cpu_hit(req, local)
        computed = local + ext
        if ext:
            hit = self._past_window(hit, computed)
        target = computed if ext else local + min(req.num_tokens - local, budget)
        hit_blocks = [b for blocks in hit.blocks for b in blocks if b != NULL_BLOCK]
        # Touching a free cached hit block takes it out of the free queue: it counts as taken
        # (vLLM's num_evictable_blocks).
        touched = self.gpu.count_free(hit_blocks)
        free = self.gpu.num_free_blocks
        if self.reserve_full_isl and \
                sum(self.blocks_to_hold(hit.blocks, req.num_tokens, computed)) + touched > free:
            return None
        if ext:
            # An async load holds its blocks for the whole transfer and cannot be preempted:
            # vLLM admits it only into the free blocks in-flight prefills do not need
            # (reserved_blocks = _inflight_prefill_reserved_blocks()).
            free -= self._inflight_reserved(scheduled)
        if sum(self.blocks_needed(hit.blocks, target, computed=computed)) + touched > free:
            return None
        self.install_hit(seq, hit)
        self.grow(seq, target, computed=computed)
        self.after_alloc(seq, ext)
        req.num_computed_tokens = local
        if not seq.admitted_once:
            seq.admitted_once = True
            self.prompt_tokens += req.num_prompt_tokens
            self.gpu_hit_tokens += local
            self.cpu_hit_tokens += ext
            self.first_admit_tokens[req.request_id] = (req.num_prompt_tokens, local, ext)
            if self.on_first_admit is not None:
                self.on_first_admit(seq)
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
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            n = self._admit(seq, budget, scheduled)
            if n is None:
                return
            self.waiting.popleft()
            if n:
                scheduled[seq.req.request_id] = n
                budget -= n

    def schedule_step(self) -> tuple[dict[str, int], PlannerMeta | None]:
        """Tokens scheduled per request id this step, and the planner's transfers for it (None
        without a planner). ``build_meta`` runs before the step's tokens count as computed."""
        scheduled, preempted = self._schedule()
        self.last_preempted = preempted
        finished, self._finished_last = self._finished_last, set()
        step = self.step_output(self.seqs.values(), scheduled, preempted=preempted,
                                finished=finished)
        meta = self.build_meta(step) if self.planner is not None else None
        return scheduled, meta

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
        if not finished_loads and not completed_stores:
            return
        if self.integrity is not None:
            for rid in finished_loads:
                seq = self.loading[rid]
                start = seq.req.num_computed_tokens
                self.integrity.check_load(rid, seq.req.keys, seq.tables, start,
                                          start + seq.pending_ext, step)
        self.apply_reports(finished_loads=finished_loads, completed_stores=completed_stores)
        for rid in finished_loads:
            seq = self.loading[rid]
            seq.req.num_computed_tokens += seq.pending_ext
            seq.pending_ext = 0
            self._landed_unregistered.add(rid)
