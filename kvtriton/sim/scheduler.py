"""The KV side of a vLLM-like scheduler step, around ``OffloadPlanner`` as vLLM drives a connector.

``KVScheduler``: the GPU pool, the planner and per-request block tables (``SeqBlocks``), and the
operations a caller sequences itself: a GPU prefix-cache lookup and the planner's CPU lookup,
allocation (null pages where a hit leaves a position unused, as in vLLM), registering newly full
blocks in the GPU prefix cache (and dropping what a group no longer needs: sliding-window pages
left behind, Mamba states before the last one, whose saved boundaries are handed to the
planner), preemption, finish (blocks freed tail first), the ``StepOutput`` and delivering worker
reports to the planner. The tests' planner driver (``tests/helpers/planner_driver.py``) calls it
call by call; ``BatchScheduler`` (``kvtriton.sim.batch_scheduler``) sequences the same operations
with vLLM's step policy for the serving-loop simulator (``kvtriton.sim.loop``) and the memory
soak (``bench/conformance/planner_soak.py``), so all three share one implementation of the KV side.

Lengths are in tokens unless named blocks (of the group's own block size); ``planner_s`` and
``last_build_meta_s`` are measured wall time in seconds spent inside planner calls.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvtriton.lookup import Hit, find_longest_hit
from kvtriton.planner import OffloadPlanner
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.records import PlannerMeta, Request, StepOutput
from kvtriton.sim.hooks import IntegrityHook
from kvtriton.specs import KVLayout

__all__ = ["KVScheduler", "SeqBlocks"]


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
        self.second_tier = None  # kvtriton.second_tier.fetches.StoreFetches, when on
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

    def cpu_hit(self, req: Request, local: int) -> int | None:
        """Tokens past the ``local`` GPU-hit tokens the CPU tier offers (0 without a planner);
        None while the request waits for a fetch from the second tier (``second_tier``:
        ``kvtriton.second_tier.fetches.StoreFetches``, as the connector runs it)."""
        if self.planner is None:
            return 0
        if self.second_tier is not None and self.second_tier.still_waiting(req.request_id):
            return None  # as the connector: no lookup again until the store answers
        t0 = time.perf_counter()
        ext, _ = self.planner.get_num_new_matched_tokens(req, local)
        wait = self.second_tier is not None and self.second_tier.extend(req, local, ext)
        self.planner_s += time.perf_counter() - t0
        return None if wait else ext

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
        """``seq`` finished or was aborted: the planner is told first, with its tables (as
        vLLM hands them to a connector), then its blocks are freed."""
        if self.planner is not None:
            t0 = time.perf_counter()
            if self.second_tier is not None:
                self.second_tier.forget(seq.req.request_id)
            self.planner.request_finished(seq.req, tuple(seq.tables), hint=seq.hint)
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
