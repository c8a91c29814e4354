"""Two replicas sharing the store beside one replica serving both, in vLLM's engine on CPU.

The workload is the cc_agentic sample as ``bench.vllm.engine`` replays it (its sessions' turns,
64-token blocks, prompt tokens drawn from the trace's block hashes). A *router* sends each
session's first half of turns to replica A and the rest to replica B, so B's prompts extend
prefixes only A computed. Four ways to serve B's half:

- ``one_replica``: one engine with the store serves A's half, then B's half (every prefix its
  own): the reference of the target, the same tiers without a second replica;
- ``shared_store``: A's engine, then a fresh engine as B, both with the second tier on one
  master (B's own caches start empty; the store holds what A wrote through);
- ``one_replica_cpu`` and ``no_store``: the same two without a store (the CPU tier alone),
  what a fleet has without one.

The store is emptied before each way, so each starts from nothing.

Each half is served turn by turn (turn t of every session in one batch, one output token: the
batch's wall time is its time to first tokens). The hit rate of B's half is vLLM's own count of
prompt tokens served from a prefix cache (the GPU's and the connector's) over its prompt tokens.
The cost of a scheduler step with the tier on and off is timed apart, on the same work
(``step_cost``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.vllm.engine_replay import StepRecorder
from bench.vllm.engine_run import _drain, _llm_kwargs, shutdown_engine
from bench.vllm.engine_workloads import BLOCK_TOKENS, QUICK, engine_workload, prompt_tokens

_TIMED = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
          "update_connector_output", "request_finished")


def split_by_router(wl) -> tuple[list[list[str]], list[list[str]]]:
    """Request ids of A's and B's halves, as batches by turn index."""
    by_session: dict[str, list[str]] = {}
    for r in wl:
        by_session.setdefault(r.session, []).append(r.request_id)
    a: dict[int, list[str]] = {}
    b: dict[int, list[str]] = {}
    for rids in by_session.values():
        half = max(1, len(rids) // 2)
        for t, rid in enumerate(rids):
            (a if t < half else b).setdefault(t, []).append(rid)
    return [a[t] for t in sorted(a)], [b[t] for t in sorted(b)]


class _Timer:
    """Seconds of vLLM's scheduler (``add_request``, where the connector asks the store ahead,
    ``schedule`` and ``update_from_output``, the connector's scheduler side inside them) and
    of the connector's own calls; steps counted."""

    def __init__(self, side: Any, scheduler: Any) -> None:
        self.seconds = {"scheduler": 0.0, "connector": 0.0}
        self.steps = 0
        for name in _TIMED:
            setattr(side, name, self._wrap(getattr(side, name), "connector"))
        scheduler.update_from_output = self._wrap(scheduler.update_from_output, "scheduler")
        scheduler.add_request = self._wrap(scheduler.add_request, "scheduler")
        side.on_new_request = self._wrap(side.on_new_request, "connector")
        schedule = self._wrap(scheduler.schedule, "scheduler")

        def counted(*a, **k):
            self.steps += 1
            return schedule(*a, **k)

        scheduler.schedule = counted

    def _wrap(self, fn, kind: str):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds[kind] += time.perf_counter() - t0
        return timed


class Replica:
    """One engine (``LLM``) with ``connector`` (None: no CPU tier)."""

    def __init__(self, model: str, connector: dict | None, cpu_dtype: str,
                 max_model_len: int) -> None:
        from vllm import LLM

        self.llm = LLM(**_llm_kwargs(model, connector, block_size=BLOCK_TOKENS,
                                     kv_cache_memory_bytes=self.kv_bytes,
                                     max_model_len=max_model_len,
                                     max_num_batched_tokens=QUICK.max_num_batched_tokens,
                                     max_num_seqs=QUICK.max_num_seqs, dtype=cpu_dtype))
        self.core = core = self.llm.llm_engine.engine_core.engine_core
        self.recorder = StepRecorder(core.scheduler)
        conn = core.scheduler.connector
        self.side = None if conn is None else conn.scheduler_side
        self.timer = None if self.side is None else _Timer(self.side, core.scheduler)

    kv_bytes = 0  # set by ``run``: the GPU KV cache, bytes

    def serve(self, batches: list[list[str]], tokens: dict[str, list[int]]) -> dict:
        """Serve ``batches`` in order; hit tokens, prompt tokens and seconds of the half."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(temperature=0, max_tokens=1, detokenize=False, ignore_eos=True)
        hit = prompt = 0
        t0 = time.perf_counter()
        for batch in batches:
            seen = len(self.recorder.hits)
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=tokens[r]) for r in batch],
                                     [params] * len(batch), use_tqdm=False)
            admitted = list(self.recorder.hits.values())[seen:]  # this batch's, in order
            assert len(outs) == len(batch) == len(admitted)
            hit += sum(local + external for local, external in admitted)
            prompt += sum(len(tokens[r]) for r in batch)
        return {"hit_tokens": hit, "prompt_tokens": prompt, "hit_rate": hit / prompt,
                "seconds": time.perf_counter() - t0}

    def close(self) -> None:
        """Step until the connector's queued stores went out (a replica in a fleet keeps
        running: its last requests' blocks reach the tiers), then shut down."""
        _drain(self.core)
        shutdown_engine(self.llm)


