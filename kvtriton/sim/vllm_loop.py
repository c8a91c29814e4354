"""The simulator on vLLM's real scheduler: ``simulate_vllm``, the ``--engine vllm`` of
``kvtriton simulate``.

The same workloads (``kvtriton.sim.Workload``), policies and cost model as ``kvtriton.simulate``,
but every scheduling decision is made by vLLM's own ``Scheduler`` (admission, chunked prefill,
preemption, prefix caching in vLLM's ``BlockPool``) with ``KVTritonConnector`` as its connector
(no connector for ``no_cpu``). No model runs: a step's duration is the cost model's prefill and
decode time of what vLLM scheduled, transfers complete after the cost model's time on one link
per direction, and the tokens vLLM "samples" are the workload's own output tokens.

Workloads carry chain hashes, not tokens, so each hashed block gets tokens derived from its hash
(equal hashes, equal tokens, hence equal vLLM hashes, as the workload means); the unhashed tail of
a request gets tokens of its own. Rows have the shape of ``kvtriton.simulate(...).rows``
(``RunMetrics.summary()``), counted the same way: hits at a request's first admission, prefill
tokens of chunks that start in the prompt, recompute of blocks computed again after they were
cached once.
"""

from __future__ import annotations

import heapq
import os
import tempfile
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtriton.sim.cost import CostModel
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.progress import Progress
from kvtriton.sim.setups import DEFAULT_POLICIES, TierPolicy, tier_policy
from kvtriton.sim.simulate import (
    GiB,
    SimulationResult,
    add_gap_closed,
    belady_bound,
    cost_conditions,
    tier_blocks,
)
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import KVLayout, preset

__all__ = ["simulate_vllm"]

_VOCAB = 30000  # token ids drawn from [1, _VOCAB): within the tiny model's vocabulary


class _TokenSource:
    """Tokens for a workload request: each hashed block's from its hash, the tail's own."""

    def __init__(self, block_size: int) -> None:
        self.b = block_size
        self._blocks: dict[int, np.ndarray] = {}

    def _block(self, h: int) -> np.ndarray:
        t = self._blocks.get(h)
        if t is None:
            t = np.random.default_rng(h).integers(1, _VOCAB, self.b)
            self._blocks[h] = t
        return t

    def sequence(self, wr: WorkloadRequest) -> list[int]:
        """Prompt then output tokens (at least one output token, as the loop always samples)."""
        n = wr.prompt_len + max(1, wr.output_len)
        parts = [self._block(int(h)) for h in wr.hashes.tolist()]
        tail = n - len(parts) * self.b
        if tail > 0:
            seed = zlib.crc32(wr.request_id.encode())
            parts.append(np.random.default_rng(seed).integers(1, _VOCAB, tail))
        return np.concatenate(parts)[:n].tolist() if parts else []


@dataclass(slots=True)
class _Link:
    """One direction of the host link: transfers queue behind each other (as ServingLoop's)."""

    free_at: float = 0.0
    bytes: int = 0

    def submit(self, now: float, nbytes: int, seconds: float) -> float:
        self.free_at = max(now, self.free_at) + seconds
        self.bytes += nbytes
        return self.free_at


class _CompletionOrderSet(set):
    """A set of request ids that iterates in the order given: ``finished_recving`` for vLLM,
    which types it a set, in the order the loads completed. The connector hands the ids to the
    planner in iteration order, which frees the loaded CPU blocks back into the CPU queue in
    that order; a plain set would iterate in string-hash order, making the CPU tier's eviction
    order (and every figure after it) depend on PYTHONHASHSEED. ServingLoop hands the planner
    the same ids in the same completion order. Not to be mutated (the order would go stale)."""

    def __init__(self, items: Sequence[str] = ()) -> None:
        order = list(dict.fromkeys(items))
        super().__init__(order)
        self._order = order

    def __iter__(self):
        return iter(self._order)


def _extra_config(policy: TierPolicy) -> dict[str, Any]:
    p = policy.planner
    return {"restore": p.restore, "cpu_free_order": p.cpu_free_order,
            "cpu_eviction": policy.cpu_eviction, "restore_share": p.restore_share,
            "max_restores_per_step": p.max_restores_per_step,
            "max_restores_per_key": p.max_restores_per_key, "scan": p.scan,
            "scan_idle": p.scan_idle, "offload": "lazy" if p.lazy else "eager",
            "lazy_target_blocks": p.lazy_target_blocks}


_TIMED_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                "build_connector_meta", "update_connector_output", "request_finished",
                "request_finished_all_groups")


