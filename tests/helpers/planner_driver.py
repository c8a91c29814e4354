"""A tiny scheduler around ``OffloadPlanner`` for tests: exact control over every step.

It drives the scheduler core the simulator uses (``kvtriton.sim.scheduler.KVScheduler``) call by
call, as a vLLM scheduler drives a connector, and nothing more: a GPU prefix-cache lookup, the
planner's lookup, allocation (null pages for sliding-window blocks already out of the window),
``update_state_after_alloc``, ``build_meta`` before the step's tokens count as computed, caching
of full blocks, optional freeing of sliding-window blocks that left the window, preemption and
resumption, and finish (blocks freed tail first). The test chooses the tokens of every request in
every step, may accept less than a CPU hit, and completes transfers when it says so; the driver
remembers every transfer in flight so that ``check_invariants`` can account for every reference
the planner holds. The functions after the class are scenario steps the planner tests share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtriton.hashing import HashIndex, chain_hashes, request_keys
from kvtriton.planner import OffloadPlanner, PlannerConfig, PlannerMeta, Request
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.sim.scheduler import KVScheduler, SeqBlocks
from kvtriton.specs import FullAttentionSpec, KVLayout, SlidingWindowSpec

LLAMA_TINY = KVLayout([FullAttentionSpec(16, 1, 8, 1)], name="tiny")
# One full-attention group of 32-token blocks hashed every 16 tokens: every block has an alias.
ALIAS_TINY = KVLayout([FullAttentionSpec(32, 1, 8, 1)], hash_block_size=16, name="alias")
# Full attention plus a 40-token sliding window, both with 16-token blocks.
HYBRID_TINY = KVLayout([FullAttentionSpec(16, 1, 8, 1),
                        SlidingWindowSpec(16, 1, 8, 1, sliding_window=40)], name="hybrid")


def tokens_for(prefix: int, n: int) -> list[int]:
    """Deterministic token ids; equal ``prefix`` seeds give equal prefixes."""
    return list(range(prefix * 1_000_003, prefix * 1_000_003 + n))


@dataclass(eq=False)
class Running(SeqBlocks):
    """A scheduled request: ``tables`` is the scheduler's view (NULL where a page was never or
    no longer held), ``cached`` the leading positions already hashed, per group."""

    local: int = 0  # tokens of the GPU prefix hit at admission


@dataclass
class StoreInFlight:
    gpu: list[int]
    cpu: list[int]
    groups: list[int]
    keys: list[tuple[int, ...]]  # every key of each GPU source, as the store will register it
    reports: int = 0


class PlannerDriver:
    """``free_out_of_window``: free sliding-window blocks once they leave the window (vLLM's
    ``remove_skipped_blocks``); the planner keeps their ids, which may then be reused."""

    def __init__(self, layout: KVLayout = LLAMA_TINY, num_gpu_blocks: int = 256,
                 cpu: int | BlockPool = 64, config: PlannerConfig | None = None,
                 free_out_of_window: bool = False) -> None:
        self.layout = layout
        self.index = HashIndex()
        self.gpu = BlockPool(num_gpu_blocks)
        self.planner = OffloadPlanner(layout, self.gpu, cpu, config)
        self.cpu = self.planner.cpu_pool
        self.kv = KVScheduler(layout, self.gpu, self.planner, null_out_of_window=True)
        self.free_out_of_window = free_out_of_window
        self.running: dict[str, Running] = {}
        self.preempted: dict[str, Request] = {}
        self.order: list[str] = []
        self._preempted_now: set[str] = set()
        self.stores: dict[int, StoreInFlight] = {}
        self.loads: dict[int, tuple[list[int], list[int], list[str]]] = {}
        # CPU block -> the keys its last completed store registered (for the invariants).
        self.registered: dict[int, tuple[int, ...]] = {}

    @property
    def G(self) -> int:
        return self.layout.num_groups

    def request(self, rid: str, tokens: list[int], output: int = 0) -> Request:
        """A request whose prompt is ``tokens`` minus the last ``output`` ones (which decode
        steps produce; their keys are known up front)."""
        hashes = chain_hashes(tokens, self.layout.hash_block_size)
        keys = request_keys(self.layout, self.index, hashes)
        return Request(rid, keys, num_prompt_tokens=len(tokens) - output,
                       num_tokens=len(tokens) - output)

    # ---- scheduling -----------------------------------------------------------------------

    def blocks_needed(self, req: Request, num_tokens: int | None = None) -> int:
        """GPU blocks ``req`` holds at ``num_tokens`` tokens (default: its current length)."""
        n = req.num_tokens if num_tokens is None else num_tokens
        return sum(-(-n // g.block_size) for g in self.layout.groups)

    def gpu_hit(self, req: Request):
        """The GPU prefix-cache hit of ``req`` (capped so its last token is recomputed)."""
        return self.kv.gpu_hit(req)

    def admit(self, req: Request, accept: int | None = None,
              ext: int | None = None) -> tuple[int, int]:
        """Schedule a new (or resume a preempted) request: GPU hit, CPU hit (``accept`` caps
        what the scheduler takes; ``ext`` skips the planner's lookup, for a caller that already
        made it), allocation of the blocks holding the hit. Blocks for the tokens still to
        compute are allocated by the steps that schedule them, as vLLM does. Returns
        (gpu_hit_tokens, cpu_tokens_accepted)."""
        rid = req.request_id
        resumed = self.preempted.pop(rid, None) is not None
        hit = self.gpu_hit(req)
        local = hit.num_tokens
        if ext is None:
            ext = self.kv.cpu_hit(req, local)
        if accept is not None:
            ext = min(ext, accept)
        computed = local + ext
        run = Running(req, resumed=resumed, local=local)
        self.kv.install_hit(run, hit)
        self.kv.grow(run, computed, computed=computed)
        self.kv.after_alloc(run, ext)
        req.num_computed_tokens = computed
        self.running[rid] = run
        self.order.append(rid)
        self._cache_full(run, upto=local)
        return local, ext

    def resume(self, rid: str, accept: int | None = None) -> tuple[int, int]:
        return self.admit(self.preempted[rid], accept)

    def _cache_full(self, run: Running, upto: int) -> None:
        """Register ``run``'s blocks full at ``upto`` tokens in the GPU prefix cache."""
        self.kv.cache_full_blocks(run, upto)

    def grow_need(self, rid: str, n: int) -> int:
        """GPU blocks that scheduling ``n`` more tokens of ``rid`` would allocate."""
        run = self.running[rid]
        return sum(self.kv.blocks_needed(run.tables, run.req.num_computed_tokens + n))

    def step(self, scheduled: dict[str, int] | None = None, decode: bool = False,
             **extra) -> PlannerMeta:
        """One step: ``scheduled[rid]`` tokens per request (default: the rest of the prompt, or 1
        when ``decode``; nothing for a request waiting for its CPU load). build_meta sees the
        tokens computed before this step; ``extra`` sets further ``StepOutput`` fields (its
        preempted and resumed ids join the driver's own). Sliding-window blocks out of the
        window are freed after the step when ``free_out_of_window``."""
        if scheduled is None:
            scheduled = {}
            for rid, run in self.running.items():
                if self.planner.load_pending(rid):
                    continue
                left = run.req.num_tokens - run.req.num_computed_tokens
                scheduled[rid] = left if left > 0 else (1 if decode else 0)
        for rid, n in scheduled.items():
            run = self.running[rid]
            req = run.req
            total = req.num_computed_tokens + n
            req.num_tokens = max(req.num_tokens, total)  # decode: the sequence gets longer
            self.kv.grow(run, total)
        preempted, self._preempted_now = self._preempted_now, set()
        step = self.kv.step_output(
            [self.running[rid] for rid in scheduled], dict(scheduled),
            preempted=preempted | extra.pop("preempted_req_ids", set()),
            order=[r for r in self.order if r in scheduled])
        step.resumed_req_ids |= extra.pop("resumed_req_ids", set())
        for name, value in extra.items():
            setattr(step, name, value)
        meta = self.kv.build_meta(step)
        self._record(meta)
        for rid, n in scheduled.items():
            run = self.running[rid]
            if self.planner.load_pending(rid):
                continue
            run.req.num_computed_tokens += n
            self._cache_full(run, run.req.num_computed_tokens)
            if self.free_out_of_window:
                self.kv.drop_unneeded(run)
        return meta

    def _record(self, meta: PlannerMeta) -> None:
        s = meta.store
        if s.event >= 0:
            self.stores[s.event] = StoreInFlight(
                list(s.gpu_blocks), list(s.cpu_blocks), list(s.groups),
                [self.gpu.block_keys(b) for b in s.gpu_blocks])
        ld = meta.load
        if ld.event >= 0:
            self.loads[ld.event] = (list(ld.gpu_blocks), list(ld.cpu_blocks),
                                    list(meta.load_event_to_reqs[ld.event]))

    # ---- completions ------------------------------------------------------------------------

    def complete_stores(self, events, reports: int | None = None, failed=()) -> None:
        """``reports`` worker reports for each event (default: all of ``world_size``)."""
        world = self.planner.config.world_size
        n = world if reports is None else reports
        done = {ev: n for ev in events}
        self.kv.apply_reports(completed_stores=done, failed_stores=list(failed))
        for ev in events:
            st = self.stores[ev]
            st.reports += n
            if st.reports >= world:
                self._store_done(ev)
        for ev in failed:
            st = self.stores.pop(ev)
            for c in st.cpu:
                self.registered.pop(c, None)

    def _store_done(self, ev: int) -> None:
        st = self.stores.pop(ev)
        for c, keys in zip(st.cpu, st.keys, strict=True):
            self.registered[c] = keys

    def complete_loads(self, events, failed: bool = False) -> None:
        rids = [r for ev in events for r in self.loads.pop(ev)[2]]
        if failed:
            self.kv.apply_reports(failed_loads=rids)
        else:
            self.kv.apply_reports(finished_loads=rids)
        for rid in rids:
            run = self.running.get(rid)
            if run is None or self.planner.load_pending(rid):
                continue
            if failed:  # the loaded tokens are recomputed
                run.req.num_computed_tokens = run.local
            self._cache_full(run, run.req.num_computed_tokens)

    def complete(self, meta: PlannerMeta, stores: bool = True, loads: bool = True) -> None:
        if loads and meta.load.event >= 0:
            self.complete_loads([meta.load.event])
        if stores and meta.store.event >= 0:
            self.complete_stores([meta.store.event])

    def complete_all(self) -> None:
        self.complete_loads(list(self.loads))
        self.complete_stores(list(self.stores))

    def abandon_tracking(self) -> None:
        """After ``planner.reset()``: the driver forgets its requests (their GPU blocks are
        freed); transfers in flight stay tracked until completed."""
        for rid in list(self.running):
            self.kv.free_seq_blocks(self.running.pop(rid))
        self.preempted.clear()
        self.order.clear()

    # ---- finish and preemption ----------------------------------------------------------------

    def finish(self, rid: str) -> None:
        if rid in self.preempted:
            self.planner.request_finished(self.preempted.pop(rid))
            return
        run = self.running.pop(rid)
        self.order.remove(rid)
        self.kv.finish(run)

    def preempt(self, rid: str) -> None:
        """Preempt by recompute: blocks freed now, the next step reports it preempted."""
        run = self.running.pop(rid)
        self.order.remove(rid)
        self.kv.preempt(run)
        self.preempted[rid] = run.req
        self._preempted_now.add(rid)

    # ---- inspection -----------------------------------------------------------------------

    def cpu_prefix_blocks(self, req: Request, group: int = 0) -> int:
        """Leading primary keys of ``req``'s group ``group`` present in the CPU pool."""
        n = 0
        for k in self.primary_keys(req, group).tolist():
            if k not in self.cpu:
                break
            n += 1
        return n

    def primary_keys(self, req: Request, group: int = 0) -> np.ndarray:
        r = self.layout.groups[group].block_size // self.layout.hash_block_size
        return req.keys[group, r - 1::r]

    def evict_cpu_key(self, key: int) -> None:
        b = self.cpu.get_cached_block(int(key))
        assert b is not None and self.cpu.evict_cached(b), f"key {key} not evictable"

    def free_cached_cpu_blocks(self) -> list[int]:
        """CPU blocks that are free but still cached, in eviction order."""
        return [b for b in self.cpu.iter_free() if self.cpu.block_hash(b) is not None]

    def check_invariants(self) -> None:
        """Every reference in both pools accounted for (call between steps, with no finish
        flush queued): CPU blocks are held only by stores and loads in flight, GPU blocks by the
        running requests' tables plus those transfers and the finished requests' tables held
        until their stores complete (``hold_finished``); no CPU block is the destination of two
        stores; every CPU key was registered by a completed store of a GPU block holding it."""
        self.gpu.check_invariants()
        self.cpu.check_invariants()
        cpu_ref = [0] * self.cpu.num_blocks
        gpu_ref = [0] * self.gpu.num_blocks
        dests: set[int] = set()
        for st in self.stores.values():
            for c in st.cpu:
                assert c not in dests, f"CPU block {c} is the destination of two stores"
                dests.add(c)
                cpu_ref[c] += 1
            for b in st.gpu:
                gpu_ref[b] += 1
        for gpu, cpu, _ in self.loads.values():
            for c in cpu:
                cpu_ref[c] += 1
            for b in gpu:
                gpu_ref[b] += 1
        for run in self.running.values():
            for table in run.tables:
                for b in table:
                    if b != NULL_BLOCK:
                        gpu_ref[b] += 1
        for b in self.planner.held_after_finish():
            gpu_ref[b] += 1
        assert list(self.cpu.ref_cnt) == cpu_ref, "CPU references not accounted for"
        assert list(self.gpu.ref_cnt) == gpu_ref, "GPU references not accounted for"
        for c in range(1, self.cpu.num_blocks):
            keys = self.cpu.block_keys(c)
            if keys:
                assert keys == self.registered.get(c), (
                    f"CPU block {c} holds {keys}, its last completed store carried "
                    f"{self.registered.get(c)}")