def step_cost(model: str, dtype: str, max_len: int, per_block: int, master,
              batches: list[list[str]], tokens: dict[str, list[int]], repeats: int = 9) -> dict:
    """vLLM's scheduler seconds with the second tier on and off, on the same work: the whole
    workload on one replica whose CPU tier holds all of it, the store emptied first (so the
    tier finds nothing to fetch: it adds its existence queries, its hash lists and its
    bookkeeping; on this CPU platform the worker's puts run in the model's step, timed apart).
    The ratio is of the scheduler's seconds for the whole work, not per step: a lookup that
    waits for its query adds a step, which would make the average step cheaper. Off and on
    alternate ``repeats`` times; the ratio is the median of the pairs' ratios (a step is about
    2 ms here, and one pair's ratio moved by 10 to 60% with the machine's noise)."""
    cpu = {"cpu_bytes_per_rank": 8 * QUICK.gpu_blocks * per_block + per_block}
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(repeats):
        for name, cfg in (("off", cpu), ("on", {**cpu, "second_tier": _second_tier(master)})):
            _empty(master)
            r = Replica(model, cfg, dtype, max_len)
            served = r.serve(batches, tokens)
            row = {"steps": r.timer.steps, "scheduler_s": r.timer.seconds["scheduler"],
                   "connector_s": r.timer.seconds["connector"],
                   "hit_tokens": served["hit_tokens"]}
            if name == "on":
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                w = get_kv_transfer_group().worker_side.counters()
                row["worker_put_s"] = w["second_tier_put_s"]
                c = r.side.counters()
                row["fetched"] = c["second_tier_blocks_fetched"]
                row["queries"] = c["second_tier_queries"]
                row["queries_ahead"] = c["second_tier_queries_ahead"]
                row["query_waits"] = c["second_tier_query_waits"]
            r.close()
            row["scheduler_s_per_step"] = row["scheduler_s"] / row["steps"]
            row["connector_s_per_step"] = row["connector_s"] / row["steps"]
            runs[name].append(row)
    _empty(master)  # what the runs wrote through must not serve the replicas below
    med = {k: {m: float(np.median([r[m] for r in v]))
               for m in ("scheduler_s_per_step", "connector_s_per_step")}
           for k, v in runs.items()}
    def paired(metric: str) -> list[float]:
        return [on[metric] / off[metric] for off, on in zip(runs["off"], runs["on"],
                                                            strict=True)]

    return {"runs": runs, "median": med, "pair_ratios": paired("scheduler_s"),
            "ratio": float(np.median(paired("scheduler_s"))),
            "per_step_ratio": float(np.median(paired("scheduler_s_per_step"))),
            "connector_ratio": float(np.median(paired("connector_s")))}


def _empty(master) -> None:
    from kvtriton.second_tier.local_master import join

    raw = join(master, segment_bytes=0, buffer_bytes=1 << 20)
    try:
        raw.remove_all(True)
    finally:
        raw.close()


def _second_tier(master) -> dict:
    return {"kind": "mooncake", "master_server_address": master.master_server_address,
            "metadata_server": master.metadata_server, "fetch_timeout_s": 60.0}


def run(model: str, vocab: int, per_block: int, dtype: str, master) -> dict:
    """The three ways to serve B's half, and the step cost of the tier, in one run."""
    wl = engine_workload("cc_agentic", QUICK)
    tokens = prompt_tokens(wl, vocab)
    a_half, b_half = split_by_router(wl)
    Replica.kv_bytes = (QUICK.gpu_blocks + 1) * per_block
    # As bench.vllm.engine: the longest prompt plus its output, in whole blocks.
    longest = max(len(t) for t in tokens.values()) + 1
    max_len = -(-longest // BLOCK_TOKENS) * BLOCK_TOKENS
    cpu = {"cpu_bytes_per_rank": int(QUICK.cpu_ratio * QUICK.gpu_blocks * per_block)
           + per_block}
    store = {**cpu, "second_tier": _second_tier(master)}
    out: dict[str, Any] = {"requests": len(wl), "a_batches": len(a_half),
                           "b_batches": len(b_half)}
    out["step_cost"] = step_cost(model, dtype, max_len, per_block, master, a_half + b_half,
                                 tokens)
    for name, a_cfg, b_cfg, same in (("one_replica", store, None, True),
                                     ("shared_store", store, store, False),
                                     ("one_replica_cpu", cpu, None, True),
                                     ("no_store", cpu, cpu, False)):
        _empty(master)
        a = Replica(model, a_cfg, dtype, max_len)
        a_res = a.serve(a_half, tokens)
        if same:
            b, b_res = a, a.serve(b_half, tokens)
        else:
            a.close()
            b = Replica(model, b_cfg, dtype, max_len)
            b_res = b.serve(b_half, tokens)
        stats = b.side.counters() if b.side is not None else {}
        b.close()
        out[name] = {"a": a_res, "b": b_res,
                     "b_second_tier_blocks_fetched": stats.get("second_tier_blocks_fetched", 0),
                     "b_second_tier_faults": {k: v for k, v in stats.items()
                                              if k.startswith("second_tier_faults_") and v}}
    out["hit_rate_gap_points"] = 100 * (out["one_replica"]["b"]["hit_rate"]
                                        - out["shared_store"]["b"]["hit_rate"])
    return out
