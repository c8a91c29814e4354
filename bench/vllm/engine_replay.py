"""One engine run of ``bench.vllm.engine``: a system served by vLLM's ``LLM`` (its connector
configured by ``connector_config``), the workload replayed by time stamp (``replay``), every
step's chunks and each request's prefix hits recorded from the scheduler (``StepRecorder``), and
the system's row of measurements (``run_system``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.vllm.engine_workloads import BLOCK_TOKENS, Size


class StepRecorder:
    """What every engine step computed, and each request's prefix hits at its first admission
    (vLLM's own ``prefill_stats``), from a wrapper around the in-process scheduler's
    ``schedule``; ``replay`` pairs each step's chunks with its measured time."""

    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.hits: dict[str, tuple[int, int]] = {}
        self.chunks: list[tuple[int, int, int]] = []
        self._schedule = scheduler.schedule
        scheduler.schedule = self._record_schedule

    def _record_schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = self._schedule(*args, **kwargs)
        reqs = self.sched.requests
        # vLLM advanced num_computed_tokens when it scheduled them.
        self.chunks += [(n, reqs[rid].num_computed_tokens - n, reqs[rid].num_prompt_tokens)
                        for rid, n in out.num_scheduled_tokens.items()]
        # A request's stats are set when vLLM admits it (its load, if any, then pending) and
        # hold zeros before: one the connector asked vLLM to skip (a lookup not known yet) is
        # read once it was admitted, not while it waits.
        for rid in (*out.num_scheduled_tokens, *self._loading()):
            req = reqs.get(rid)
            if rid not in self.hits and req is not None and req.prefill_stats is not None:
                st = req.prefill_stats
                self.hits[rid] = (st.num_local_cached_tokens, st.num_external_cached_tokens)
        return out

    def _loading(self) -> list[str]:
        """Requests admitted with an asynchronous load (vLLM's WAITING_FOR_REMOTE_KVS)."""
        from vllm.v1.request import RequestStatus

        return [rid for rid, r in self.sched.requests.items()
                if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]

    def take(self) -> list[tuple[int, int, int]]:
        chunks, self.chunks = self.chunks, []
        return chunks


def _percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def _engine_busy(engine: Any, scheduler: Any) -> bool:
    """Whether ``vllm serve`` would step the engine now: its engine core steps while the
    scheduler ``has_requests()``, which counts the connector's pending push work (a lazy tier's
    stores of blocks its last finished request freed, a finish flush) as well as unfinished
    requests. ``LLMEngine.has_unfinished_requests()`` counts only the front end's requests: a
    replay stepping on it alone leaves that work until the next arrival, whose lookup then runs
    before the stores are issued and the CPU evictions they cause, and hits blocks a server would
    have evicted (``lazy+hints`` on ``cc_agentic``: 47.5-50.5% over three runs, 45.4-47.0%
    stepped as a server steps)."""
    return engine.has_unfinished_requests() or scheduler.has_requests()


def replay(engine: Any, recorder: StepRecorder, wl, tokens: dict[str, list[int]],
           hints: bool) -> dict[str, Any]:
    """Serve ``wl`` on ``engine`` by time stamp, as the simulator's clock does: a request
    without a predecessor at its ``arrival_s``, a closed-loop turn ``think_s`` after the turn
    it follows finished. The engine is stepped as ``vllm serve``'s engine core steps it
    (``_engine_busy``): also while its connector has work pending after the last output. Per
    request TTFT (from when it was due to the end of the step that gave its first token); every
    step's chunks with its measured seconds (``engine.step()`` whole: scheduling, the model,
    output processing)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    done: dict[str, float] = {}
    due_at: dict[str, float] = {}
    ttft: dict[str, float] = {}
    steps: list[tuple[list[tuple[int, int, int]], float]] = []
    empty: list[float] = []
    out_tokens = 0
    waiting = sorted(wl, key=lambda r: r.arrival_s)
    t0 = time.perf_counter()
    while waiting or _engine_busy(engine, recorder.sched):
        now = time.perf_counter() - t0
        still, next_due = [], float("inf")
        for r in waiting:
            due = r.arrival_s if r.after is None else (
                done[r.after] + r.think_s if r.after in done else float("inf"))
            if due > now:
                still.append(r)
                next_due = min(next_due, due)
                continue
            extra = {"kv_transfer_params": {"kvtriton_hint": r.hint}} \
                if hints and r.hint is not None else None
            engine.add_request(r.request_id, TokensPrompt(prompt_token_ids=tokens[r.request_id]),
                               SamplingParams(temperature=0, max_tokens=r.output_len,
                                              ignore_eos=True, detokenize=False,
                                              extra_args=extra))
            due_at[r.request_id] = due
        waiting = still
        if not _engine_busy(engine, recorder.sched):
            time.sleep(min(max(next_due - now, 0.0), 0.01))
            continue
        t_step = time.perf_counter()
        outputs = engine.step()
        t = time.perf_counter()
        chunks = recorder.take()
        if chunks:
            steps.append((chunks, t - t_step))
        else:  # a step with only the connector's work (a load issued, stores reported)
            empty.append(t - t_step)
        for o in outputs:
            if o.request_id not in ttft and o.outputs and o.outputs[0].token_ids:
                ttft[o.request_id] = t - t0 - due_at[o.request_id]
            if o.finished:
                done[o.request_id] = t - t0
                out_tokens += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    return {"requests": len(done), "wall_s": wall, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall if wall else None, "ttft": ttft,
            "steps": steps, "steps_without_tokens": len(empty),
            "step_without_tokens_s_mean": float(np.mean(empty)) if empty else None}


def connector_config(system: str, cpu_bytes: int) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` of a system (None: no connector)."""
    if system == "none":
        return None
    if system == "default":
        return {"cpu_bytes_per_rank": cpu_bytes}
    return {"setup": system, "cpu_bytes_per_rank": cpu_bytes}


def run_system(system: str, model: str, wl, tokens: dict, *, gpu_blocks: int, cpu_bytes: int,
               kv_bytes_per_block: int, size: Size, max_model_len: int, dtype: str
               ) -> dict[str, Any]:
    """One engine, one replay: the system's row and its timed steps."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from bench.vllm.engine_run import shutdown_engine

    kv = None
    if system == "simple":
        kv = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes})
    elif (extra := connector_config(system, cpu_bytes)) is not None:
        kv = KVTransferConfig(kv_connector="KVTritonConnector",
                              kv_connector_module_path="kvtriton.vllm", kv_role="kv_both",
                              kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    t0 = time.perf_counter()
    # One block more than asked: vLLM keeps a null block out of the pool.
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True,
              block_size=BLOCK_TOKENS, enable_prefix_caching=True,
              kv_cache_memory_bytes=(gpu_blocks + 1) * kv_bytes_per_block,
              max_model_len=max_model_len, max_num_batched_tokens=size.max_num_batched_tokens,
              max_num_seqs=size.max_num_seqs, seed=0, dtype=dtype, kv_transfer_config=kv)
    startup = time.perf_counter() - t0
    core = llm.llm_engine.engine_core.engine_core
    conn = core.scheduler.connector
    try:
        rec = StepRecorder(core.scheduler)
        res = replay(llm.llm_engine, rec, wl, tokens, hints=kv is not None)
        steps = res.pop("steps")
        prompt = sum(r.prompt_len for r in wl)
        gpu_hit = sum(h[0] for h in rec.hits.values())
        cpu_hit = sum(h[1] for h in rec.hits.values())
        res_ttft = res.pop("ttft")
        ttft = list(res_ttft.values())
        row: dict[str, Any] = {
            "system": system, "startup_s": startup, **res,
            "engine_gpu_blocks": core.scheduler.kv_cache_manager.block_pool.num_gpu_blocks - 1,
            "prompt_tokens": prompt, "gpu_hit_tokens": gpu_hit, "cpu_hit_tokens": cpu_hit,
            "token_hit_rate": (gpu_hit + cpu_hit) / prompt,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p90_s": _percentile(ttft, 90),
            "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
            "ttft_by_request_s": {rid: round(t, 6) for rid, t in sorted(res_ttft.items())},
            "stored_blocks": 0, "loaded_blocks": 0, "cpu_blocks": 0}
        if conn is not None and hasattr(conn, "scheduler_side"):
            planner = conn.scheduler_side.planner
            st = planner.stats.as_dict()
            row.update(stored_blocks=st["blocks_stored"], loaded_blocks=st["blocks_loaded"],
                       cpu_blocks=planner.cpu_pool.num_blocks - 1,
                       setup=conn.scheduler_side.config.setup)
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            row["transfers"] = get_kv_transfer_group().worker_side.transfer_totals()
        row["_steps"] = steps
    finally:
        shutdown_engine(llm)
    return row
