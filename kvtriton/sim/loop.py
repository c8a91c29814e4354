"""A serving loop close to vLLM's scheduler, driving ``OffloadPlanner`` as vLLM drives a connector.

Per step: running requests first (decode, or the next chunk of a prefill), then waiting ones in
arrival order while the token budget, the GPU blocks and ``max_running`` allow. A new request is
looked up in the GPU prefix cache, then in the CPU tier; a CPU hit allocates its blocks and waits
for the load (asynchronous, as in vLLM: it is computed from the next step on). When the GPU runs
out of blocks the newest running request is preempted (recompute: its blocks are freed and it
starts over). ``build_meta`` is called before the step's tokens count as computed; stores and
loads complete after their modeled transfer time on a per-direction link, and reach the planner
at the first step boundary after that. Finished requests free their blocks tail first.

Time is modeled (``kvtriton.sim.cost``), except the planner's own cost, which is measured.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtriton.lookup import find_longest_hit
from kvtriton.planner import OffloadPlanner, PlannerMeta, Request, StepOutput
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.sim.cost import CostModel
from kvtriton.sim.integrity import IntegrityChecker
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.setups import TierPolicy
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import KVLayout

__all__ = ["ServingLoop"]


@dataclass(slots=True, eq=False)
class _Seq:
    wr: WorkloadRequest
    req: Request
    arrival_s: float
    tables: list[list[int]]
    cached: list[int]
    new: list[list[int]]
    first_token_s: float | None = None
    output_done: int = 0
    admitted_once: bool = False
    resumed: bool = False
    pending_ext: int = 0
    handoffs: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Link:
    """One direction of the host link: transfers queue behind each other."""

    free_at: float = 0.0
    bytes: int = 0

    def submit(self, now: float, nbytes: int, seconds: float) -> float:
        start = max(now, self.free_at)
        self.free_at = start + seconds
        self.bytes += nbytes
        return self.free_at


class ServingLoop:
    """One simulation of one workload under one tier policy; ``run()`` returns its metrics."""

    def __init__(self, workload: Workload, keys: list[np.ndarray], layout: KVLayout,
                 policy: TierPolicy, cost: CostModel, *, gpu_blocks: int, cpu_blocks: int,
                 token_budget: int = 8192, max_running: int = 256,
                 integrity: IntegrityChecker | None = None,
                 progress: Callable[[int, int], None] | None = None) -> None:
        self.workload = workload
        self.layout = layout
        self.policy = policy
        self.cost = cost
        self.token_budget = token_budget
        self.max_running = max_running
        self.progress = progress
        self.gpu = BlockPool(gpu_blocks + 1)
        self.planner: OffloadPlanner | None = None
        if policy.planner is not None:
            cpu = BlockPool(cpu_blocks + 1, eviction=policy.cpu_eviction, medium="CPU")
            self.planner = OffloadPlanner(layout, self.gpu, cpu, policy.planner)
        self.integrity = integrity
        if integrity is not None:
            integrity.attach(self.gpu)
        self.metrics = RunMetrics(policy=policy.name)
        self._seqs: dict[str, _Seq] = {}
        self._keys = keys
        self._successors: dict[str, list[int]] = {}
        self._arrivals: list[tuple[float, int]] = []
        for i, wr in enumerate(workload.requests):
            if wr.after is None:
                self._arrivals.append((wr.arrival_s, i))
            else:
                self._successors.setdefault(wr.after, []).append(i)
        heapq.heapify(self._arrivals)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._loading: dict[str, _Seq] = {}
        self._completions: list[tuple[float, int, str, int, list[str]]] = []
        self._seq_no = 0
        self._finished_last: set[str] = set()
        self._d2h, self._h2d = _Link(), _Link()
        self._ever_cached = np.zeros(0, dtype=bool)
        self._ratio = [g.block_size // layout.hash_block_size for g in layout.groups]
        self.now = 0.0
        self.step_no = 0

    # ---- arrivals and lookups -----------------------------------------------------------------

    def _arrive(self, i: int, at: float) -> None:
        wr = self.workload.requests[i]
        keys = self._keys[i]
        req = Request(wr.request_id, keys, num_prompt_tokens=wr.prompt_len,
                      num_tokens=wr.prompt_len)
        G = self.layout.num_groups
        seq = _Seq(wr, req, at, [[] for _ in range(G)], [0] * G, [[] for _ in range(G)])
        self._seqs[wr.request_id] = seq
        self._waiting.append(seq)

    def _admit_arrivals(self) -> None:
        while self._arrivals and self._arrivals[0][0] <= self.now:
            at, i = heapq.heappop(self._arrivals)
            wr = self.workload.requests[i]
            # Like a server rejecting a prompt longer than its context: it can never run.
            if sum(-(-wr.total_len // g.block_size) for g in self.layout.groups) \
                    > self.gpu.num_blocks - 1:
                self.metrics.rejected += 1
                self._release_successors(wr.request_id)
                continue
            self._arrive(i, at)

    def _primary(self, seq: _Seq, g: int, pos: int) -> int | None:
        j = (pos + 1) * self._ratio[g] - 1
        return int(seq.req.keys[g, j]) if j < seq.req.keys.shape[1] else None

    # ---- allocation -----------------------------------------------------------------------------

    def _blocks_needed_from(self, tables, tokens: int) -> list[int]:
        return [max(0, -(-tokens // g.block_size) - len(t))
                for g, t in zip(self.layout.groups, tables, strict=True)]

    def _grow(self, seq: _Seq, tokens: int) -> bool:
        need = self._blocks_needed_from(seq.tables, tokens)
        if sum(need) > self.gpu.num_free_blocks:
            return False
        for g, n in enumerate(need):
            if n:
                blocks = self.gpu.get_new_blocks(n)
                seq.tables[g] += blocks
                seq.new[g] += blocks
        return True

    def _free_seq_blocks(self, seq: _Seq) -> None:
        for table in seq.tables:
            live = [b for b in reversed(table) if b != NULL_BLOCK]
            if live:
                self.gpu.free_blocks(live)
        G = self.layout.num_groups
        seq.tables = [[] for _ in range(G)]
        seq.new = [[] for _ in range(G)]
        seq.cached = [0] * G

    def _preempt(self, seq: _Seq, preempted: set[str]) -> None:
        self._running.remove(seq)
        self._free_seq_blocks(seq)
        seq.req.num_computed_tokens = 0
        seq.handoffs.clear()
        seq.resumed = True
        preempted.add(seq.wr.request_id)
        self._waiting.appendleft(seq)
        self.metrics.preemptions += 1

    def _try_admit(self, seq: _Seq, budget: int) -> int | None:
        """Schedule a waiting request; returns tokens scheduled (0 while its load runs) or None
        if it does not fit."""
        req = seq.req
        cap = req.num_tokens - 1
        keys = req.keys[:, :min(req.keys.shape[1], req.num_tokens // self.layout.hash_block_size)]
        hit = find_longest_hit(self.layout, self.gpu, keys.tolist(), cap)
        local = hit.num_tokens
        hit_blocks = [b for grp in hit.blocks for b in grp if b != NULL_BLOCK]
        # Even one more token must fit, whatever the CPU offers: skip the CPU lookup otherwise.
        if sum(self._blocks_needed_from(hit.blocks, local + 1)) > self.gpu.num_free_blocks:
            return None
        ext = 0
        t0 = time.perf_counter()
        if self.planner is not None:
            ext, _ = self.planner.get_num_new_matched_tokens(req, local)
        self.metrics.planner_s += time.perf_counter() - t0
        target = local + ext if ext else local + min(req.num_tokens - local, budget)
        reserve = sum(self._blocks_needed_from(hit.blocks, target))
        free = self.gpu.num_free_blocks
        # Touching a free cached hit block takes it out of the free count too.
        if reserve > free - len(hit_blocks) and \
                reserve > free - sum(map(self.gpu.is_free, hit_blocks)):
            return None
        self.gpu.touch(hit_blocks)
        for g, blocks in enumerate(hit.blocks):
            seq.tables[g] = list(blocks)
            seq.new[g] = list(blocks)
            seq.cached[g] = len(blocks)
        self._grow(seq, target)
        t0 = time.perf_counter()
        if self.planner is not None:
            self.planner.update_state_after_alloc(req, tuple(seq.tables), ext)
        self.metrics.planner_s += time.perf_counter() - t0
        req.num_computed_tokens = local
        m = self.metrics
        if not seq.admitted_once:
            seq.admitted_once = True
            m.prompt_tokens += seq.wr.prompt_len
            m.gpu_hit_tokens += local
            m.cpu_hit_tokens += ext
        if ext:
            seq.pending_ext = ext
            self._loading[req.request_id] = seq
            return 0
        self._running.append(seq)
        return target - local

    # ---- one step -------------------------------------------------------------------------------

    def _schedule(self) -> tuple[dict[str, int], set[str]]:
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        preempted: set[str] = set()
        for seq in list(self._running):
            if seq.wr.request_id in preempted or budget <= 0:
                continue
            req = seq.req
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._grow(seq, req.num_computed_tokens + n):
                victim = self._running[-1]
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            if seq.wr.request_id in preempted:
                continue
            scheduled[req.request_id] = n
            budget -= n
        if not preempted:
            while self._waiting and budget > 0 and len(self._running) < self.max_running:
                seq = self._waiting[0]
                n = self._try_admit(seq, budget)
                if n is None:
                    break
                self._waiting.popleft()
                if n:
                    scheduled[seq.req.request_id] = n
                    budget -= n
        return scheduled, preempted

    def _step_output(self, scheduled: dict[str, int], preempted: set[str]) -> StepOutput:
        new_ids, resumed, handoffs = {}, set(), {}
        for seq in self._seqs.values():
            rid = seq.wr.request_id
            if any(seq.new):
                new_ids[rid] = tuple(seq.new)
                seq.new = [[] for _ in seq.new]
                if seq.resumed:
                    resumed.add(rid)
                    seq.resumed = False
            if seq.handoffs:
                handoffs[rid] = seq.handoffs
                seq.handoffs = []
        finished, self._finished_last = self._finished_last, set()
        return StepOutput(num_scheduled_tokens=scheduled, new_block_ids=new_ids,
                          preempted_req_ids=preempted, resumed_req_ids=resumed,
                          finished_req_ids=finished, boundary_handoffs=handoffs,
                          order=list(scheduled))

    def _transfer_bytes(self, groups: list[int]) -> int:
        per = self.layout.group_block_bytes
        return sum(per[g] for g in groups)

    def _submit_transfers(self, meta: PlannerMeta) -> None:
        if len(meta.store):
            nbytes = self._transfer_bytes(meta.store.groups)
            done = self._d2h.submit(self.now, nbytes, self.cost.d2h_s(nbytes))
            self._push_completion(done, "store", meta.store.event, [])
        if len(meta.load):
            nbytes = self._transfer_bytes(meta.load.groups)
            done = self._h2d.submit(self.now, nbytes, self.cost.h2d_s(nbytes))
            self._push_completion(done, "load", meta.load.event,
                                  meta.load_event_to_reqs[meta.load.event])
        if self.integrity is not None:
            self.integrity.execute(meta)

    def _push_completion(self, at: float, kind: str, event: int, reqs: list[str]) -> None:
        self._seq_no += 1
        heapq.heappush(self._completions, (at, self._seq_no, kind, event, reqs))

    def _compute(self, scheduled: dict[str, int]) -> float:
        cost = self.cost
        seconds = cost.step_overhead_s
        decode_ctx = []
        for rid, n in scheduled.items():
            req = self._seqs[rid].req
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode_ctx.append(req.num_computed_tokens)
            else:
                seconds += cost.prefill_s(n, req.num_computed_tokens)
        if decode_ctx:
            seconds += cost.decode_step_s(decode_ctx)
        return seconds

    def _advance(self, scheduled: dict[str, int]) -> None:
        m = self.metrics
        for rid, n in scheduled.items():
            seq = self._seqs[rid]
            req = seq.req
            if req.num_computed_tokens < req.num_prompt_tokens:
                m.prefill_tokens += n
            req.num_computed_tokens += n
            self._cache_blocks(seq)
            if req.num_computed_tokens == req.num_tokens:  # a new token is sampled
                seq.output_done += 1
                if seq.first_token_s is None:
                    seq.first_token_s = self.now
                    m.ttft_s.append(self.now - seq.arrival_s)
                if seq.output_done >= max(1, seq.wr.output_len):
                    self._finish(seq)
                else:
                    req.num_tokens += 1

    def _cache_blocks(self, seq: _Seq, computed_here: bool = True) -> None:
        """Register newly full blocks in the GPU prefix cache; drop what a group no longer
        needs (sliding-window pages left behind, Mamba states before the last one).
        ``computed_here``: False for blocks that came from a CPU load (not recomputed, and their
        bytes already arrived)."""
        req, gpu = seq.req, self.gpu
        computed = req.num_computed_tokens
        for g, spec in enumerate(self.layout.groups):
            table, r = seq.tables[g], self._ratio[g]
            full = min(computed // spec.block_size, len(table), req.keys.shape[1] // r)
            for pos in range(seq.cached[g], full):
                b = table[pos]
                if b != NULL_BLOCK and gpu.block_hash(b) is None:
                    keys = req.keys[g, pos * r:(pos + 1) * r].tolist()
                    if computed_here:
                        self._note_computed(keys[-1], spec.block_size)
                        if self.integrity is not None:
                            self.integrity.fill(g, b, keys[-1])
                    gpu.cache_block(b, keys[-1], keys[:-1])
                    if spec.kind == "mamba":
                        seq.handoffs.append(((pos + 1) * spec.block_size, b, g))
            seq.cached[g] = max(seq.cached[g], full)
            if spec.kind == "sliding_window":
                keep_from = max(0, computed - spec.sliding_window + 1) // spec.block_size
            elif spec.kind == "mamba":
                keep_from = max(0, full - 1)
            else:
                continue
            drop = [table[p] for p in range(min(keep_from, len(table))) if table[p] != NULL_BLOCK]
            if drop:
                for p in range(min(keep_from, len(table))):
                    table[p] = NULL_BLOCK
                gpu.free_blocks(drop[::-1])

    def _note_computed(self, key: int, tokens: int) -> None:
        if key >= len(self._ever_cached):
            grown = np.zeros(max(key + 1, 2 * len(self._ever_cached)), dtype=bool)
            grown[:len(self._ever_cached)] = self._ever_cached
            self._ever_cached = grown
        if self._ever_cached[key]:
            self.metrics.recomputed_tokens += tokens
        self._ever_cached[key] = True

    def _finish(self, seq: _Seq) -> None:
        rid = seq.wr.request_id
        self._running.remove(seq)
        t0 = time.perf_counter()
        if self.planner is not None:
            self.planner.request_finished(seq.req)
        self.metrics.planner_s += time.perf_counter() - t0
        self._free_seq_blocks(seq)
        self._finished_last.add(rid)
        del self._seqs[rid]
        self.metrics.finished += 1
        self._release_successors(rid)

    def _release_successors(self, rid: str) -> None:
        for i in self._successors.pop(rid, []):
            heapq.heappush(self._arrivals, (self.now + self.workload.requests[i].think_s, i))

    def _deliver(self) -> None:
        loads, stores = [], {}
        while self._completions and self._completions[0][0] <= self.now:
            _, _, kind, event, reqs = heapq.heappop(self._completions)
            if kind == "store":
                stores[event] = self.planner.config.world_size
            else:
                loads += reqs
        if not loads and not stores:
            return
        if self.integrity is not None:
            for rid in loads:
                seq = self._loading[rid]
                self.integrity.check_load(self, seq, self.step_no)
        t0 = time.perf_counter()
        self.planner.update_connector_output(finished_loads=loads, completed_stores=stores)
        self.metrics.planner_s += time.perf_counter() - t0
        for rid in loads:
            seq = self._loading.pop(rid)
            seq.req.num_computed_tokens += seq.pending_ext
            seq.pending_ext = 0
            self._cache_blocks(seq, computed_here=False)
            self._running.append(seq)

    def _next_event_time(self) -> float:
        times = []
        if self._arrivals:
            times.append(self._arrivals[0][0])
        if self._completions:
            times.append(self._completions[0][0])
        return min(times) if times else math.inf

    def step(self) -> bool:
        """Run one scheduler step; False when everything is done."""
        self._admit_arrivals()
        scheduled, preempted = self._schedule()
        step = self._step_output(scheduled, preempted)
        meta = None
        if self.planner is not None:
            t0 = time.perf_counter()
            meta = self.planner.build_meta(step)
            dt = time.perf_counter() - t0
            self.metrics.planner_s += dt
            self.metrics.build_meta_ms.append(dt * 1e3)
            self._submit_transfers(meta)
        if scheduled:
            self.now += self._compute(scheduled)
            self._advance(scheduled)
            self.metrics.steps += 1
        else:
            nxt = self._next_event_time()
            if math.isinf(nxt):
                return bool(self._waiting or self._running or self._loading)
            self.now = max(self.now, nxt)
        if self.planner is not None:
            self._deliver()
        self.step_no += 1
        return bool(self._arrivals or self._waiting or self._running or self._loading
                    or self._completions)

    def run(self) -> RunMetrics:
        t0 = time.perf_counter()
        total = len(self.workload)
        while self.step():
            if self.progress is not None and self.step_no % 256 == 0:
                self.progress(self.metrics.finished, total)
        if self.planner is not None:
            while self._completions:  # drain so both pools end all-free
                self.now = self._completions[0][0]
                self._deliver()
        m = self.metrics
        m.wall_s = time.perf_counter() - t0
        m.makespan_s = self.now
        m.requests = total
        m.bytes_d2h, m.bytes_h2d = self._d2h.bytes, self._h2d.bytes
        if self.planner is not None:
            m.planner = self.planner.stats.as_dict()
            m.planner["running_evictions"] = self.planner.selector.running_evictions
        if self.progress is not None:
            self.progress(m.finished, total)
        return m
