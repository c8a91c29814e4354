"""The scheduler role of ``KVTritonConnector``: vLLM's scheduler calls, adapted to the planner.

vLLM's ``Scheduler``, ``BlockPool`` and ``Request`` are the truth; this adapter translates:

- the GPU pool: ``VllmGpuPool``, a view of vLLM's pool (hash state, ref counts, free queue) with
  the insert/evict events the planner listens to;
- keys: vLLM's ``BlockHashWithGroupId`` bytes interned as dense ids (``KeyIds``); an admitted
  request's not-yet-hashed positions get reserved ids (``RequestMirror``), bound as vLLM hashes
  them, because the planner takes a request's keys once, at admission;
- the step: vLLM's ``SchedulerOutput`` as a ``StepOutput`` (new and cached requests' new
  blocks, preempted and resumed requests, Mamba boundary hand-offs, vLLM's scan order);
- completions: ``KVConnectorOutput`` (finished and failed loads, invalid blocks, the workers'
  aggregated store reports) as the planner's ``update_connector_output``;
- memory: key ids nothing refers to any more (in neither pool, no request, no transfer, no
  pending event) are recycled by a sweep that runs when the bound ids have doubled since the
  last one, so the ids, and every array the planner indexes by them, stay within about twice
  what the pools and the running requests hold however many distinct blocks a server sees.

The CPU tier is kvtriton's own ``BlockPool`` under the setup's eviction queue (any of
``kvtriton.eviction``'s, with the protected segments of hints, sessions or the lookahead:
``kvtriton.tier_signals.cpu_queue``), sized as vLLM sizes its own.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvtriton.planner import OffloadPlanner, StepOutput
from kvtriton.sync_loads import SyncLoadBudget, SyncLoadsInFlight, split_sync_loads
from kvtriton.vllm.config import ConnectorConfig
from kvtriton.vllm.gpu_pool import VllmGpuPool
from kvtriton.vllm.keys import KeyIds, group_suffixes
from kvtriton.vllm.layout import cpu_blocks_for_bytes, layout_from_vllm
from kvtriton.vllm.metadata import KVTritonMetadata, KVTritonWorkerMetadata
from kvtriton.vllm.requests import RequestMirror, lookup_request
from kvtriton.vllm.signals import TierSignals
from kvtriton.vllm.stats import KVTritonStats, counter_deltas

__all__ = ["SchedulerSide"]

logger = logging.getLogger(__name__)


class SchedulerSide:
    """The planner, its CPU pool and the adapter state for one vLLM scheduler."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: ConnectorConfig) -> None:
        self.config = config
        self.layout, self.scheduler_block_size = layout_from_vllm(vllm_config, kv_cache_config)
        pc = vllm_config.parallel_config
        if getattr(pc, "decode_context_parallel_size", 1) > 1:
            raise ValueError("KVTritonConnector: decode context parallelism "
                             f"(decode_context_parallel_size={pc.decode_context_parallel_size})"
                             " is not supported; use 1")
        self.world_size = pc.world_size
        if config.sync_load_budget_bytes and self.layout.num_groups > 1:
            raise ValueError(
                "KVTritonConnector: kv_connector_extra_config['sync_load_budget_bytes'] = "
                f"{config.sync_load_budget_bytes} needs a model with one KV cache group, this "
                f"one has {self.layout.num_groups}: vLLM recomputes a failed same-step load only "
                "by block ids, which repeat across groups; set it to 0")
        # Same-step loads: the budget, and per load event the requests of its same-step part
        # until every worker reported it ([completed, failed] reports).
        self.sync_budget = SyncLoadBudget(self.layout, config.sync_load_budget_bytes)
        self._sync_in_flight = SyncLoadsInFlight(self.world_size)
        self.sync_stats = {"sync_loads": 0, "sync_load_bytes": 0}
        self.num_cpu_blocks = cpu_blocks_for_bytes(kv_cache_config, config.cpu_bytes_per_rank)
        self.max_model_len = vllm_config.model_config.max_model_len
        ev = vllm_config.kv_events_config
        self.events_enabled = bool(ev is not None and ev.enable_kv_cache_events)
        self.planner_config = config.planner_config(
            world_size=self.world_size,
            max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens)
        self.keys = KeyIds()
        self._suffixes = group_suffixes(self.layout.num_groups)
        self.signals = TierSignals(config.tier, self.keys, self._suffixes)
        # Block 0 is null here as in vLLM's pools: the tier holds num_cpu_blocks - 1 blocks.
        self.cpu_pool = self.signals.cpu_pool(self.num_cpu_blocks,
                                              enable_events=self.events_enabled)
        self._events = None
        if self.events_enabled:
            from kvtriton.vllm.events import KVEventTranslator

            self._events = KVEventTranslator(self.keys, kv_cache_config.kv_cache_groups)
        self.gpu_pool: VllmGpuPool | None = None
        self.planner: OffloadPlanner | None = None
        self.store = None  # the second tier's fetches (kvtriton.second_tier.fetches)
        if config.second_tier is not None:
            from kvtriton.vllm.store_tier import scheduler_fetches

            self.store = scheduler_fetches(config.second_tier, vllm_config, self.layout,
                                           self.cpu_pool, self.keys.hash_of)
        self._mirrors: dict[str, RequestMirror] = {}
        self._preemptions: dict[str, int] = {}  # rid -> vLLM's num_preemptions at its mirror
        self._retired: list[RequestMirror] = []  # rows released by the next build_meta
        self._lookups: dict[str, tuple[int, Any]] = {}  # rid -> (hashes, lookup Request)
        self._known: set[str] = set()  # request ids the planner has seen since the last reset
        self._load_blocks: dict[str, set[int]] = {}  # rid -> GPU blocks of its issued load
        self._stats_before: dict[str, Any] = {}
        self._sweep_at = 0  # bound key ids that trigger the next sweep (set at bind)
        self.sweeps = 0
        #: Sweep for unreferenced key ids by itself (off only as a soak's control run).
        self.auto_recycle = True
        logger.info("KVTritonConnector: %d CPU blocks per rank (%s), world_size %d, layout %s",
                    self.num_cpu_blocks - 1, config.describe(self.num_cpu_blocks), self.world_size,
                    self.layout.describe())

    # ---- binding -------------------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Wrap vLLM's GPU pool and build the planner on it (before anything is cached)."""
        if self.planner is not None:
            raise RuntimeError("KVTritonConnector: a GPU block pool is already bound")
        self.gpu_pool = VllmGpuPool(gpu_block_pool, self.keys, before_cache=self._before_cache)
        self.planner = OffloadPlanner(self.layout, self.gpu_pool, self.cpu_pool,
                                      self.planner_config)
        # Below this many ids a sweep would find little to recycle: the pools alone can hold
        # one primary key per block and group.
        self._min_sweep = 2 * (self.gpu_pool.num_blocks + self.num_cpu_blocks) \
            * self.layout.num_groups
        self._sweep_at = self._min_sweep

    def _planner(self) -> OffloadPlanner:
        if self.planner is None:
            raise RuntimeError("KVTritonConnector: no GPU block pool bound yet "
                               "(vLLM calls bind_gpu_block_pool after building its cache)")
        return self.planner

    def _before_cache(self, vreq: Any) -> None:
        m = self._mirrors.get(vreq.request_id)
        if m is not None and m.vreq is vreq:
            m.bind()

    def _max_tokens(self, vreq: Any) -> int:
        limit = vreq.num_prompt_tokens + getattr(vreq, "max_tokens", 0)
        return max(vreq.num_tokens, min(limit, self.max_model_len))

    # ---- 0. arrival ----------------------------------------------------------------------------

    def on_new_request(self, vreq: Any) -> None:
        """``vreq`` joined the waiting queue (the lookahead protects its keys; the second tier
        asks the store about its prefix now, off the step that will look it up)."""
        self.signals.arrived(vreq)
        if self.store is not None and not getattr(vreq, "skip_reading_prefix_cache", False):
            req = lookup_request(vreq, self.keys, self._suffixes)
            self._lookups[vreq.request_id] = (len(vreq.block_hashes), req)
            self.store.prefetch(vreq.request_id, req.keys.ravel().tolist())

    # ---- 1. lookup -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, vreq: Any, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        planner = self._planner()
        if getattr(vreq, "skip_reading_prefix_cache", False):
            return 0, False
        rid = vreq.request_id
        if self.store is not None and self.store.still_waiting(rid):
            return None, False  # for the store: nothing to look up again until it answers
        if rid in self._sync_in_flight:
            return None, False  # its same-step load is not reported yet (one load at a time)
        if rid in self._preemptions and self._preemptions[rid] != vreq.num_preemptions:
            # Preempted before a step said so (a reset that preempts every running request).
            planner.preempted(rid)
        cached = self._lookups.get(rid)
        n = len(vreq.block_hashes)
        if cached is not None and cached[0] == n:
            req = cached[1]
            req.num_tokens = vreq.num_tokens
            req.num_computed_tokens = vreq.num_computed_tokens
        else:
            req = lookup_request(vreq, self.keys, self._suffixes)
            self._lookups[rid] = (n, req)
        self._known.add(rid)
        hit, is_async = planner.get_num_new_matched_tokens(req, num_computed_tokens)
        if self.store is not None and self.store.extend(req, num_computed_tokens, hit):
            return None, False  # vLLM asks again next step, once the fetch has landed
        if self.sync_budget.reserve(rid, num_computed_tokens, hit, vreq.num_tokens):
            return hit, False  # loaded before this step's forward pass, computed in it
        return hit, is_async

    # ---- 2. after allocation -------------------------------------------------------------------

    def update_state_after_alloc(self, vreq: Any, blocks: Any, num_external_tokens: int) -> None:
        planner = self._planner()
        rid = vreq.request_id
        m = self._mirrors.get(rid)
        if m is not None and self._preemptions.get(rid) != vreq.num_preemptions:
            # Preempted since: its old row goes at the next build_meta, its ids with it.
            self._retired.append(m)
            m = None
        if m is None:
            m = RequestMirror(vreq, self.keys, self._suffixes, self._max_tokens(vreq),
                              self.layout.hash_block_size)
            self._mirrors[rid] = m
            self._preemptions[rid] = vreq.num_preemptions
        else:
            m.vreq = vreq
            m.refresh()
        self._lookups.pop(rid, None)
        self._known.add(rid)
        if not num_external_tokens:
            self.sync_budget.release(rid)
        planner.update_state_after_alloc(m.req, tuple(blocks.get_block_ids()),
                                         num_external_tokens)
        self.signals.admitted(rid, m.req.keys[:, :m.bound])

    # ---- 3. per step ---------------------------------------------------------------------------

    def _step_output(self, so: Any) -> StepOutput:
        new_ids: dict[str, tuple[list[int], ...]] = {}
        order: list[str] = []
        resumed: set[str] = set()
        for r in so.scheduled_new_reqs:
            new_ids[r.req_id] = tuple(r.block_ids)
            order.append(r.req_id)
            if self._preemptions.get(r.req_id, 0):
                resumed.add(r.req_id)  # a preempted request coming back as new request data
        cached = so.scheduled_cached_reqs
        order += cached.req_ids
        if len(cached.req_ids) != len(cached.new_block_ids):
            raise ValueError(f"KVTritonConnector: {len(cached.req_ids)} cached requests, "
                             f"{len(cached.new_block_ids)} new block lists")
        # vLLM's entries are tuples of lists already (None: no new block this step).
        new_ids.update(zip(cached.req_ids, cached.new_block_ids, strict=True))
        if None in cached.new_block_ids:
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=True):
                if ids is None:
                    del new_ids[rid]
        resumed |= set(cached.resumed_req_ids)
        handoffs: dict[str, list[tuple[int, int, int]]] = {}
        state = so.kv_connector_block_state
        if state is not None:
            for rid, entries in state.boundary_state_offloads.items():
                handoffs[rid] = [(tokens, block, g) for g, block, tokens in entries]
        return StepOutput(num_scheduled_tokens=dict(so.num_scheduled_tokens),
                          new_block_ids=new_ids,
                          preempted_req_ids=set(so.preempted_req_ids or ()),
                          resumed_req_ids=resumed,
                          finished_req_ids=set(so.finished_req_ids),
                          boundary_handoffs=handoffs, order=order)

    def build_connector_meta(self, so: Any) -> KVTritonMetadata:
        planner = self._planner()
        self.signals.tick()
        step = self._step_output(so)
        for rid in step.preempted_req_ids:
            m = self._mirrors.get(rid)
            if m is not None and self._preemptions.get(rid) != m.vreq.num_preemptions:
                del self._mirrors[rid]
                self._retired.append(m)
        # A scheduled request's new hashes were bound as vLLM cached their blocks in this
        # step's allocation (``_before_cache``); one the step skipped may hold hashes made
        # since (a token it produced last step): bound here, before any later lookup interns
        # them. Touching only those keeps a step from reading every running request's objects.
        mirrors = self._mirrors
        for rid in mirrors.keys() - so.num_scheduled_tokens.keys():
            mirrors[rid].refresh()
        queued = planner.queued_loads()
        meta = planner.build_meta(step)
        for rid, t in queued.items():
            self._load_blocks[rid] = set(t.gpu_blocks)
        # The planner released these rows in build_meta (preemption): no key of theirs is held.
        for m in self._retired:
            m.release()
        self._retired.clear()
        if self._events is not None and len(meta.store):
            self._remember_payloads(meta.store.gpu_blocks, self._mirrors.values())
        if self.auto_recycle and self.keys.num_bound >= self._sweep_at:
            self.recycle_keys()
        sync = [rid for rid in self.sync_budget.reserved if rid in queued]
        self.sync_budget.new_step()
        meta, now = split_sync_loads(meta, queued, sync)
        out = KVTritonMetadata.from_planner(meta)
        if sync:
            out.sync_load, out.sync_load_reqs = now, sync
            self._sync_in_flight.issued(now.event, sync)
            per = self.layout.group_block_bytes
            self.sync_stats["sync_loads"] += len(sync)
            self.sync_stats["sync_load_bytes"] += sum(per[g] for g in now.groups)
        if self.store is not None:
            out.store_hashes = self.gpu_pool.block_hash_bytes(meta.store.gpu_blocks)
            hash_of = self.keys.hash_of
            out.fetches = [(f.event, f.cpu, f.groups, [hash_of(k) for k in f.keys])
                           for f in self.store.issue()]
        return out

    def recycle_keys(self) -> int:
        """Recycle the bound key ids nothing refers to; returns how many. Runs by itself when
        the bound ids reach twice what the last sweep left (amortized O(1) per id)."""
        planner, keys = self._planner(), self.keys
        live = np.zeros(keys.capacity, dtype=bool)
        live[planner.referenced_keys()] = True
        live[np.asarray(self.cpu_pool.referenced_keys(), dtype=np.int64)] = True
        live[np.asarray(self.gpu_pool.referenced_keys(), dtype=np.int64)] = True
        if self._events is not None:
            live[np.asarray(self._events.referenced_keys(), dtype=np.int64)] = True
        for m in [*self._mirrors.values(), *self._retired]:
            live[m.req.keys.ravel()] = True
        for _, req in self._lookups.values():
            live[req.keys.ravel()] = True
        for held in self.signals.referenced_keys():
            live[held] = True
        if self.store is not None:
            live[np.asarray(self.store.referenced_keys(), dtype=np.int64)] = True
        bound = keys.bound_ids()
        dead = bound[~live[bound]]
        if len(dead):
            planner.forget_keys(dead)
            self.signals.forget(dead)
            keys.recycle(dead)
        self.sweeps += 1
        self._sweep_at = max(2 * keys.num_bound, self._min_sweep)
        return len(dead)

    def _remember_payloads(self, gpu_blocks: list[int], mirrors: Any) -> None:
        """BlockStored payloads (parent hash, tokens, LoRA) of the stores of ``gpu_blocks``
        that are positions of ``mirrors``' requests, captured while the requests are at hand."""
        from kvtriton.vllm.events import StorePayload

        gpu = self.gpu_pool
        wanted = {k for k in map(gpu.block_hash, gpu_blocks) if k is not None}
        if not wanted:
            return
        want = np.fromiter(wanted, dtype=np.int64, count=len(wanted))
        hbs = self.layout.hash_block_size
        for m in mirrors:
            v = m.vreq
            lora = getattr(v, "lora_request", None)
            for g, spec in enumerate(self.layout.groups):
                r = spec.block_size // hbs
                primaries = m.req.keys[g, r - 1:m.bound:r]
                for pos in np.flatnonzero(np.isin(primaries, want)).tolist():
                    start = pos * spec.block_size
                    self._events.remember(int(primaries[pos]), StorePayload(
                        v.block_hashes[pos * r - 1] if pos else None,
                        list(v.all_token_ids[start:start + spec.block_size]),
                        None if lora is None else lora.adapter_id,
                        None if lora is None else lora.name, None))

    # ---- 4. completions ------------------------------------------------------------------------

    def update_connector_output(self, out: Any) -> None:
        planner = self._planner()
        # vLLM's own order: completed loads rejoin the CPU tier's LRU queue in it.
        finished = list(out.finished_recving or ())
        failed = set(out.failed_recving or ()) & set(finished)
        bad = set(out.invalid_block_ids or ())
        if bad:
            failed |= {rid for rid in finished if self._load_blocks.get(rid, set()) & bad}
        done_stores: dict[int, int] = {}
        failed_stores: list[int] = []
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KVTritonWorkerMetadata):
            done_stores = dict(wm.completed_store_events)
            failed_stores = list(wm.failed_store_events)
            if self.store is not None and wm.fetch_reports:
                self.store.apply(wm.fetch_reports, wm.fetch_failed, self.world_size)
        elif wm is not None:
            raise TypeError(f"KVTritonConnector: worker metadata of type {type(wm).__name__}")
        if isinstance(wm, KVTritonWorkerMetadata):
            landed, broken = self._sync_landed(wm)
            finished += landed + broken
            failed |= set(broken)
        for rid in finished:
            self._load_blocks.pop(rid, None)
        planner.update_connector_output(finished_loads=[r for r in finished if r not in failed],
                                        completed_stores=done_stores,
                                        failed_stores=failed_stores,
                                        failed_loads=[r for r in finished if r in failed])

    def _sync_landed(self, wm: KVTritonWorkerMetadata) -> tuple[list[str], list[str]]:
        """The requests whose same-step loads every worker has now reported: those that landed
        everywhere, and those that failed on some worker (``SyncLoadsInFlight.reported``)."""
        return self._sync_in_flight.reported(wm.completed_sync_loads, wm.failed_sync_loads)

    # ---- 5. finish -----------------------------------------------------------------------------

    def request_finished(self, vreq: Any, block_ids: tuple[list[int], ...] | None = None
                         ) -> tuple[bool, None]:
        """Queue the flush of ``vreq``'s unstored confirmed blocks (``block_ids``: its GPU table
        per group now, as vLLM hands it over); GPU blocks may be freed now (pinned ones stay
        referenced until their transfer completes)."""
        planner = self._planner()
        rid = vreq.request_id
        if self.store is not None:
            self.store.forget(rid)
        m = self._mirrors.pop(rid, None)
        lookup = self._lookups.pop(rid, None)
        self._preemptions.pop(rid, None)
        req = None
        if m is not None:
            m.vreq = vreq
            m.refresh()
            req = m.req
        elif lookup is not None:
            req = lookup[1]
        hint = self.signals.finished(vreq, None if req is None else (
            req.keys[:, :m.bound] if m is not None else req.keys))
        if rid in self._known:
            self._known.discard(rid)
            if req is None:
                req = lookup_request(vreq, self.keys, self._suffixes)
            planner.request_finished(req, block_ids, hint=hint)
            if self._events is not None and m is not None:
                self._remember_payloads(planner.queued_flush().gpu_blocks, [m])
        if m is not None:
            m.release()
        return False, None

    # ---- 6. reset ------------------------------------------------------------------------------

    def reset(self) -> bool:
        """Abandon transfers, forget requests; True if the CPU cache was cleared."""
        if self.store is not None:
            self.store.reset()
        ok = self._planner().reset()
        for m in [*self._mirrors.values(), *self._retired]:
            m.release()
        self._mirrors.clear()
        self._retired.clear()
        self._preemptions.clear()
        self._lookups.clear()
        self._known.clear()
        self.sync_budget.new_step()
        return ok

    # ---- events, stats, state ------------------------------------------------------------------

    def take_events(self) -> list:
        events = self.cpu_pool.take_events()
        if self._events is None or not events:
            return []
        return self._events.translate(events)

    def shutdown(self) -> None:
        """The engine stops: the second tier's client leaves its master."""
        if self.store is not None:
            self.store.close()

    def has_pending_stores(self) -> bool:
        return self.planner is not None and (
            self.planner.has_pending_stores()
            or (self.store is not None and self.store.has_pending()))

    def get_stats(self) -> KVTritonStats | None:
        """The counters since the last call (non-zero ones) and the gauges now."""
        if self.planner is None:
            return None
        now = self.counters()
        data = counter_deltas(now, self._stats_before)
        self._stats_before = now
        data.update(self.gauges())
        return KVTritonStats(data=data)

    def counters(self) -> dict[str, int | float]:
        """Every counter so far, by ``kvtriton.vllm.stats.STATS`` name."""
        now = dict(self._planner().stats.as_dict())
        now["key_collisions"] = self.keys.collisions
        now["key_ids_recycled"] = self.keys.recycled
        now.update(self.signals.counters)
        now.update(self.signals.claim_counters())
        now["protect_overflow"] = self.signals.protect_overflow
        now.update(self.sync_stats)
        if self.store is not None:
            now.update(self.store.stats)
            now.update(self.store.faults.as_stats())
        return now

    def gauges(self) -> dict[str, int]:
        """The tier now, by ``kvtriton.vllm.stats.GAUGES`` name (``STATS`` says what each
        counts)."""
        return {"cpu_cached_blocks": self.cpu_pool.num_cached_blocks,
                "cpu_blocks_pinned_by_transfers": self.cpu_pool.num_used_blocks,
                "pending_store_blocks": self._planner().pending_store_blocks(),
                "key_ids_bound": self.keys.num_bound,
                "live_sessions": self.signals.live_sessions}
