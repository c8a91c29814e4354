"""``OffloadPlanner``: the scheduler side of the CPU tier, from lookup to store completion.

A scheduler calls it in the order vLLM calls a KV connector:

1. ``get_num_new_matched_tokens(req, num_computed)`` for a waiting request: the CPU hit past the
   local prefix (only from a scheduler-block-aligned start, capped so the last token is
   recomputed); hit blocks stay pinned until allocation; the hit is asynchronous.
2. ``update_state_after_alloc(req, block_ids, num_external_tokens)``: the CPU blocks of a hit of
   ``num_external_tokens`` become a load into the request's GPU blocks; the rest are unpinned. A
   scheduler may accept less than the hit; with a sliding-window or Mamba group that shorter hit
   needs other blocks (its own window, its own state), which must be in the CPU, else
   ``ValueError``. A request takes one load at a time: while its load is not reported it is
   neither looked up again nor given a second load.
3. ``build_meta(step)``: one store and one load transfer for the workers.
4. ``update_connector_output(...)``: completions. A store counts once all ``world_size`` workers
   reported it; its blocks are then registered in the CPU pool under every key of their GPU block
   and freed in the configured order (tail first by default).
5. ``request_finished(req, hint=...)``: queue a flush of the confirmed blocks past the cursor;
   transfers in flight keep their pins and are completed normally. ``hint`` is what the server
   knows of the turn's future (``"continue"``, ``"close"`` or None); hinted admission uses it.
6. ``reset()``: abandon in-flight transfers (their pins are released at completion, nothing is
   cached) and clear the CPU cache when nothing is in flight.

Each call checks its input at entry and raises ``ValueError`` naming the bad value before it
changes anything: the planner, both pools and the selector are left as they were, and no pin is
taken (the one exception, an allocation no pending hit can serve, is described on
``update_state_after_alloc``).

The front class keeps the requests and delegates each lifecycle: loads (``loads.Loads``: pending
hits, loads, load events), stores (``stores.Stores``: store states, batches, reports, the finish
flush) and lazy mode (``lazy.LazyOffload``). Eager store selection is a ``StoreSelector``
(``scan.FusedSelector`` or the loop reference, ``reference.LoopSelector``). The admission rules
that hold keys back from the CPU tier live in ``admission``, the checks of a step's blocks and
of worker reports in ``checks``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from kvtriton.planner.checks import check_key_ids, check_reports, check_request_ids, check_step
from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.lazy import LazyOffload
from kvtriton.planner.loads import Loads
from kvtriton.planner.reference import LoopSelector
from kvtriton.planner.scan import FusedSelector
from kvtriton.planner.stats import PlannerStats
from kvtriton.planner.store_batches import StoreJob
from kvtriton.planner.stores import Stores
from kvtriton.pool import BlockPool
from kvtriton.pool_interface import GpuPool
from kvtriton.records import HINTS, PlannerMeta, Request, StepOutput, Transfer
from kvtriton.specs import KVLayout
from kvtriton.validation import block_id_array, check_request_keys, is_int

__all__ = ["OffloadPlanner"]

#: What ``request_finished`` may be told of a turn's future (None: nothing).
_HINTS = (None, *HINTS)


class OffloadPlanner:
    """Plans CPU offload for one scheduler.

    Args:
        layout: the model's KV groups.
        gpu_pool: the scheduler's GPU block pool (prefix cache). Build the planner before
            caching anything in it: it listens to the pool's key events.
        cpu_pool: the CPU tier, or an int for a new LRU pool of that many usable blocks.
        config: the planner's switches.
    """

    def __init__(self, layout: KVLayout, gpu_pool: GpuPool, cpu_pool: BlockPool | int,
                 config: PlannerConfig | None = None) -> None:
        # Every argument is checked before the planner listens to either pool.
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if config is not None and not isinstance(config, PlannerConfig):
            raise ValueError(f"config must be a PlannerConfig or None, got "
                             f"{type(config).__name__}")
        if not callable(getattr(gpu_pool, "add_listener", None)) \
                or not is_int(getattr(gpu_pool, "num_blocks", None)):
            raise ValueError(f"gpu_pool must be a block pool, got {type(gpu_pool).__name__}")
        if is_int(cpu_pool):
            if cpu_pool < 1:
                raise ValueError(f"cpu_pool must hold at least one block, got {cpu_pool}")
            cpu_pool = BlockPool(int(cpu_pool) + 1, medium="CPU")
        elif not isinstance(cpu_pool, BlockPool):
            raise ValueError(f"cpu_pool must be a BlockPool or a number of blocks, got "
                             f"{cpu_pool!r}")
        if cpu_pool is gpu_pool:
            raise ValueError("cpu_pool must be another pool than gpu_pool")
        cfg = config or PlannerConfig()
        if cfg.fine_grained and any(g.kind != "full" for g in layout.groups):
            raise ValueError("fine_grained hits need a layout of full-attention groups only")
        self.layout = layout
        self.config = cfg
        self.gpu_pool = gpu_pool
        self.cpu_pool = cpu_pool
        selector_cls = FusedSelector if cfg.scan == "fused" else LoopSelector
        self.selector = selector_cls(layout, gpu_pool, cpu_pool, restore=cfg.restore,
                                     max_restores_per_key=cfg.max_restores_per_key)
        self.stats = PlannerStats()
        self._requests: dict[str, Request] = {}
        # Requests a step scheduled and none since reported preempted or finished: vLLM looks a
        # request up only while it waits, so a lookup under one of these ids is a caller's bug.
        self._running: set[str] = set()
        self._loads = Loads(layout, cfg, gpu_pool, cpu_pool, self.stats)
        self._stores = Stores(layout, cfg, gpu_pool, cpu_pool, self.selector, self.stats)
        self._lazy = LazyOffload(layout, cfg, gpu_pool, cpu_pool, self.selector, self.stats)
        sel = self.selector
        if sel.batch_listeners and callable(getattr(gpu_pool, "add_batch_listener", None)):
            gpu_pool.add_batch_listener(sel.on_gpu_insert_many, sel.on_gpu_evict_many)
        else:
            gpu_pool.add_listener(sel.on_gpu_insert, sel.on_gpu_evict)
        if sel.batch_listeners:
            cpu_pool.add_batch_listener(sel.on_cpu_insert_many, sel.on_cpu_evict_many)
        else:
            cpu_pool.add_listener(sel.on_cpu_insert, sel.on_cpu_evict)

    def _request(self, req_id: str) -> Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"unknown request id {req_id!r}") from None

    def _check_request(self, req: Request, what: str) -> None:
        if not isinstance(req, Request):
            raise ValueError(f"{what}: expected a kvtriton Request, got {type(req).__name__}")
        rid = req.request_id
        if rid in self._running and (what == "get_num_new_matched_tokens"
                                     or self._requests.get(rid) is not req):
            # Replacing the record of a running request would stop its stores silently.
            raise ValueError(f"{what}: request {rid!r} is running (scheduled, not preempted or "
                             "finished since); a preempted request is looked up again once "
                             "a step or preempted() reported it")
        # Checked at construction; checked again here because a caller may have replaced or
        # written into them since (one vectorized pass over the request's keys).
        check_request_keys(rid, req.keys)
        if req.keys.shape[0] != self.layout.num_groups:
            raise ValueError(f"{what}: request {req.request_id!r} has keys for "
                             f"{req.keys.shape[0]} groups, the layout has "
                             f"{self.layout.num_groups}")

    # ---- 1. lookup ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the CPU tier can supply, and whether the hit is
        asynchronous (always, when non-zero: the request waits a step for its load).

        ``ValueError``, changing nothing, for ``num_computed_tokens`` that is not an int in
        ``[0, req.num_tokens]``, while a load of ``req`` is not yet reported, or while a request
        of that id runs (a step scheduled it and none since reported it preempted or finished,
        nor did ``preempted``)."""
        self._check_request(req, "get_num_new_matched_tokens")
        if not is_int(num_computed_tokens) or not 0 <= num_computed_tokens <= req.num_tokens:
            raise ValueError(f"request {req.request_id!r}: num_computed_tokens must be an int in "
                             f"[0, {req.num_tokens}], got {num_computed_tokens!r}")
        hit = self._loads.lookup(req, int(num_computed_tokens))
        self._requests[req.request_id] = req
        return hit

    # ---- 2. after allocation --------------------------------------------------------------

    def update_state_after_alloc(self, req: Request, block_ids: tuple[list[int], ...],
                                 num_external_tokens: int) -> None:
        """``block_ids[g]``: the request's whole GPU table for group g after allocation.

        Everything is checked before anything changes: a ``ValueError`` for a bad table (not one
        list of GPU block ids per group, the null block or a free block where the load writes,
        too short for the load), a bad ``num_external_tokens`` (not a hash-block multiple within
        the hit), an allocation no pending hit can serve (no hit pending, or a shorter hybrid hit
        the CPU lacks), another ``Request`` under the id of a running one (as for a lookup; vLLM
        allocates again the same request when it returns from waiting with its blocks) or a
        second load while one of ``req`` is not yet reported leaves the
        planner and both pools as they were, any hit still pinned: the scheduler may call again
        with what can be served (0 external tokens releases the hit)."""
        self._check_request(req, "update_state_after_alloc")
        rid = req.request_id
        if not is_int(num_external_tokens) or num_external_tokens < 0:
            raise ValueError(f"request {rid!r}: num_external_tokens must be a non-negative int, "
                             f"got {num_external_tokens!r}")
        num_external_tokens = int(num_external_tokens)
        load = self._loads.plan(req, block_ids, num_external_tokens)
        self._admit(req)
        self._loads.commit(rid, load, num_external_tokens)

    def _admit(self, req: Request) -> None:
        self._requests[req.request_id] = req
        if not self.config.lazy:
            self._stores.admit(req)
        else:
            self._lazy.note_admitted(req.keys)
            self._stores.note_admitted(req)

    # ---- 3. per step ----------------------------------------------------------------------

    def build_meta(self, step: StepOutput) -> PlannerMeta:
        """The step's store and load transfers (event ids, or -1 when a direction is empty).
        A step whose new blocks or hand-offs are not GPU block ids of the layout's groups is
        refused with a ``ValueError`` before any of it is applied."""
        check_step(step, self.layout.num_groups, self.gpu_pool.num_blocks)
        self._running -= set(step.preempted_req_ids) | set(step.finished_req_ids)
        self._running.update(self._requests.keys() & step.num_scheduled_tokens.keys())
        job = StoreJob()
        if self.config.lazy:
            self._lazy.select(job)
            self._stores.allocate(job)
        else:
            self._stores.track_step(step, self._requests)
            self._stores.add_handoffs(step, job)
            self._stores.select(step, job, self._requests)
        store = self._stores.issue(job)
        load = self._loads.issue()
        self.stats.running_evictions = self.selector.running_evictions
        return PlannerMeta(store, load, self._loads.event_to_reqs(),
                           need_flush=bool(step.preempted_req_ids))

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
        ``ValueError``, before any report of the call is applied, and so do a report count that
        is not a positive int, one event both completed and failed in one call, and request ids
        given as one string. ``failed_*`` release the transfer's pins without caching anything.
        """
        completed, failed = check_reports(completed_stores, failed_stores,
                                          self._stores.events_issued)
        finished_loads = check_request_ids(finished_loads, "finished_loads")
        failed_loads = check_request_ids(failed_loads, "failed_loads")
        for rid in finished_loads:
            self._loads.finish(rid, failed=False)
        for rid in failed_loads:
            self._loads.finish(rid, failed=True, running=rid in self._requests)
        self._stores.apply_reports(completed, failed)

    # ---- 5. finish --------------------------------------------------------------------------

    def request_finished(self, req: Request,
                         block_ids: tuple[list[int], ...] | None = None, *,
                         hint: str | None = None) -> None:
        """``req`` finished or was aborted: flush, then clean up once its transfers are done.

        ``block_ids``: the request's GPU table per group as the scheduler hands it over at the
        end (vLLM's ``request_finished_all_groups``). The planner learns tables from scheduler
        outputs; blocks allocated after the last output that carried them (a request aborted
        while its CPU load was pending was never in one) are taken from here, so its flush can
        store its GPU prefix hits the CPU lacks. A bad table is a ``ValueError`` before anything
        changes.

        ``hint``: ``"close"`` (the request's session ended: with hinted admission its keys are
        not offloaded until another request holds them), ``"continue"`` or None; anything
        else is a ``ValueError``."""
        rid = req.request_id
        self._request(rid)
        check_request_keys(rid, req.keys)
        if hint not in _HINTS:
            raise ValueError(f"request {rid!r}: hint must be one of {_HINTS}, got {hint!r}")
        tables = None
        if block_ids is not None:
            G = self.layout.num_groups
            if not isinstance(block_ids, tuple | list) or len(block_ids) != G:
                raise ValueError(f"request {rid!r}: block_ids must hold one GPU table per group "
                                 f"({G}), got {block_ids!r:.80}")
            n_gpu = self.gpu_pool.num_blocks
            tables = [block_id_array(t, n_gpu, f"request {rid!r}: group {g} GPU table").tolist()
                      for g, t in enumerate(block_ids)]
        self._loads.drop(rid)
        self._running.discard(rid)
        self._stores.finish(req, tables)
        if self.config.lazy:
            computed = req.keys[:, :req.num_computed_tokens // self.layout.hash_block_size]
            self._lazy.note_finished(computed, hint)
            self._stores.note_finished(req)
        self._requests.pop(rid, None)

    def preempted(self, req_id: str) -> None:
        """The scheduler preempted ``req_id`` and may look it up again before a step reports the
        preemption (vLLM's ``reset_prefix_cache(reset_running_requests=True)`` preempts every
        running request, whose next lookup comes before the step that names it)."""
        self._running.discard(req_id)

    # ---- key ids ----------------------------------------------------------------------------

    def referenced_keys(self) -> np.ndarray:
        """Every key the planner refers to besides the pools' contents (int64, may repeat): its
        requests' keys, the keys its selector tracks (owned, in flight, wanted) and those of its
        store batches. An owner of key ids that recycles them (``kvtriton.vllm.keys``) keeps
        these and the pools' keys, and hands the others out again after ``forget_keys``."""
        parts = [self.selector.referenced_keys(),
                 np.asarray(self._stores.referenced_keys(), dtype=np.int64)]
        parts += [r.keys.ravel() for r in self._requests.values()]
        return np.concatenate(parts).astype(np.int64, copy=False)

    def forget_keys(self, keys: Iterable[int] | np.ndarray) -> None:
        """``keys`` will name other blocks: drop what the planner remembers of them (re-store
        counts). The caller checked that neither pool holds any of them; one the planner still
        refers to (``referenced_keys``) is a ``ValueError`` and nothing changes, as is a key id
        that is not an int >= 0 (a negative one would wrap to another key's entry)."""
        keys = check_key_ids(keys, "forget_keys")
        held = np.intersect1d(keys, self.referenced_keys())
        if len(held):
            raise ValueError(f"forget_keys: keys {held[:5].tolist()} are still referenced")
        self.selector.forget_keys(keys)
        self._stores.forget_keys(keys)

    # ---- 6. reset ---------------------------------------------------------------------------

    def reset(self) -> bool:
        """Abandon every transfer and forget every request; True if the CPU cache was cleared
        (only possible when no transfer is in flight)."""
        self._stores.reset()
        self._loads.reset()
        self._stores.note_forgotten(list(self._requests))
        self._requests.clear()
        self._running.clear()
        self._lazy.reset()
        if self._stores.has_abandoned() or self._loads.has_abandoned():
            return False
        return self.cpu_pool.reset_prefix_cache()

    # ---- introspection ----------------------------------------------------------------------

    def has_request(self, req_id: str) -> bool:
        return (req_id in self._requests or self._stores.has_state(req_id)
                or self._loads.pending(req_id))

    def has_pending_stores(self) -> bool:
        return self._stores.has_pending()

    def has_pending_work(self) -> bool:
        return self.has_pending_stores() or self._loads.has_pending_work()

    def pending_store_blocks(self) -> int:
        return self._stores.pending_blocks()

    def load_pending(self, req_id: str) -> bool:
        """Whether ``req_id`` still waits for a CPU load."""
        return self._loads.pending(req_id)

    def cursor(self, req_id: str, group: int = 0) -> int:
        return self._stores.cursor(req_id, group)

    def pending_hits(self) -> list[str]:
        """Request ids whose CPU hit is pinned, waiting for ``update_state_after_alloc``."""
        return self._loads.pending_hits()

    def store_events_in_flight(self) -> set[int]:
        """Store events issued and not yet completed or failed (abandoned ones included)."""
        return self._stores.events_in_flight()

    def loads_in_flight(self) -> list[str]:
        """Request ids of the loads issued and not yet reported, once per load (abandoned ones
        included)."""
        return self._loads.in_flight()

    def queued_loads(self) -> dict[str, Transfer]:
        """Loads accepted by ``update_state_after_alloc`` that the next ``build_meta`` issues."""
        return self._loads.queued()

    def queued_flush(self) -> Transfer:
        """The finish flush queued for the next store batch: pinned, not yet issued."""
        return self._stores.queued_flush()

    def held_after_finish(self) -> list[int]:
        """GPU blocks finished requests still reference until their last store completes
        (``PlannerConfig.hold_finished``), one entry per reference."""
        return self._stores.held_blocks()

    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise ``AssertionError`` if the planner's books disagree with each other or with the
        selector's, or the selector's own are broken. With ``idle`` (every request finished and
        every report delivered), also if the planner or selector still hold anything."""
        self.selector.check_invariants(idle=idle)
        self._loads.check_invariants(idle=idle)
        self._stores.check_invariants(self._requests, idle=idle)
        if idle:
            assert not self._requests, f"requests still known: {sorted(self._requests)}"
