"""The serving loop on vLLM's real scheduler: ``simulate(..., engine="vllm")``, the
``--engine vllm`` of ``kvtriton simulate``.

The same workloads (``kvtriton.sim.Workload``), setups, cost model and clock
(``kvtriton.sim.clock.ServingClock``) as kvtriton's ``ServingLoop``, but every scheduling
decision is made by vLLM's own ``Scheduler`` (admission, chunked prefill, preemption, prefix
caching in vLLM's ``BlockPool``) with ``KVTritonConnector`` as its connector (no connector for
``none``). No model runs: a step's duration is the cost model's prefill and decode time of
what vLLM scheduled, transfers complete after the cost model's time on one link per direction,
and the tokens vLLM "samples" are the workload's own output tokens.

Workloads carry chain hashes, not tokens, so each hashed block gets tokens derived from its hash
(equal hashes, equal tokens, hence equal vLLM hashes, as the workload means); the unhashed tail of
a request gets tokens of its own. Rows have the shape of ``kvtriton.simulate(...).rows``
(``RunMetrics.summary()``), counted the same way: hits at a request's first admission, prefill
tokens of chunks that start in the prompt, recompute of blocks computed again after they were
cached once.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtriton.setups import TierSetup
from kvtriton.sim.clock import ServingClock
from kvtriton.sim.cost import ServingCost
from kvtriton.sim.metrics import RunMetrics
from kvtriton.sim.workload import Workload, WorkloadRequest, causal_sessions
from kvtriton.specs import KVLayout
from kvtriton.vllm.config import extra_config_for
from kvtriton.vllm.releases import HINT_KEY, SESSION_KEY

__all__ = ["VllmLoop"]

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


class VllmLoop(ServingClock):
    """One workload under one setup through vLLM's scheduler; ``run()`` returns its metrics.
    ``model_dir``: a model folder vLLM's configs read (``tiny_model_dir``); no model runs."""

    def __init__(self, workload: Workload, layout: KVLayout, setup: TierSetup,
                 cost: ServingCost, *, gpu_blocks: int, cpu_blocks: int, token_budget: int,
                 max_running: int, model_dir: str, max_model_len: int,
                 progress: Any = None,
                 scheduler_overrides: dict[str, Any] | None = None,
                 sync_load_budget_bytes: int = 0) -> None:
        from kvtriton.sim.vllm_scheduler import make_scheduler

        super().__init__(workload, layout, cost, RunMetrics(setup=setup.name),
                         gpu_blocks=gpu_blocks, progress=progress)
        self.setup = setup
        connector = setup.planner is not None
        extra = extra_config_for(setup) if connector else None
        if extra is not None and sync_load_budget_bytes:
            extra["sync_load_budget_bytes"] = sync_load_budget_bytes
        self.scheduler = make_scheduler(
            model_dir, list(layout.groups), num_gpu_blocks=gpu_blocks + 1,
            kv_connector="KVTritonConnector" if connector else None,
            kv_connector_module_path="kvtriton.vllm" if connector else None,
            extra_config=extra,
            cpu_blocks=cpu_blocks if connector else None, max_num_seqs=max_running,
            max_num_batched_tokens=token_budget, max_model_len=max_model_len,
            scheduler_overrides=scheduler_overrides)
        self.side = self.scheduler.connector.scheduler_side if connector else None
        if connector:
            _time_connector_calls(self.scheduler.connector, self.metrics)
            self.side.signals.clock = lambda: self.now  # sessions age by modeled time
        self._session_of = causal_sessions(workload) if setup.sessions else []
        self.tokens = _TokenSource(workload.hash_block_size)
        self._live: dict[str, tuple[WorkloadRequest, list[int], float]] = {}
        self._first_token: set[str] = set()
        self._admitted: set[str] = set()
        self._ever_computed: set[tuple[int, int]] = set()
        self._ratio = [g.block_size // workload.hash_block_size for g in layout.groups]

    # ---- arrivals and admission --------------------------------------------------------------

    def _admit_arrivals(self) -> None:
        from kvtriton.sim.vllm_scheduler import vllm_request

        for at, i, wr in self._due_arrivals():
            seq = self.tokens.sequence(wr)
            self._live[wr.request_id] = (wr, seq, at)
            req = vllm_request(wr.request_id, seq[:wr.prompt_len], max(1, wr.output_len),
                               self.workload.hash_block_size, arrival_time=at)
            # As a server passes them: the request's kv_transfer_params (kvtriton.vllm.releases).
            params = {}
            if wr.hint is not None:
                params[HINT_KEY] = wr.hint
            if self._session_of:
                params[SESSION_KEY] = self._session_of[i]
            if params:
                req.kv_transfer_params = params
            self.scheduler.add_request(req)

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
            local = ext = 0
            if stats is not None:
                local, ext = stats.num_local_cached_tokens, stats.num_external_cached_tokens
                m.gpu_hit_tokens += local
                m.cpu_hit_tokens += ext
            m.tokens_by_request[rid] = (wr.prompt_len, local, ext)
            m.queue_by_request[rid] = self.now - self._live[rid][2]

    # ---- one step ----------------------------------------------------------------------------

    def _chunks(self, so: Any):
        """The step's chunks as ``ServingClock._step_seconds`` takes them; also counts prefill
        and recomputed tokens."""
        m = self.metrics
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            before = req.num_computed_tokens - n  # vLLM advanced it when scheduling
            if before < req.num_prompt_tokens:
                m.prefill_tokens += n
            self._note_computed(rid, before, before + n)
            yield n, before, req.num_prompt_tokens

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

    def _output(self, so: Any, loads: list[str], stores: dict[int, int],
                sync_event: int = -1) -> Any:
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
                self.metrics.ttft_by_request[rid] = self.now - self._live[rid][2]
        # A same-step load landed before the step's compute: reported with its output.
        sync = {sync_event: self.world_size} if sync_event >= 0 else {}
        kv = KVConnectorOutput(
            finished_recving=_CompletionOrderSet(loads) or None,
            kv_connector_worker_meta=KVTritonWorkerMetadata(stores, completed_sync_loads=sync)
            if stores or sync else None)
        return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv)

    def step(self) -> bool:
        """One scheduler step; False when everything is done. Taken only when vLLM's engine
        core takes one: while the scheduler ``has_requests()`` (a request unfinished or
        finished since the last step, or the connector's push work pending); an idle engine
        schedules nothing until the next arrival, so it runs no ``build_connector_meta`` (where
        a lazy tier walks the GPU free queue and stores)."""
        s = self.scheduler
        self._admit_arrivals()
        if not s.has_requests() and not self._completions:
            return self._wait_for_next_event(False, 0)
        so = s.schedule()
        self.metrics.preemptions += len(so.preempted_req_ids or ())
        meta = so.kv_connector_metadata
        ready, sync_event = self.now, -1
        if meta is not None:
            ready = self._submit_sync_load(meta.sync_load)
            if len(meta.sync_load):
                sync_event = meta.sync_load.event
                self.metrics.sync_loads += len(meta.sync_load_reqs)
            self._submit_transfers(meta)
        self._note_admissions(so)
        if so.total_num_scheduled_tokens:
            # The step's compute starts once its same-step loads landed.
            self.now = max(self.now, ready) + self._step_seconds(self._chunks(so))
            self.metrics.steps += 1
        elif so.preempted_req_ids:
            pass  # a step that only preempted: the next one schedules into the room it freed
        elif not self._wait_for_next_event(s.has_requests(), s.get_num_unfinished_requests()):
            return False
        loads, stores = self._due_reports()
        finished_before = set(self._live)
        s.update_from_output(so, self._output(so, loads, stores, sync_event))
        for rid in finished_before - set(s.requests):
            self._finish(rid)
        return bool(self._pending() or s.has_requests())

    def _finish(self, rid: str) -> None:
        self._live.pop(rid)
        self.metrics.finished += 1
        self._release_successors(rid)

    def _end_run(self) -> None:
        if self.side is not None:
            m = self.metrics
            m.planner = self.side.planner.stats.as_dict()
            m.planner["running_evictions"] = self.side.planner.selector.running_evictions
            m.planner["key_collisions"] = self.side.keys.collisions
            m.planner["protect_overflow"] = self.side.signals.protect_overflow
            m.planner["sessions_expired"] = self.side.signals.counters["sessions_expired"]
