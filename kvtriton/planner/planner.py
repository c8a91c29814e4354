"""``OffloadPlanner``: the scheduler side of the CPU tier, from lookup to store completion.

A scheduler calls it in the order vLLM calls a KV connector:

1. ``get_num_new_matched_tokens(req, num_computed)`` for a waiting request: the CPU hit past the
   local prefix (only from a scheduler-block-aligned start, capped so the last token is
   recomputed); hit blocks stay pinned until allocation; the hit is asynchronous.
2. ``update_state_after_alloc(req, block_ids, num_external_tokens)``: the CPU blocks of a hit of
   ``num_external_tokens`` become a load into the request's GPU blocks; the rest are unpinned. A
   scheduler may accept less than the hit; with a sliding-window or Mamba group that shorter hit
   needs other blocks (its own window, its own state), which must be in the CPU, else
   ``ValueError``.
3. ``build_meta(step)``: one store and one load transfer for the workers.
4. ``update_connector_output(...)``: completions. A store counts once all ``world_size`` workers
   reported it; its blocks are then registered in the CPU pool under every key of their GPU block
   and freed in the configured order (tail first by default).
5. ``request_finished(req)``: queue a flush of the confirmed blocks past the cursor; transfers in
   flight keep their pins and are completed normally.
6. ``reset()``: abandon in-flight transfers (their pins are released at completion, nothing is
   cached) and clear the CPU cache when nothing is in flight.

Eager store selection is a ``StoreSelector`` (``scan.FusedSelector`` or the loop reference).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kvtriton.lookup import find_longest_hit
from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.reference import LoopSelector
from kvtriton.planner.scan import FusedSelector
from kvtriton.planner.stats import PlannerStats
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.records import PlannerMeta, Request, StepOutput, Transfer
from kvtriton.specs import KVLayout

__all__ = ["OffloadPlanner"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    """Pairs of one store (or queued flush): GPU block -> CPU block of a group, primary key."""

    gpu: list[int] = field(default_factory=list)
    cpu: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)

    def extend(self, other: _Job) -> None:
        self.gpu += other.gpu
        self.cpu += other.cpu
        self.groups += other.groups
        self.keys += other.keys
        self.req_ids += [r for r in other.req_ids if r not in self.req_ids]


@dataclass(slots=True)
class _Load:
    gpu: list[int]
    cpu: list[int]
    groups: list[int]
    event: int | None = None
    finished: bool = False


@dataclass(slots=True)
class _StoreState:
    row: int
    nblk: list[int]
    events: set[int] = field(default_factory=set)
    finished: bool = False
    admitted: bool = True


class OffloadPlanner:
    """Plans CPU offload for one scheduler.

    Args:
        layout: the model's KV groups.
        gpu_pool: the scheduler's GPU block pool (prefix cache). Build the planner before
            caching anything in it: it listens to the pool's key events.
        cpu_pool: the CPU tier, or an int for a new LRU pool of that many usable blocks.
        config: policy switches.
    """

    def __init__(self, layout: KVLayout, gpu_pool: BlockPool, cpu_pool: BlockPool | int,
                 config: PlannerConfig | None = None) -> None:
        self.layout = layout
        self.config = config or PlannerConfig()
        self.gpu_pool = gpu_pool
        if isinstance(cpu_pool, int):
            if cpu_pool < 1:
                raise ValueError(f"cpu_pool must hold at least one block, got {cpu_pool}")
            cpu_pool = BlockPool(cpu_pool + 1, medium="CPU")
        self.cpu_pool = cpu_pool
        cfg = self.config
        if cfg.fine_grained and any(g.kind != "full" for g in layout.groups):
            raise ValueError("fine_grained hits need a layout of full-attention groups only")
        selector_cls = FusedSelector if cfg.scan == "fused" else LoopSelector
        self.selector = selector_cls(layout, gpu_pool, cpu_pool, restore=cfg.restore,
                                     max_restores_per_key=cfg.max_restores_per_key)
        gpu_pool.add_listener(self.selector.on_gpu_insert, self.selector.on_gpu_evict)
        cpu_pool.add_listener(self.selector.on_cpu_insert, self.selector.on_cpu_evict)
        self.stats = PlannerStats()
        hbs = layout.hash_block_size
        self._ratio = [g.block_size // hbs for g in layout.groups]
        self._positional = [g.kind != "mamba" for g in layout.groups]
        self._all_full = all(g.kind == "full" for g in layout.groups)
        self._align = hbs if cfg.fine_grained else layout.scheduler_block_size
        self._requests: dict[str, Request] = {}
        self._stores: dict[str, _StoreState] = {}
        self._row_req: dict[int, str] = {}
        self._free_rows: list[int] = []
        self._next_row = 0
        self._pending_hits: dict[str, tuple[tuple[list[int], ...], int, int]] = {}
        self._loads: dict[str, _Load] = {}
        # Loads abandoned by reset() but still in flight, oldest first per request.
        self._abandoned_loads: dict[str, list[_Load]] = {}
        self._load_event_reqs: dict[int, list[str]] = {}
        self._jobs: dict[int, _Job] = {}
        self._abandoned_jobs: dict[int, _Job] = {}
        self._flush = _Job()
        self._reports: dict[int, int] = {}
        self._next_store_event = 0
        self._next_load_event = 0
        self._lazy_cursor: int | None = None
        self._lazy_target = cfg.lazy_target_blocks if cfg.lazy_target_blocks is not None \
            else self._derive_lazy_target()

    # ---- small helpers --------------------------------------------------------------------

    def _derive_lazy_target(self) -> int:
        """GPU blocks to keep offloaded ahead of eviction: what two steps can allocate."""
        target = 0
        for g in self.layout.groups:
            if g.kind == "mamba":
                target += 2
            elif g.kind == "sliding_window":
                target += -(-g.sliding_window // g.block_size) + 1
            else:
                target += -(-self.config.max_num_batched_tokens // g.block_size)
        return 2 * target

    def _primary_keys(self, req: Request) -> list[np.ndarray]:
        return [req.keys[g, r - 1::r] if self._positional[g] else req.keys[g, :0]
                for g, r in enumerate(self._ratio)]

    def _request(self, req_id: str) -> Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None

    def _admit(self, req: Request, st: _StoreState) -> None:
        self.selector.admit(st.row, self._primary_keys(req))
        st.nblk = [0] * self.layout.num_groups
        st.admitted = True

    def _unadmit(self, st: _StoreState) -> None:
        if st.admitted:
            self.selector.release(st.row)
            st.admitted = False

    def _drop_store_state(self, req_id: str) -> None:
        st = self._stores.pop(req_id, None)
        if st is None:
            return
        self._unadmit(st)
        del self._row_req[st.row]
        self._free_rows.append(st.row)

    def _unpin_hit(self, pending) -> None:
        blocks = [b for grp in pending[0] for b in grp if b != NULL_BLOCK]
        if blocks:
            self.cpu_pool.free_blocks(blocks)

    def _confirmed_positions(self, req: Request, g: int) -> int:
        """Positions of group g whose tokens are confirmed computed and hashed."""
        aligned = req.confirmed_tokens // self._align * self._align
        return min(aligned // self.layout.groups[g].block_size,
                   req.keys.shape[1] // self._ratio[g])

    # ---- 1. lookup ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the CPU tier can supply, and whether the hit is
        asynchronous (always, when non-zero: the request waits a step for its load)."""
        rid = req.request_id
        self._requests[rid] = req
        if (stale := self._pending_hits.pop(rid, None)) is not None:
            self._unpin_hit(stale)
        self.stats.lookups += 1
        if num_computed_tokens % self.layout.scheduler_block_size:
            # A load fills whole blocks, so it cannot start inside a local block.
            self.stats.lookups_unaligned += 1
            return 0, False
        hbs = self.layout.hash_block_size
        skip = num_computed_tokens // hbs
        cap = req.num_tokens - 1 - num_computed_tokens
        n_keys = min(req.keys.shape[1], req.num_tokens // hbs)
        if cap <= 0 or skip >= n_keys:
            return 0, False
        keys = req.keys[:, skip:n_keys].tolist()
        hit = find_longest_hit(self.layout, self.cpu_pool, keys, cap,
                               fine_grained=self.config.fine_grained)
        self._count_holes(keys, hit.num_tokens // hbs)
        if hit.num_tokens == 0:
            return 0, False
        self.cpu_pool.touch([b for grp in hit.blocks for b in grp if b != NULL_BLOCK])
        self._pending_hits[rid] = (hit.blocks, hit.num_tokens, num_computed_tokens)
        return hit.num_tokens, True

    def _count_holes(self, keys: list[list[int]], hit_hash_blocks: int) -> None:
        """Blocks of the first full-attention group present in the CPU past the first miss."""
        for g, spec in enumerate(self.layout.groups):
            if spec.kind != "full":
                continue
            r = self._ratio[g]
            primaries = keys[g][r - 1::r]
            first_miss = hit_hash_blocks // r
            if first_miss < len(primaries) and primaries[first_miss] not in self.cpu_pool:
                holes = sum(k in self.cpu_pool for k in primaries[first_miss + 1:])
                self.stats.chain_holes += holes
                self.stats.lookups_with_holes += holes > 0
            return

    # ---- 2. after allocation --------------------------------------------------------------

    def update_state_after_alloc(self, req: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """``block_ids[g]``: the request's whole GPU table for group g after allocation."""
        rid = req.request_id
        self._requests[rid] = req
        if not self.config.lazy and rid not in self._stores:
            row = self._free_rows.pop() if self._free_rows else self._next_row
            self._next_row = max(self._next_row, row + 1)
            st = _StoreState(row, [0] * self.layout.num_groups)
            self._stores[rid] = st
            self._row_req[row] = rid
            self._admit(req, st)
        pending = self._pending_hits.pop(rid, None)
        if num_external_tokens == 0:
            if pending is not None:
                self._unpin_hit(pending)
            return
        if pending is None:
            raise ValueError(f"request {rid!r}: {num_external_tokens} external tokens accepted "
                             "but no CPU hit is pending for it")
        hit_blocks, hit_tokens, num_computed = pending
        if num_external_tokens > hit_tokens or num_external_tokens % self.layout.hash_block_size:
            self._unpin_hit(pending)
            raise ValueError(f"request {rid!r}: num_external_tokens={num_external_tokens} is not "
                             f"a hash-block multiple <= the hit of {hit_tokens}")
        if num_external_tokens < hit_tokens and not self._all_full:
            # A shorter hit needs other blocks: the window before its end, the state at its end.
            hbs = self.layout.hash_block_size
            skip = num_computed // hbs
            keys = req.keys[:, skip:skip + num_external_tokens // hbs].tolist()
            short = find_longest_hit(self.layout, self.cpu_pool, keys, num_external_tokens)
            if short.num_tokens != num_external_tokens:
                self._unpin_hit(pending)
                raise ValueError(f"request {rid!r}: the CPU tier cannot supply exactly "
                                 f"{num_external_tokens} of its {hit_tokens}-token hit (a "
                                 "sliding-window or Mamba group has no blocks ending there)")
            hit_blocks = short.blocks
        gpu, cpu, groups = [], [], []
        for g, spec in enumerate(self.layout.groups):
            take = -(-num_external_tokens // spec.block_size)
            start = num_computed // spec.block_size
            table = block_ids[g]
            if start + take > len(table):
                self._unpin_hit(pending)
                raise ValueError(f"request {rid!r}: group {g} table has {len(table)} blocks, "
                                 f"the load needs {start + take}")
            for i, cb in enumerate(hit_blocks[g][:take]):
                if cb == NULL_BLOCK:
                    continue
                gpu.append(table[start + i])
                cpu.append(cb)
                groups.append(g)
        self.cpu_pool.touch(cpu)
        self._unpin_hit(pending)
        self.gpu_pool.touch(gpu)
        self._loads[rid] = _Load(gpu, cpu, groups)
        self.stats.cpu_hit_tokens += num_external_tokens

    # ---- 3. per step ----------------------------------------------------------------------

    def build_meta(self, step: StepOutput) -> PlannerMeta:
        """The step's store and load transfers (event ids, or -1 when a direction is empty)."""
        job = _Job()
        if self.config.lazy:
            self._lazy_select(job)
        else:
            self._track_step(step)
            self._handoffs(step, job)
            self._eager_select(step, job)
        if self._flush.gpu:
            job.extend(self._flush)
            self._flush = _Job()
        store = Transfer()
        if job.gpu:
            ev = self._next_store_event
            self._next_store_event += 1
            self._jobs[ev] = job
            for rid in job.req_ids:
                if (st := self._stores.get(rid)) is not None:
                    st.events.add(ev)
            store = Transfer(ev, job.gpu, job.cpu, job.groups)
        load = Transfer()
        load_rids = [rid for rid, ld in self._loads.items() if ld.event is None]
        if load_rids:
            ev = self._next_load_event
            self._next_load_event += 1
            load = Transfer(ev)
            for rid in load_rids:
                ld = self._loads[rid]
                ld.event = ev
                load.gpu_blocks += ld.gpu
                load.cpu_blocks += ld.cpu
                load.groups += ld.groups
            self._load_event_reqs[ev] = load_rids
            self.stats.loads_issued += 1
        self.stats.running_evictions = self.selector.running_evictions
        return PlannerMeta(store, load, {e: list(r) for e, r in self._load_event_reqs.items()},
                           need_flush=bool(step.preempted_req_ids))

    def _track_step(self, step: StepOutput) -> None:
        for rid in step.preempted_req_ids:
            if (st := self._stores.get(rid)) is not None and not st.finished:
                # Its GPU blocks are gone: table and cursors start over when it resumes.
                self._unadmit(st)
        for rid, new_ids in step.new_block_ids.items():
            st = self._stores.get(rid)
            if st is None or st.finished:
                continue
            if rid in step.resumed_req_ids and st.admitted:
                self._unadmit(st)
            if not st.admitted:
                self._admit(self._requests[rid], st)
            for g, ids in enumerate(new_ids):
                if ids and self._positional[g]:
                    self.selector.append_blocks(st.row, g, list(ids))
                    st.nblk[g] += len(ids)

    def _handoffs(self, step: StepOutput, job: _Job) -> None:
        """Mamba states saved at a boundary this step, stored as state blocks."""
        gpu_pool, cpu_pool, stats = self.gpu_pool, self.cpu_pool, self.stats
        free = cpu_pool.num_free_blocks
        for rid, entries in step.boundary_handoffs.items():
            st = self._stores.get(rid)
            gone = (st is None or st.finished or rid in step.preempted_req_ids
                    or rid in step.finished_req_ids)
            for _boundary, gb, g in entries:
                key = None if gone or gb == NULL_BLOCK else gpu_pool.block_hash(gb)
                if key is None:
                    stats.handoff_dropped += 1
                    continue
                if self.selector.in_flight(gb, key) or key in cpu_pool or key in job.keys:
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
        self._allocate(job, 0)

    def _eager_select(self, step: StepOutput, job: _Job) -> None:
        order = step.order if step.order is not None else list(step.num_scheduled_tokens)
        if self.config.scan_idle:
            seen = set(order)
            order = order + [r for r in self._stores if r not in seen]
        rows, ready = [], []
        G = self.layout.num_groups
        for rid in order:
            st = self._stores.get(rid)
            if st is None or st.finished or not st.admitted:
                continue
            if not self.config.scan_idle and not step.num_scheduled_tokens.get(rid, 0):
                continue
            req = self._requests[rid]
            rows.append(st.row)
            ready.append([min(self._confirmed_positions(req, g), st.nblk[g])
                          if self._positional[g] else 0 for g in range(G)])
        if not rows:
            return
        # Handoffs of this step already took their CPU blocks, so what is free is the budget.
        sel = self.selector.select(rows, np.asarray(ready, dtype=np.int64).reshape(len(rows), G),
                                   self.cpu_pool.num_free_blocks, self._restore_budget())
        self.stats.scan.add(sel.outcomes)
        self.stats.restore_thrash += sel.thrash
        if not len(sel):
            return
        start = len(job.gpu)
        job.gpu += sel.gpu_blocks
        job.groups += sel.groups
        job.keys += sel.keys
        seen = set(job.req_ids)
        for row in dict.fromkeys(sel.rows):
            rid = self._row_req[row]
            if rid not in seen:
                job.req_ids.append(rid)
        self._allocate(job, start)

    def _restore_budget(self) -> int | None:
        """This step's re-store cap: the per-step bound, and the room running requests' blocks
        have left under ``restore_share`` of the CPU pool."""
        cap = self.config.max_restores_per_step
        share = self.config.restore_share
        if share is not None:
            room = int(share * (self.cpu_pool.num_blocks - 1)) - self.selector.running_present
            cap = max(0, room) if cap is None else min(cap, max(0, room))
        return cap

    def _allocate(self, job: _Job, start: int) -> None:
        """CPU blocks for ``job``'s pairs from ``start`` on; pin their GPU sources."""
        n = len(job.gpu) - start
        if n <= 0:
            return
        job.cpu += self.cpu_pool.get_new_blocks(n)
        self.gpu_pool.touch(job.gpu[start:])
        self.selector.set_in_flight(job.gpu[start:], job.keys[start:], True)

    def _lazy_select(self, job: _Job) -> None:
        """Offload hashed GPU blocks about to be evicted, walking the free queue from a cursor."""
        gpu_pool, cpu_pool = self.gpu_pool, self.cpu_pool
        free = cpu_pool.num_free_blocks
        if self._lazy_cursor is not None and gpu_pool.ref_cnt[self._lazy_cursor] > 0:
            self._lazy_cursor = None
        last = self._lazy_cursor
        for covered, b in enumerate(gpu_pool.iter_free(self._lazy_cursor)):
            if covered >= self._lazy_target or len(job.gpu) >= free:
                break
            last = b
            key = gpu_pool.block_hash(b)
            if key is None or key in cpu_pool or self.selector.in_flight(b, key) \
                    or key in job.keys:
                continue
            job.gpu.append(b)
            job.groups.append(self._group_of_key(key))
            job.keys.append(key)
        self._lazy_cursor = last
        self.stats.lazy_stored += len(job.gpu)
        self._allocate(job, 0)

    def _group_of_key(self, key: int) -> int:
        # Lazy mode sees bare GPU blocks; which group a block belongs to is recorded when the
        # simulator or scheduler tags it (BlockPool.cache_block's group_idx is not kept), so a
        # single-group layout is the supported case.
        if self.layout.num_groups != 1:
            raise ValueError("lazy mode supports single-group layouts only")
        return 0

    # ---- 4. completions -------------------------------------------------------------------

    def update_connector_output(
        self,
        finished_loads: Iterable[str] = (),
        completed_stores: Mapping[int, int] | Iterable[int] = (),
        failed_stores: Iterable[int] = (),
        failed_loads: Iterable[str] = (),
    ) -> None:
        """Apply worker reports.

        ``completed_stores`` maps a store event to how many workers reported it this step (an
        iterable of events counts one report each). A store takes effect once ``world_size``
        reports arrived. Reports that a real worker can legitimately send late or twice (an event
        already completed or abandoned by ``reset``, a load of a request already cleaned up) are
        logged and counted in ``stats.stale_reports``; an event id that was never issued raises
        ``ValueError``, before any report of the call is applied. ``failed_*`` release the
        transfer's pins without caching anything.
        """
        if not isinstance(completed_stores, Mapping):
            counts: dict[int, int] = {}
            for ev in completed_stores:
                counts[ev] = counts.get(ev, 0) + 1
            completed_stores = counts
        failed_stores = list(failed_stores)
        for ev in [*completed_stores, *failed_stores]:
            if not isinstance(ev, int) or not 0 <= ev < self._next_store_event:
                raise ValueError(f"store event {ev!r} was never issued")
        for ev, count in completed_stores.items():
            if count <= 0:
                raise ValueError(f"store event {ev}: report count must be positive, got {count}")
        for rid in finished_loads:
            self._finish_load(rid, failed=False)
        for rid in failed_loads:
            self._finish_load(rid, failed=True)
        for ev, count in completed_stores.items():
            if ev not in self._jobs and ev not in self._abandoned_jobs:
                self.stats.stale_reports += 1
                logger.info("ignoring a report for store event %d, already completed", ev)
                continue
            total = self._reports.get(ev, 0) + count
            if total < self.config.world_size:
                self._reports[ev] = total
                continue
            self._reports.pop(ev, None)
            if total > self.config.world_size:
                self.stats.stale_reports += total - self.config.world_size
            self._complete_store(ev, failed=False)
        for ev in failed_stores:
            if ev in self._jobs or ev in self._abandoned_jobs:
                self._reports.pop(ev, None)
                self._complete_store(ev, failed=True)
            else:
                self.stats.stale_reports += 1

    def _finish_load(self, rid: str, failed: bool) -> None:
        # A report names a request, not an event. Workers finish a request's loads in the order
        # they were issued, and a load abandoned by reset() is older than any issued after it
        # (the same request may be looked up again while it is in flight), so it goes first.
        abandoned = self._abandoned_loads.get(rid)
        if abandoned:
            ld = abandoned.pop(0)
            if not abandoned:
                del self._abandoned_loads[rid]
        else:
            ld = self._loads.get(rid)
            if ld is None or ld.event is None:
                self.stats.stale_reports += 1
                logger.info("ignoring a load report for request %r with no load in flight", rid)
                return
            del self._loads[rid]
        reqs = self._load_event_reqs.get(ld.event)
        if reqs is not None:
            reqs.remove(rid)
            if not reqs:
                del self._load_event_reqs[ld.event]
        self.cpu_pool.free_blocks(ld.cpu)
        self.gpu_pool.free_blocks(ld.gpu)
        if failed:
            self.stats.failed_transfers += 1
            logger.warning("load of request %r failed on a worker: %d blocks released, the "
                           "scheduler recomputes them", rid, len(ld.gpu))
        else:
            self.stats.blocks_loaded += len(ld.gpu)

    def _complete_store(self, ev: int, failed: bool) -> None:
        job = self._jobs.pop(ev, None)
        abandoned = job is None
        if abandoned:
            job = self._abandoned_jobs.pop(ev)
        else:
            self.selector.set_in_flight(job.gpu, job.keys, False)
        order = range(len(job.gpu) - 1, -1, -1) if self.config.cpu_free_order == "tail_first" \
            else range(len(job.gpu))
        if failed or abandoned:
            self.stats.failed_transfers += failed
            if failed:
                logger.warning("store event %d failed on a worker: %d blocks released, nothing "
                               "cached", ev, len(job.gpu))
            if failed and not abandoned:
                self.selector.want(job.keys)
        else:
            gpu_pool, cpu_pool = self.gpu_pool, self.cpu_pool
            for i in order:
                keys = gpu_pool.block_keys(job.gpu[i])
                cpu_pool.cache_block(job.cpu[i], keys[0], keys[1:], group_idx=job.groups[i])
            self.stats.stores_completed += 1
            self.stats.blocks_stored += len(job.gpu)
        self.cpu_pool.free_blocks([job.cpu[i] for i in order])
        self.gpu_pool.free_blocks([job.gpu[i] for i in order])
        for rid in job.req_ids:
            st = self._stores.get(rid)
            if st is not None:
                st.events.discard(ev)
                if st.finished and not st.events:
                    self._drop_store_state(rid)

    # ---- 5. finish --------------------------------------------------------------------------

    def request_finished(self, req: Request) -> None:
        """``req`` finished or was aborted: flush, then clean up once its transfers are done."""
        rid = req.request_id
        self._request(rid)
        if (pending := self._pending_hits.pop(rid, None)) is not None:
            self._unpin_hit(pending)
        ld = self._loads.get(rid)
        if ld is not None:
            if ld.event is None:
                del self._loads[rid]
                self.cpu_pool.free_blocks(ld.cpu)
                self.gpu_pool.free_blocks(ld.gpu)
            else:
                ld.finished = True
        st = self._stores.get(rid)
        if st is not None and not st.finished:
            if st.admitted:
                self._queue_flush(rid, req, st)
            st.finished = True
            self._unadmit(st)
            if not st.events and rid not in self._flush.req_ids:
                self._drop_store_state(rid)
        self._requests.pop(rid, None)

    def _queue_flush(self, rid: str, req: Request, st: _StoreState) -> None:
        """Queue confirmed blocks the scan has not stored (past the cursor, and wanted ones
        below it) for the next store batch; also the prompt-tail block of a fine-grained hit."""
        job = _Job()
        gpu_pool, cpu_pool, sel = self.gpu_pool, self.cpu_pool, self.selector
        free = cpu_pool.num_free_blocks
        pkeys = self._primary_keys(req)
        queued = set(self._flush.keys)
        for g, spec in enumerate(self.layout.groups):
            if not self._positional[g]:
                continue
            table = sel.table(st.row, g)
            cur = sel.cursor(st.row, g)
            ready = min(self._confirmed_positions(req, g), len(table))
            positions = (sel.wanted_below_cursor(st.row, g) if self.config.restore else []) \
                + list(range(cur, ready))
            for pos in positions:
                key = int(pkeys[g][pos])
                src = table[pos]
                if src == NULL_BLOCK and spec.kind == "sliding_window":
                    src = gpu_pool.get_cached_block(key) or NULL_BLOCK
                if (src == NULL_BLOCK or gpu_pool.block_hash(src) != key
                        or sel.in_flight(src, key) or key in cpu_pool or key in queued):
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
            self._allocate(job, 0)
            self._flush.extend(job)
            self.stats.flush_stored += len(job.gpu)

    def _prompt_tail_block(self, req: Request, st: _StoreState) -> tuple[int, int] | None:
        """The partial full-attention block holding the prompt's last hash boundary, if the GPU
        block is registered under that boundary's key (fine-grained hits only)."""
        if not self.config.fine_grained:
            return None
        hbs, B = self.layout.hash_block_size, self.layout.groups[0].block_size
        boundary = req.num_prompt_tokens // hbs * hbs
        if boundary == 0 or boundary % B == 0 or boundary > req.num_computed_tokens:
            return None
        table = self.selector.table(st.row, 0)
        idx = boundary // B
        if idx >= len(table) or boundary // hbs > req.keys.shape[1]:
            return None
        gb = table[idx]
        key = int(req.keys[0, boundary // hbs - 1])
        if (gb == NULL_BLOCK or key not in self.gpu_pool.block_keys(gb)
                or key in self.cpu_pool or self.selector.in_flight(gb, key)):
            return None
        return gb, key

    # ---- 6. reset ---------------------------------------------------------------------------

    def reset(self) -> bool:
        """Abandon every transfer and forget every request; True if the CPU cache was cleared
        (only possible when no transfer is in flight)."""
        for ev, job in self._jobs.items():
            self.selector.set_in_flight(job.gpu, job.keys, False)
            self._abandoned_jobs[ev] = job
            self.stats.abandoned_stores += 1
        self._jobs.clear()
        flush, self._flush = self._flush, _Job()
        if flush.gpu:
            self.selector.set_in_flight(flush.gpu, flush.keys, False)
            self.cpu_pool.free_blocks(flush.cpu)
            self.gpu_pool.free_blocks(flush.gpu)
        for rid, ld in list(self._loads.items()):
            if ld.event is None:
                self.cpu_pool.free_blocks(ld.cpu)
                self.gpu_pool.free_blocks(ld.gpu)
            else:
                self._abandoned_loads.setdefault(rid, []).append(ld)
        self._loads.clear()
        for pending in self._pending_hits.values():
            self._unpin_hit(pending)
        self._pending_hits.clear()
        for rid in list(self._stores):
            self._drop_store_state(rid)
        self._requests.clear()
        self._reports = {ev: n for ev, n in self._reports.items() if ev in self._abandoned_jobs}
        self._lazy_cursor = None
        if self._abandoned_jobs or self._abandoned_loads:
            return False
        return self.cpu_pool.reset_prefix_cache()

    # ---- introspection ----------------------------------------------------------------------

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests or req_id in self._stores or req_id in self._loads

    def has_pending_stores(self) -> bool:
        return bool(self._flush.gpu or self._jobs or self._abandoned_jobs)

    def has_pending_work(self) -> bool:
        return bool(self.has_pending_stores() or self._loads or self._abandoned_loads)

    def pending_store_blocks(self) -> int:
        return len(self._flush.gpu) + sum(len(j.gpu) for j in self._jobs.values()) + sum(
            len(j.gpu) for j in self._abandoned_jobs.values())

    def cpu_used_blocks(self) -> int:
        return self.cpu_pool.num_used_blocks

    def load_pending(self, req_id: str) -> bool:
        """Whether ``req_id`` still waits for a CPU load."""
        return req_id in self._loads

    def cursor(self, req_id: str, group: int = 0) -> int:
        st = self._stores.get(req_id)
        if st is None or not st.admitted:
            raise ValueError(f"request {req_id!r} has no store cursor")
        return self.selector.cursor(st.row, group)