# ---- scenario steps -----------------------------------------------------------------------------

# The two store selectors, which every eager scenario runs on: they must agree exactly.
SCANS = ["fused", "loop"]


def stored_prompt(h: PlannerDriver, rid: str, tokens: list[int], *, complete: bool = True):
    """Admit, prefill and decode one step (which stores the prompt's full blocks)."""
    req = h.request(rid, tokens)
    h.admit(req)
    h.step({rid: req.num_tokens - req.num_computed_tokens})
    meta = h.step({rid: 1})
    if complete:
        h.complete(meta)
    return req, meta


def store_prompt(h: PlannerDriver, rid: str, tokens: list[int]):
    """Admit ``rid``, prefill, decode one step, completing both steps' stores; return the
    request and the GPU blocks stored."""
    req = h.request(rid, tokens)
    h.admit(req)
    stored = []
    for meta in (h.step({rid: req.num_tokens - req.num_computed_tokens}), h.step({rid: 1})):
        stored += meta.store.gpu_blocks
        h.complete(meta)
    return req, stored


def evict_gpu_cache(h: PlannerDriver) -> None:
    """Drop every free cached GPU block (outside pressure on the GPU prefix cache)."""
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)


def cpu_blocks_of(h: PlannerDriver, keys) -> list[int]:
    return [h.cpu.get_cached_block(int(k)) for k in keys]


def lookup(h: PlannerDriver, rid: str, tokens: list[int], computed: int = 0) -> int:
    """CPU hit tokens of a fresh request; its pins are released again."""
    req = h.request(rid, tokens)
    hit, _ = h.planner.get_num_new_matched_tokens(req, computed)
    h.planner.request_finished(req)
    return hit


def pool_snapshot(h: PlannerDriver):
    return (list(h.cpu.ref_cnt), [h.cpu.block_keys(b) for b in range(h.cpu.num_blocks)],
            list(h.gpu.ref_cnt), [h.gpu.block_keys(b) for b in range(h.gpu.num_blocks)])
