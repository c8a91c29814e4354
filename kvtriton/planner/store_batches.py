"""A step's store batch, from selection to completion: ``StoreJob`` and ``StoreBatches``.

Each step, ``add_handoffs`` (Mamba states saved at a boundary) and ``select`` (the selector's scan)
add GPU -> CPU pairs to the step's ``StoreJob``; ``allocate`` takes their CPU blocks and pins their
GPU sources; ``issue`` adds the queued finish flush and gives the batch its event.
``apply_reports`` counts the workers' reports: a store event counts once ``world_size`` workers
reported it; its blocks are then registered in the CPU pool under every key of their GPU block
and freed in the configured order, and a failed store releases its pins and caches nothing.

``StoreBatches`` is a base of ``Stores`` (``kvtriton.planner.stores``) with no state of its own:
it works on the store books ``Stores.__init__`` sets up (the batches in flight, the abandoned
ones, the report counts, the queued flush, the per-request states) and reads a row's table
lengths and keys there. The per-request side (rows, the finish flush, reset) stays in
``Stores``: a batch is built and completed the same way whichever request it serves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np

from kvtriton.pool import NULL_BLOCK
from kvtriton.records import Request, StepOutput, Transfer

__all__ = ["StoreBatches", "StoreJob"]

# The planner's logger: its records carry one name whichever lifecycle emits them.
logger = logging.getLogger("kvtriton.planner.planner")

# From this many requests in a step's order, its rows and tokens are read in C-level passes.
_ROW_PASSES_FROM = 32
_CONFIRMED = attrgetter("confirmed_tokens")


@dataclass(slots=True)
class StoreJob:
    """Pairs of one store batch (or of the queued finish flush): GPU block -> CPU block of a
    group, with the primary key the CPU block is stored for and the requests it serves."""

    gpu: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)

    def extend(self, other: StoreJob) -> None:
        self.gpu += other.gpu
        self.cpu += other.cpu
        self.groups += other.groups
        self.keys += other.keys
        self.req_ids += [r for r in other.req_ids if r not in self.req_ids]


class StoreBatches:
    """The step's store batch and its reports, on the store books of ``Stores`` (see the module
    docstring)."""

    # ---- one step's batch -------------------------------------------------------------------

    def add_handoffs(self, step: StepOutput, job: StoreJob) -> None:
        """Mamba states saved at a boundary this step, stored as state blocks."""
        gpu_pool, cpu_pool, stats = self._gpu_pool, self._cpu_pool, self._stats
        free = cpu_pool.num_free_blocks
        for rid, entries in step.boundary_handoffs.items():
            st = self._states.get(rid)
            gone = (st is None or st.finished or rid in step.preempted_req_ids
                    or rid in step.finished_req_ids)
            for _boundary, gb, g in entries:
                key = None if gone or gb == NULL_BLOCK else gpu_pool.block_hash(gb)
                if key is None:
                    stats.handoff_dropped += 1
                    continue
                if self._selector.in_flight(gb, key) or key in cpu_pool or key in job.keys:
                    continue
                if len(job.gpu) >= free:
                    stats.handoff_dropped += 1
                    continue
                job.gpu.append(gb)
                job.groups.append(g)
                job.keys.append(key)
                if rid not in job.req_ids:
                    job.req_ids.append(rid)
                stats.handoff_stored += 1
        self.allocate(job)

    def select(self, step: StepOutput, job: StoreJob, requests: Mapping[str, Request]) -> None:
        """The selector's scan over this step's requests (in scan order), added to ``job``."""
        config = self._config
        order = step.order if step.order is not None else list(step.num_scheduled_tokens)
        if config.scan_idle:
            seen = set(order)
            order = order + [r for r in self._states if r not in seen]
        scheduled, idle = step.num_scheduled_tokens, config.scan_idle
        rows = self._held_rows(order) if len(order) > _ROW_PASSES_FROM else None
        if rows is not None and (idle or all(map(scheduled.get, order))):
            # Every request in the order holds a row and runs (a server's usual step, of many
            # requests): C-level passes, cheaper than the loop below past a few dozen.
            reqs = map(requests.__getitem__, order)
            tokens = np.fromiter(map(_CONFIRMED, reqs), dtype=np.int64, count=len(order))
        else:
            rows, tokens = [], []
            states = self._states
            for rid in order:
                st = states.get(rid)
                # A finished request holds no row (check_invariants): `admitted` covers both.
                if st is None or not st.admitted or not (idle or scheduled.get(rid, 0)):
                    continue
                req = requests[rid]
                rows.append(st.row)
                tokens.append(req.num_computed_tokens - req.num_output_placeholders)
        if not rows:
            return
        ready_arr = self._ready(rows, tokens)
        # Handoffs of this step already took their CPU blocks, so what is free is the budget.
        budget, restore_budget = self._cpu_pool.num_free_blocks, self._restore_budget()
        t0 = time.perf_counter()
        sel = self._selector.select(rows, ready_arr, budget, restore_budget)
        self._stats.select_s += time.perf_counter() - t0
        self._stats.select_calls += 1
        self._stats.scan.add(sel.outcomes)
        self._stats.restore_thrash += sel.thrash
        if self._admission is not None and len(sel):
            self._admission.filter(sel)
        if not len(sel):
            return
        start = len(job.gpu)
        job.gpu += sel.gpu_blocks
        job.groups += sel.groups
        job.keys += sel.keys
        rows = sel.rows
        if isinstance(rows, np.ndarray):
            # Rows come in scan order, each in one run: the first of each run, in one pass.
            rows = rows[np.concatenate(([True], rows[1:] != rows[:-1]))].tolist()
        else:
            rows = list(dict.fromkeys(rows))
        rids = list(map(self._row_req.__getitem__, rows))
        if job.req_ids:
            seen = set(job.req_ids)
            rids = [rid for rid in rids if rid not in seen]
        job.req_ids += rids
        # The scanned rows are running: their full-attention table blocks are theirs until
        # they finish or are preempted (a sliding window's may have left its table).
        full = self._full
        held = np.full(len(sel), full[0]) if len(full) == 1 else full[np.asarray(sel.groups)]
        self.allocate(job, start, sel.arrays, held)

    def _ready(self, rows: list[int], tokens: list[int] | np.ndarray) -> np.ndarray:
        """``ready[i, g]``: ``_confirmed_positions`` capped by the table length, for every
        scanned row at once (0 for groups that are not positional); ``tokens[i]``: the
        confirmed tokens of ``rows[i]``'s request."""
        rows_arr = np.asarray(rows, dtype=np.int64)
        aligned = np.asarray(tokens, dtype=np.int64) // self._align * self._align
        keys = self._row_keys[rows_arr]
        ready = np.zeros((len(rows), self._layout.num_groups), dtype=np.int64)
        for g, spec in enumerate(self._layout.groups):
            if self._positional[g]:
                ready[:, g] = np.minimum(np.minimum(aligned // spec.block_size,
                                                    keys // self._ratio[g]),
                                         self._table_len[g, rows_arr])
        return ready

    def _restore_budget(self) -> int | None:
        """This step's re-store cap: the per-step bound, and the room running requests' blocks
        have left under ``restore_share`` of the CPU pool."""
        cap = self._config.max_restores_per_step
        share = self._config.restore_share
        if share is not None:
            room = int(share * (self._cpu_pool.num_blocks - 1)) - self._selector.running_present
            cap = max(0, room) if cap is None else min(cap, max(0, room))
        return cap

    def allocate(self, job: StoreJob, start: int = 0,
                 arrays: tuple[np.ndarray, np.ndarray] | None = None,
                 held: np.ndarray | None = None) -> None:
        """CPU blocks for ``job``'s pairs from ``start`` on; pin their GPU sources.
        ``arrays``: those pairs' GPU blocks and keys as int64 arrays, when the caller has them
        (pinned and flagged in one vectorized call each). ``held``: which of those sources a
        running request holds now (its full-attention table blocks), pinned with the GPU
        pool's ``pin_held``; None: none is known to be."""
        n = len(job.gpu) - start
        if n <= 0:
            return
        selector = self._selector
        listened = getattr(selector, "listen_s", 0.0)
        t0 = time.perf_counter()
        if self._lifetimes is not None:
            # Keys in the order the blocks are handed out (vLLM's ARC adapts before evicting).
            self._lifetimes.on_store_started(job.keys[start:])
        job.cpu += self._cpu_pool.get_new_blocks(n)
        t1 = time.perf_counter()
        gpu, keys = arrays if arrays is not None else (job.gpu[start:], job.keys[start:])
        if held is None:
            self._gpu_pool.touch(gpu)
        elif held.all():
            self._gpu_pool.pin_held(gpu)
        else:
            gpu = np.asarray(gpu, dtype=np.int64)
            self._gpu_pool.pin_held(gpu[held])
            self._gpu_pool.touch(gpu[~held])
        selector.set_in_flight(gpu, keys, True)
        stats = self._stats
        # The evictions' listeners run inside the allocation; they are counted apart.
        listen = getattr(selector, "listen_s", 0.0) - listened
        stats.alloc_s += t1 - t0 - listen
        stats.listen_s += listen
        stats.pin_s += time.perf_counter() - t1

    def issue(self, job: StoreJob) -> Transfer:
        """The step's store transfer: ``job`` plus the queued finish flush, under one new event
        (an empty transfer when there is nothing to store)."""
        if self._flush.gpu:
            job.extend(self._flush)
            self._flush = StoreJob()
        if not job.gpu:
            return Transfer()
        ev = self._next_event
        self._next_event += 1
        self._jobs[ev] = job
        for rid in job.req_ids:
            if (st := self._states.get(rid)) is not None:
                st.events.add(ev)
        return Transfer(ev, job.gpu, job.cpu, job.groups)

    # ---- reports ----------------------------------------------------------------------------

    def apply_reports(self, completed: dict[int, int], failed: list[int]) -> None:
        """Count reports; a store takes effect once ``world_size`` arrived. Late or repeated
        reports are counted in ``stats.stale_reports``."""
        world = self._config.world_size
        for ev, count in completed.items():
            if ev not in self._jobs and ev not in self._abandoned:
                self._stats.stale_reports += 1
                logger.info("ignoring a report for store event %d, already completed", ev)
                continue
            total = self._reports.get(ev, 0) + count
            if total < world:
                self._reports[ev] = total
                continue
            self._reports.pop(ev, None)
            if total > world:
                self._stats.stale_reports += total - world
            self._complete(ev, failed=False)
        for ev in failed:
            if ev in self._jobs or ev in self._abandoned:
                self._reports.pop(ev, None)
                self._complete(ev, failed=True)
            else:
                self._stats.stale_reports += 1

    def _complete(self, ev: int, failed: bool) -> None:
        job = self._jobs.pop(ev, None)
        abandoned = job is None
        if abandoned:
            job = self._abandoned.pop(ev)
        else:
            self._selector.set_in_flight(job.gpu, job.keys, False)
        order = range(len(job.gpu) - 1, -1, -1) if self._config.cpu_free_order == "tail_first" \
            else range(len(job.gpu))
        if failed:
            self._stats.failed_transfers += 1
            logger.warning("store event %d failed on a worker: %d blocks released, nothing "
                           "cached", ev, len(job.gpu))
            if not abandoned:
                self._selector.want(job.keys)
        elif not abandoned:
            block_keys = self._gpu_pool.block_keys
            gpu, cpu, groups = job.gpu, job.cpu, job.groups
            self._cpu_pool.cache_blocks([cpu[i] for i in order],
                                        [block_keys(gpu[i]) for i in order],
                                        [groups[i] for i in order])
            self._stats.stores_completed += 1
            self._stats.blocks_stored += len(job.gpu)
        self._cpu_pool.free_blocks([job.cpu[i] for i in order])
        self._gpu_pool.free_blocks([job.gpu[i] for i in order])
        for rid in job.req_ids:
            st = self._states.get(rid)
            if st is not None:
                st.events.discard(ev)
                # A finish flush still queued carries its blocks in a later store.
                if st.finished and not st.events and rid not in self._flush.req_ids:
                    self._drop_state(rid)
