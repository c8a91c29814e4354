"""The store lifecycle: per-request store state, store batches, worker reports, the finish flush.

1. ``admit``: a request allocated in eager mode gets a *row* in the selector (its block tables,
   cursors and key ownership); ``track_step`` keeps the tables in step with the scheduler's new
   blocks, preemptions and resumptions.
2. Each step, ``add_handoffs`` (Mamba states saved at a boundary) and ``select`` (the selector's
   scan) add GPU -> CPU pairs to the step's ``StoreJob``; ``allocate`` takes their CPU blocks and
   pins their GPU sources; ``issue`` adds the queued finish flush and gives the batch its event.
3. ``apply_reports``: a store event counts once ``world_size`` workers reported it; its blocks are
   then registered in the CPU pool under every key of their GPU block and freed in the configured
   order. A failed store releases its pins and caches nothing.
4. ``finish``: a finished request's confirmed blocks the scan has not stored are queued as the
   finish flush; its state is dropped once none of its stores is in flight or queued. A CPU
   eviction queue that orders blocks by request lifetimes (``request_observer``) is told of the
   request's admission and of its finish once its flush is queued (``note_admitted``,
   ``note_finished``), and of each store's keys before it takes their blocks (``allocate``). With
   ``hold_finished`` a request finishing with stores in flight or queued keeps its GPU table
   referenced until then, and releases it tail first (see ``PlannerConfig``).
5. ``reset``: issued batches become abandoned (their pins are released at their reports), the
   queued flush is released, every store state is dropped.

Steps 2 and 3, a step's batch and its reports, are ``Stores``'s base ``StoreBatches``
(``kvtriton.planner.store_batches``); the rows, the finish flush and reset are here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from kvtriton.eviction.base import request_observer
from kvtriton.planner.admission import SecondSight
from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.selection import StoreSelector
from kvtriton.planner.stats import PlannerStats
from kvtriton.planner.store_batches import StoreBatches, StoreJob
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.pool_interface import GpuPool
from kvtriton.records import Request, StepOutput, Transfer
from kvtriton.specs import KVLayout

__all__ = ["Stores"]


@dataclass(slots=True)
class _StoreState:
    """One request's store state: its selector row (its table lengths are ``Stores``'s, by
    row), the store events carrying its blocks, whether it finished or holds a row now, and the
    GPU blocks it holds past its finish (``hold_finished``), in the order they are released."""

    row: int
    events: set[int] = field(default_factory=set)
    finished: bool = False
    admitted: bool = False
    held: list[int] = field(default_factory=list)


class Stores(StoreBatches):
    """Store states, rows, store batches in flight, worker report counts and the finish flush."""

    def __init__(self, layout: KVLayout, config: PlannerConfig, gpu_pool: GpuPool,
                 cpu_pool: BlockPool, selector: StoreSelector, stats: PlannerStats) -> None:
        self._layout = layout
        self._config = config
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._selector = selector
        self._stats = stats
        hbs = layout.hash_block_size
        self._ratio = [g.block_size // hbs for g in layout.groups]
        self._positional = [g.kind != "mamba" for g in layout.groups]
        self._full = np.array([g.kind == "full" for g in layout.groups])
        self._align = hbs if config.fine_grained else layout.scheduler_block_size
        self._states: dict[str, _StoreState] = {}
        self._row_req: dict[int, str] = {}
        # The rows held now (admitted, not finished) by request id: a step's rows are read from
        # it in one pass over the step's ids.
        self._rows_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._next_row = 0
        # Per row: table length per group, keys per group; arrays, so that a step reads all its
        # rows' at once (grown by doubling, like the selector's).
        self._table_len = np.zeros((layout.num_groups, 64), dtype=np.int64)
        self._row_keys = np.zeros(64, dtype=np.int64)
        self._jobs: dict[int, StoreJob] = {}
        self._abandoned: dict[int, StoreJob] = {}
        self._flush = StoreJob()
        self._reports: dict[int, int] = {}
        self._next_event = 0
        self._admission = SecondSight(stats) if config.admission == "second" else None
        # A CPU eviction that learns from demand hears of every admitted request's keys.
        eviction = cpu_pool.eviction
        self._demand = eviction.on_request if eviction.observes_requests else None
        # A CPU eviction that orders blocks by request lifetimes (vLLM 0.33's) hears of them.
        self._lifetimes = request_observer(eviction)

    # ---- rows -------------------------------------------------------------------------------

    def _primary_keys(self, req: Request) -> list[np.ndarray]:
        return [req.keys[g, r - 1::r] if self._positional[g] else req.keys[g, :0]
                for g, r in enumerate(self._ratio)]

    def _confirmed_positions(self, req: Request, g: int) -> int:
        """Positions of group g whose tokens are confirmed computed and hashed."""
        aligned = req.confirmed_tokens // self._align * self._align
        return min(aligned // self._layout.groups[g].block_size,
                   req.keys.shape[1] // self._ratio[g])

    def _admit_row(self, req: Request, st: _StoreState) -> None:
        self._selector.admit(st.row, self._primary_keys(req))
        row = st.row
        if row >= len(self._row_keys):
            n = 2 * row + 1
            self._row_keys = np.concatenate([self._row_keys, np.zeros(n - len(self._row_keys),
                                                                      dtype=np.int64)])
            self._table_len = np.concatenate(
                [self._table_len, np.zeros((self._layout.num_groups, n - self._table_len.shape[1]),
                                           dtype=np.int64)], axis=1)
        self._table_len[:, row] = 0
        self._row_keys[row] = req.keys.shape[1]
        st.admitted = True
        self._rows_of[self._row_req[row]] = row

    def _release_row(self, st: _StoreState) -> None:
        if st.admitted:
            self._selector.release(st.row)
            st.admitted = False
            del self._rows_of[self._row_req[st.row]]

    def _drop_state(self, rid: str) -> None:
        st = self._states.pop(rid)
        self._release_row(st)
        if st.held:
            self._gpu_pool.free_blocks(st.held)
        del self._row_req[st.row]
        self._free_rows.append(st.row)

    def note_admitted(self, req: Request) -> None:
        """Tell a CPU eviction that follows request lifetimes of ``req``'s admission: its
        primary keys and the token each one's block ends at (it ignores a request it knows)."""
        if self._lifetimes is None:
            return
        pkeys = self._primary_keys(req)
        positions = [(np.arange(len(k), dtype=np.int64) + 1) * spec.block_size
                     for k, spec in zip(pkeys, self._layout.groups, strict=True)]
        self._lifetimes.on_request_admitted(req.request_id, np.concatenate(pkeys),
                                            np.concatenate(positions))

    def note_finished(self, req: Request) -> None:
        """Tell a CPU eviction that follows request lifetimes of ``req``'s finish."""
        if self._lifetimes is not None:
            self._lifetimes.on_request_finished(req.request_id, req.num_computed_tokens)

    def note_forgotten(self, rids: list[str]) -> None:
        """A reset forgot ``rids``: a CPU eviction that follows request lifetimes drops them
        without a commit (a finish having used no key), as vLLM's reset forgets its ranks."""
        if self._lifetimes is not None:
            for rid in rids:
                self._lifetimes.on_request_finished(rid, 0)

    def admit(self, req: Request) -> None:
        """Give ``req`` a row (once: a request keeps its row until it finishes)."""
        rid = req.request_id
        if rid in self._states:
            return
        row = self._free_rows.pop() if self._free_rows else self._next_row
        self._next_row = max(self._next_row, row + 1)
        st = _StoreState(row)
        self._states[rid] = st
        self._row_req[row] = rid
        self._admit_row(req, st)
        self.note_admitted(req)
        if self._admission is not None or self._demand is not None:
            keys = np.unique(np.concatenate(self._primary_keys(req)))
            if self._admission is not None:
                self._admission.sight(keys)
            if self._demand is not None:
                self._demand(keys)

    def forget_keys(self, keys: np.ndarray) -> None:
        """Drop what the admission rule remembers of recycled keys."""
        if self._admission is not None:
            self._admission.forget(keys)

    def track_step(self, step: StepOutput, requests: Mapping[str, Request]) -> None:
        """Preempted requests lose their rows; new GPU blocks join the tables (a resumed or
        preempted request is admitted again, with a table that starts over)."""
        t0 = time.perf_counter()
        for rid in step.preempted_req_ids:
            if (st := self._states.get(rid)) is not None and not st.finished:
                # Its GPU blocks are gone: table and cursors start over when it resumes.
                self._release_row(st)
        # One append per group for the whole step: the rows and new ids of every request.
        new, resumed = step.new_block_ids, step.resumed_req_ids
        if not new:
            self._stats.tables_s += time.perf_counter() - t0
            return
        rows = None if resumed else self._held_rows(new)
        if rows is not None:
            # Every request holds its row (a decode step): nothing to admit or release.
            self._append(rows, list(new.values()))
            self._stats.tables_s += time.perf_counter() - t0
            return
        rows, news = [], []
        states = self._states
        for rid, new_ids in new.items():
            st = states.get(rid)
            if st is None or st.finished:
                continue
            if st.admitted and rid in resumed:
                self._release_row(st)
            if not st.admitted:
                self._admit_row(requests[rid], st)
            rows.append(st.row)
            news.append(new_ids)
        if rows:
            self._append(rows, news)
        self._stats.tables_s += time.perf_counter() - t0

    def _held_rows(self, rids) -> list[int] | None:
        """The rows of ``rids`` in order when every one holds a row now, else None (one C-level
        pass over the ids)."""
        rows = list(map(self._rows_of.get, rids))
        return None if None in rows else rows

    def _append(self, rows: list[int], news: list[tuple[list[int], ...]]) -> None:
        """``news[i][g]`` joins row ``rows[i]``'s table of group g (rows distinct)."""
        for g, positional in enumerate(self._positional):
            if positional:
                ids = [new[g] for new in news]
                counts = self._selector.append_blocks_many(g, rows, ids)
                # Rows are distinct (one per request): a plain add is exact.
                self._table_len[g, rows] += counts

    # ---- finish and reset ---------------------------------------------------------------------

    def finish(self, req: Request, tables: list[list[int]] | None = None) -> None:
        """``req`` finished: queue its flush, release its row, drop its state unless a store of
        it is in flight or queued. ``tables``: the scheduler's table per group at the end; the
        blocks past those the steps carried join the row's table first."""
        rid = req.request_id
        st = self._states.get(rid)
        if st is None or st.finished:
            return
        if tables is not None and not st.admitted and any(
                t for g, t in enumerate(tables) if self._positional[g]):
            # Preempted (its row released), allocated again, and finished before a step
            # carried its new table: the row starts over from the scheduler's table.
            self._admit_row(req, st)
        if st.admitted:
            if tables is not None:
                for g, table in enumerate(tables):
                    have = int(self._table_len[g, st.row])
                    if self._positional[g] and len(table) > have:
                        self._selector.append_blocks(st.row, g, table[have:])
                        self._table_len[g, st.row] = len(table)
            self._queue_flush(rid, req, st)
        # After the flush took its CPU blocks (and evicted for them), as vLLM's scheduler
        # signals a finish after the finish's last store.
        self.note_finished(req)
        if self._config.hold_finished and (st.events or rid in self._flush.req_ids):
            self._hold(st, tables)
        st.finished = True
        self._release_row(st)
        if not st.events and rid not in self._flush.req_ids:
            self._drop_state(rid)

    def _hold(self, st: _StoreState, tables: list[list[int]] | None) -> None:
        """Reference the finishing request's GPU blocks until its last store completes
        (``_drop_state`` releases them). The scheduler frees a table tail first at the finish,
        but a block a store pins joins the free queue only when the store completes, after the
        table's other blocks and in store order: the chain's head would then be evicted first.
        Held, every hashed block joins the queue at once, in the order the scheduler frees
        them: per group, last position first (an unhashed block is reused first whenever it is
        freed, so it is not held). ``tables``: the scheduler's tables now; without them, the
        full-attention tables the steps carried (a sliding window's may name pages the
        scheduler already dropped)."""
        if tables is None:
            if not st.admitted:
                return
            tables = [self._selector.table(st.row, g) if spec.kind == "full" else []
                      for g, spec in enumerate(self._layout.groups)]
        block_hash = self._gpu_pool.block_hash
        held = [b for table in tables for b in reversed(table)
                if b != NULL_BLOCK and block_hash(b) is not None]
        if held:
            # The request references every one of them until the scheduler frees its tables.
            self._gpu_pool.pin_held(held)
            st.held = held

    def _queue_flush(self, rid: str, req: Request, st: _StoreState) -> None:
        """Queue confirmed blocks the scan has not stored (past the cursor, and wanted ones
        below it) for the next store batch; also the prompt-tail block of a fine-grained hit."""
        job = StoreJob()
        gpu_pool, cpu_pool, sel = self._gpu_pool, self._cpu_pool, self._selector
        admission = self._admission
        free = cpu_pool.num_free_blocks
        pkeys = self._primary_keys(req)
        queued = set(self._flush.keys)
        for g, spec in enumerate(self._layout.groups):
            if not self._positional[g]:
                continue
            table = sel.table(st.row, g)
            cur = sel.cursor(st.row, g)
            ready = min(self._confirmed_positions(req, g), len(table))
            positions = (sel.wanted_below_cursor(st.row, g) if self._config.restore else []) \
                + list(range(cur, ready))
            for pos in positions:
                key = int(pkeys[g][pos])
                src = table[pos]
                if src == NULL_BLOCK and spec.kind == "sliding_window":
                    src = gpu_pool.get_cached_block(key) or NULL_BLOCK
                if (src == NULL_BLOCK or gpu_pool.block_hash(src) != key
                        or sel.in_flight(src, key) or key in cpu_pool or key in queued
                        or (admission is not None and not admission.admits(key))):
                    continue
                if len(job.gpu) >= free:
                    break
                job.gpu.append(src)
                job.groups.append(g)
                job.keys.append(key)
                queued.add(key)
        tail = self._prompt_tail_block(req, st)
        if tail is not None and tail[0] not in job.gpu and len(job.gpu) < free:
            job.gpu.append(tail[0])
            job.groups.append(0)
            job.keys.append(tail[1])
        if job.gpu:
            job.req_ids.append(rid)
            self.allocate(job)
            self._flush.extend(job)
            self._stats.flush_stored += len(job.gpu)

    def _prompt_tail_block(self, req: Request, st: _StoreState) -> tuple[int, int] | None:
        """The partial full-attention block holding the prompt's last hash boundary, if the GPU
        block is registered under that boundary's key (fine-grained hits only)."""
        if not self._config.fine_grained:
            return None
        hbs, B = self._layout.hash_block_size, self._layout.groups[0].block_size
        boundary = req.num_prompt_tokens // hbs * hbs
        if boundary == 0 or boundary % B == 0 or boundary > req.num_computed_tokens:
            return None
        table = self._selector.table(st.row, 0)
        idx = boundary // B
        if idx >= len(table) or boundary // hbs > req.keys.shape[1]:
            return None
        gb = table[idx]
        key = int(req.keys[0, boundary // hbs - 1])
        if (gb == NULL_BLOCK or key not in self._gpu_pool.block_keys(gb)
                or key in self._cpu_pool or self._selector.in_flight(gb, key)):
            return None
        return gb, key

    def reset(self) -> None:
        """Abandon the batches in flight, release the queued flush, drop every store state."""
        for ev, job in self._jobs.items():
            self._selector.set_in_flight(job.gpu, job.keys, False)
            self._abandoned[ev] = job
            self._stats.abandoned_stores += 1
        self._jobs.clear()
        flush, self._flush = self._flush, StoreJob()
        if flush.gpu:
            self._selector.set_in_flight(flush.gpu, flush.keys, False)
            self._cpu_pool.free_blocks(flush.cpu)
            self._gpu_pool.free_blocks(flush.gpu)
        for rid in list(self._states):
            self._drop_state(rid)
        self._reports = {ev: n for ev, n in self._reports.items() if ev in self._abandoned}

    # ---- introspection ----------------------------------------------------------------------

    def has_state(self, rid: str) -> bool:
        return rid in self._states

    def has_abandoned(self) -> bool:
        return bool(self._abandoned)

    def has_pending(self) -> bool:
        return bool(self._flush.gpu or self._jobs or self._abandoned)

    def pending_blocks(self) -> int:
        return len(self._flush.gpu) + sum(len(j.gpu) for j in self._jobs.values()) + sum(
            len(j.gpu) for j in self._abandoned.values())

    def cursor(self, rid: str, group: int) -> int:
        st = self._states.get(rid)
        if st is None or not st.admitted:
            raise ValueError(f"request {rid!r} has no store cursor")
        return self._selector.cursor(st.row, group)

    @property
    def events_issued(self) -> int:
        """Store events issued so far: their ids are ``0 .. events_issued - 1``."""
        return self._next_event

    def events_in_flight(self) -> set[int]:
        """Store events issued and not yet completed, abandoned ones included."""
        return set(self._jobs) | set(self._abandoned)

    def referenced_keys(self) -> list[int]:
        """The keys of the store batches in flight or abandoned and of the queued flush."""
        return [k for job in chain(self._jobs.values(), self._abandoned.values(), (self._flush,))
                for k in job.keys]

    def held_blocks(self) -> list[int]:
        """The GPU blocks finished requests hold until their stores complete
        (``hold_finished``), one entry per reference."""
        return [b for st in self._states.values() for b in st.held]

    def queued_flush(self) -> Transfer:
        """The finish flush queued for the next batch (event -1)."""
        f = self._flush
        return Transfer(-1, list(f.gpu), list(f.cpu), list(f.groups))

    def check_invariants(self, requests: Mapping[str, Request], *, idle: bool = False) -> None:
        """Raise ``AssertionError`` if the store books disagree with each other or with the
        selector; with ``idle``, also if they hold anything."""
        rows = {st.row: rid for rid, st in self._states.items()}
        assert rows == self._row_req, "row table out of step with the store states"
        assert self._rows_of == {rid: st.row for rid, st in self._states.items() if st.admitted}, (
            "the held rows by request id are out of step with the store states")
        assert len(set(self._free_rows)) == len(self._free_rows), "a row freed twice"
        assert not set(self._free_rows) & set(rows), "a row both free and held"
        assert all(0 <= r < self._next_row for r in [*rows, *self._free_rows])
        assert not set(self._jobs) & set(self._abandoned), "an event both live and abandoned"
        for ev in [*self._jobs, *self._abandoned]:
            assert 0 <= ev < self._next_event, f"store event {ev} was never issued"
        world = self._config.world_size
        for ev, n in self._reports.items():
            assert ev in self._jobs or ev in self._abandoned, f"reports kept for done event {ev}"
            assert 0 < n < world, f"store {ev}: {n} reports kept (world_size {world})"
        for ev, job in [*self._jobs.items(), *self._abandoned.items(), (None, self._flush)]:
            assert len(job.gpu) == len(job.cpu) == len(job.groups) == len(job.keys), (
                f"store {ev}: pairs out of step")
        for rid, st in self._states.items():
            assert st.events <= set(self._jobs), f"{rid}: events {st.events} not in flight"
            assert not st.finished or st.events or rid in self._flush.req_ids, (
                f"{rid}: finished with nothing in flight, never dropped")
            assert not (st.finished and st.admitted), f"{rid}: finished but holds a row"
            assert not st.held or st.finished, f"{rid}: holds GPU blocks before its finish"
            assert all(self._gpu_pool.ref_cnt[b] > 0 for b in st.held), (
                f"{rid}: a held GPU block is free")
            if st.admitted:
                assert rid in requests, f"{rid}: holds a row, the request is unknown"
                assert self._row_keys[st.row] == requests[rid].keys.shape[1]
                for g, n in enumerate(self._table_len[:, st.row].tolist()):
                    assert len(self._selector.table(st.row, g)) == n, (
                        f"{rid}: group {g} table length out of step")
        # In-flight flags are exactly the live batches' and the queued flush's blocks and keys.
        live_gpu, live_keys = set(self._flush.gpu), list(self._flush.keys)
        for job in self._jobs.values():
            live_gpu.update(job.gpu)
            live_keys += job.keys
        assert len(set(live_keys)) == len(live_keys), f"a key is stored twice at once: {live_keys}"
        flagged_gpu, flagged_keys = self._selector.in_flight_flags()
        assert flagged_gpu == live_gpu, f"in-flight GPU flags {flagged_gpu} != {live_gpu}"
        assert flagged_keys == set(live_keys), (
            f"in-flight key flags {flagged_keys} != {set(live_keys)}")
        # The running_present gauge (behind restore_share), from the admitted requests' keys.
        owned: set[int] = set()
        for rid, st in self._states.items():
            if st.admitted:
                for ks in self._primary_keys(requests[rid]):
                    owned.update(ks.tolist())
        present = sum(k in self._cpu_pool for k in owned)
        assert self._selector.running_present == present, (
            f"running_present {self._selector.running_present}, recomputed {present}")
        if idle:
            for name in ("_states", "_row_req", "_jobs", "_abandoned", "_reports"):
                assert not getattr(self, name), f"stores: {name} not empty: {getattr(self, name)}"
            assert not self._flush.gpu, "stores: a finish flush is still queued"