def _time_connector_calls(connector: Any, metrics: RunMetrics) -> None:
    """Charge the wall time of the connector's scheduler calls to ``metrics.planner_s`` (and
    each ``build_connector_meta`` to ``build_meta_ms``), as ServingLoop times the planner."""
    for name in _TIMED_CALLS:
        real = getattr(connector, name)

        def timed(*args, _real=real, _name=name, **kw):
            t0 = time.perf_counter()
            out = _real(*args, **kw)
            dt = time.perf_counter() - t0
            metrics.planner_s += dt
            if _name == "build_connector_meta":
                metrics.build_meta_ms.append(dt * 1e3)
            return out

        setattr(connector, name, timed)


class _VllmRun:
    """One workload under one policy through vLLM's scheduler."""

    def __init__(self, workload: Workload, layout: KVLayout, policy: TierPolicy,
                 cost: CostModel, *, gpu_blocks: int, cpu_blocks: int, token_budget: int,
                 max_running: int, model_dir: str, max_model_len: int,
                 progress: Progress | None,
                 scheduler_overrides: dict[str, Any] | None = None) -> None:
        from kvtriton.vllm.harness import make_scheduler

        self.workload, self.layout, self.policy, self.cost = workload, layout, policy, cost
        self.progress = progress
        self.metrics = RunMetrics(policy=policy.name)
        connector = policy.planner is not None
        self.scheduler = make_scheduler(
            model_dir, list(layout.groups), num_gpu_blocks=gpu_blocks + 1,
            kv_connector="KVTritonConnector" if connector else None,
            kv_connector_module_path="kvtriton.vllm" if connector else None,
            extra_config=_extra_config(policy) if connector else None,
            cpu_blocks=cpu_blocks if connector else None, max_num_seqs=max_running,
            max_num_batched_tokens=token_budget, max_model_len=max_model_len,
            scheduler_overrides=scheduler_overrides)
        self.side = self.scheduler.connector.scheduler_side if connector else None
        if connector:
            _time_connector_calls(self.scheduler.connector, self.metrics)
        self.world_size = 1
        self.gpu_blocks = gpu_blocks
        self.tokens = _TokenSource(workload.hash_block_size)
        self._arrivals, self._successors = workload.arrival_queue()
        self._live: dict[str, tuple[WorkloadRequest, list[int], float]] = {}
        self._first_token: set[str] = set()
        self._admitted: set[str] = set()
        self._completions: list[tuple[float, int, str, int, list[str]]] = []
        self._seq = 0
        self._d2h, self._h2d = _Link(), _Link()
        self._ever_computed: set[tuple[int, int]] = set()
        self._ratio = [g.block_size // workload.hash_block_size for g in layout.groups]
        self.now = 0.0

    # ---- arrivals and admission --------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        from kvtriton.vllm.harness import vllm_request

        while self._arrivals and self._arrivals[0][0] <= self.now:
            at, i = heapq.heappop(self._arrivals)
            wr = self.workload.requests[i]
            # As ServingLoop: a request larger than the whole GPU pool can never run.
            if sum(-(-wr.total_len // g.block_size) for g in self.layout.groups) \
                    > self.gpu_blocks:
                self.metrics.rejected += 1
                self._release_successors(wr.request_id)
                continue
            seq = self.tokens.sequence(wr)
            self._live[wr.request_id] = (wr, seq, at)
            self.scheduler.add_request(vllm_request(
                wr.request_id, seq[:wr.prompt_len], max(1, wr.output_len),
                self.workload.hash_block_size, arrival_time=at))

    def _release_successors(self, rid: str) -> None:
        for i in self._successors.pop(rid, []):
            heapq.heappush(self._arrivals, (self.now + self.workload.requests[i].think_s, i))

    def _note_admissions(self, so: Any) -> None:
        """Hits of each request at its first admission (vLLM's own per-request prefill stats)."""
        new = [r.req_id for r in so.scheduled_new_reqs]
        meta = so.kv_connector_metadata
        if meta is not None and meta.load.event >= 0:
            new += meta.load_event_to_reqs[meta.load.event]
        m = self.metrics
        for rid in new:
            if rid in self._admitted:
                continue
            self._admitted.add(rid)
            wr = self._live[rid][0]
            stats = self.scheduler.requests[rid].prefill_stats
            m.prompt_tokens += wr.prompt_len
            if stats is not None:
                m.gpu_hit_tokens += stats.num_local_cached_tokens
                m.cpu_hit_tokens += stats.num_external_cached_tokens

    # ---- one step ----------------------------------------------------------------------------

    def _submit(self, meta: Any) -> None:
        per = self.layout.group_block_bytes
        if len(meta.store):
            nbytes = sum(per[g] for g in meta.store.groups)
            done = self._d2h.submit(self.now, nbytes, self.cost.d2h_s(nbytes))
            self._push(done, "store", meta.store.event, [])
        if len(meta.load):
            nbytes = sum(per[g] for g in meta.load.groups)
            done = self._h2d.submit(self.now, nbytes, self.cost.h2d_s(nbytes))
            self._push(done, "load", meta.load.event, meta.load_event_to_reqs[meta.load.event])

    def _push(self, at: float, kind: str, event: int, reqs: list[str]) -> None:
        self._seq += 1
        heapq.heappush(self._completions, (at, self._seq, kind, event, reqs))

    def _compute(self, so: Any) -> float:
        """The step's modeled seconds, as ServingLoop models them; also counts prefill and
        recomputed tokens."""
        cost, m = self.cost, self.metrics
        seconds = cost.step_overhead_s
        decode_ctx = []
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            before = req.num_computed_tokens - n  # vLLM advanced it when scheduling
            if n == 1 and before >= req.num_prompt_tokens:
                decode_ctx.append(before)
            else:
                seconds += cost.prefill_s(n, before)
            if before < req.num_prompt_tokens:
                m.prefill_tokens += n
            self._note_computed(rid, before, before + n)
        if decode_ctx:
            seconds += cost.decode_step_s(decode_ctx)
        return seconds

    def _note_computed(self, rid: str, start: int, end: int) -> None:
        """Blocks the model completed in [start, end): a block computed before is recompute."""
        hashes = self._live[rid][0].hashes
        for g, spec in enumerate(self.layout.groups):
            bs, r = spec.block_size, self._ratio[g]
            for pos in range(start // bs, min(end // bs, len(hashes) // r)):
                key = (g, int(hashes[(pos + 1) * r - 1]))
                if key in self._ever_computed:
                    self.metrics.recomputed_tokens += bs
                else:
                    self._ever_computed.add(key)

    def _reports(self) -> tuple[list[str], dict[int, int]]:
        loads, stores = [], {}
        while self._completions and self._completions[0][0] <= self.now:
            _, _, kind, event, reqs = heapq.heappop(self._completions)
            if kind == "store":
                stores[event] = self.world_size
            else:
                loads += reqs
        return loads, stores

    def _output(self, so: Any, loads: list[str], stores: dict[int, int]) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        from kvtriton.vllm.metadata import KVTritonWorkerMetadata

        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = self.scheduler.requests[rid]
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])  # mid-prefill: nothing sampled
                continue
            sampled.append([self._live[rid][1][req.num_tokens]])
            if rid not in self._first_token:
                self._first_token.add(rid)
                self.metrics.ttft_s.append(self.now - self._live[rid][2])
        kv = KVConnectorOutput(
            finished_recving=_CompletionOrderSet(loads) or None,
            kv_connector_worker_meta=KVTritonWorkerMetadata(stores) if stores else None)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv)

    def step(self) -> bool:
        """One scheduler step; False when everything is done."""
        s = self.scheduler
        self._admit_arrivals()
        so = s.schedule()
        self.metrics.preemptions += len(so.preempted_req_ids or ())
        if so.kv_connector_metadata is not None:
            self._submit(so.kv_connector_metadata)
        self._note_admissions(so)
        if so.total_num_scheduled_tokens:
            self.now += self._compute(so)
            self.metrics.steps += 1
        else:
            times = [t[0] for t in self._arrivals[:1]] + [c[0] for c in self._completions[:1]]
            if not times:
                if s.has_requests():
                    raise RuntimeError(f"{self.policy.name}: {s.get_num_unfinished_requests()} "
                                       "requests left with nothing to schedule or complete")
                return False
            self.now = max(self.now, min(times))
        loads, stores = self._reports()
        finished_before = set(self._live)
        s.update_from_output(so, self._output(so, loads, stores))
        for rid in finished_before - set(s.requests):
            self._finish(rid)
        return bool(self._arrivals or s.has_requests() or self._completions)

    def _finish(self, rid: str) -> None:
        self._live.pop(rid)
        self.metrics.finished += 1
        self._release_successors(rid)

    def run(self) -> RunMetrics:
        t0 = time.perf_counter()
        total = len(self.workload)
        n = 0
        while self.step():
            n += 1
            if self.progress is not None and n % 256 == 0:
                self.progress(self.metrics.finished, total)
        m = self.metrics
        m.wall_s = time.perf_counter() - t0
        m.makespan_s = self.now
        m.requests = total
        m.bytes_d2h, m.bytes_h2d = self._d2h.bytes, self._h2d.bytes
        if self.side is not None:
            m.planner = self.side.planner.stats.as_dict()
            m.planner["running_evictions"] = self.side.planner.selector.running_evictions
            m.planner["key_collisions"] = self.side.keys.collisions
        if self.progress is not None:
            self.progress(m.finished, total)
        return m


def simulate_vllm(
    workload: Workload,
    *,
    model: str = "llama3-8b",
    gpu: str = "H100",
    gpu_blocks: int | None = None,
    gpu_tokens: int | None = None,
    gpu_gib: float | None = None,
    cpu_blocks: int | None = None,
    cpu_tokens: int | None = None,
    cpu_gib: float | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    token_budget: int = 8192,
    max_running: int = 256,
    integrity: bool = False,
    integrity_backend: str = "torch",
    bound: bool = True,
    progress: bool = False,
    scheduler_overrides: dict[str, Any] | None = None,
) -> SimulationResult:
    """``kvtriton.simulate`` with vLLM's ``Scheduler`` instead of ``ServingLoop``: the same
    arguments, defaults and result (``rows`` of ``RunMetrics.summary()``, ``conditions`` with
    ``"engine": "vllm"``). ``integrity`` is not available here (no bytes move) and raises;
    ``integrity_backend`` is accepted for the same call shape. ``scheduler_overrides``: vLLM
    ``SchedulerConfig`` fields to change from vLLM's defaults (e.g.
    ``{"scheduler_reserve_full_isl": False}``). Needs vLLM; groups must be full attention or
    sliding window (no Mamba preset)."""
    if integrity:
        raise ValueError("simulate_vllm: integrity checks need real bytes; use the kvtriton "
                         "engine (ServingLoop) for --integrity")
    del integrity_backend
    if not isinstance(token_budget, int) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if not isinstance(max_running, int) or not 1 <= max_running <= token_budget:
        raise ValueError(f"max_running must be an int in [1, token_budget], got {max_running!r}")
    if not len(workload):
        raise ValueError(f"workload {workload.name!r} has no requests")
    chosen = [tier_policy(p) for p in policies]
    for pol in chosen:
        if pol.planner is not None and (pol.oracle or pol.hints or pol.lookahead
                                        or pol.planner.admission != "all"
                                        or pol.planner.refresh_on_gpu_hit):
            raise ValueError(f"simulate_vllm: policy {pol.name!r} uses an axis the connector "
                             "does not take (next-use oracle, unbounded tier, hints, "
                             "waiting-queue lookahead, second-sight or hinted admission, "
                             "refresh): run it with kvtriton's loop")
    layout = preset(model, block_size=workload.hash_block_size)
    if any(g.kind == "mamba" for g in layout.groups):
        raise ValueError(f"simulate_vllm: model {model!r} has Mamba groups, which this "
                         "simulator's vLLM setup does not build")
    cost = CostModel.named(model, gpu)
    n_gpu, n_cpu = tier_blocks(layout, gpu_blocks=gpu_blocks, gpu_tokens=gpu_tokens,
                               gpu_gib=gpu_gib, cpu_blocks=cpu_blocks, cpu_tokens=cpu_tokens,
                               cpu_gib=cpu_gib)
    max_len = max(r.prompt_len + max(1, r.output_len) for r in workload) + 1
    max_model_len = -(-max_len // layout.scheduler_block_size) * layout.scheduler_block_size
    conditions = {
        "engine": "vllm", "model": model, "gpu": gpu, "layout": layout.describe(),
        "gpu_blocks": n_gpu, "cpu_blocks": n_cpu,
        "gpu_gib": n_gpu * layout.cpu_block_bytes / GiB,
        "cpu_gib": n_cpu * layout.cpu_block_bytes / GiB,
        "block_tokens": layout.groups[0].block_size, "token_budget": token_budget,
        "max_running": max_running, "integrity": False, "requests": len(workload),
        "scheduler_overrides": dict(scheduler_overrides or {}),
        "cost_model": cost_conditions(cost),
    }
    import vllm

    conditions["vllm"] = vllm.__version__
    result = SimulationResult(workload.name, conditions)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="kvtriton-vllm-sim-") as tmp:
        from kvtriton.vllm.harness import tiny_model_dir

        model_dir = str(tiny_model_dir(tmp, max_model_len))
        for pol in chosen:
            run = _VllmRun(workload, layout, pol, cost, gpu_blocks=n_gpu, cpu_blocks=n_cpu,
                           token_budget=token_budget, max_running=max_running,
                           model_dir=model_dir, max_model_len=max_model_len,
                           progress=Progress(f"{pol.name:>20s} (vllm)", enabled=progress),
                           scheduler_overrides=scheduler_overrides)
            row = run.run().summary()
            row["composition"], row["oracle"] = pol.composition, pol.oracle
            row["cpu_blocks"] = n_cpu if pol.planner is not None else 0
            result.rows.append(row)
    # The in-loop oracles need kvtriton's own loop; gap_closed is set where a control ran.
    add_gap_closed(result.rows, [])
    if bound:
        result.bound = belady_bound(workload, layout, n_gpu, n_cpu, rejected=set())
    return result
