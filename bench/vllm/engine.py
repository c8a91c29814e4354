"""The study's setups in vLLM's real engine, and the simulator's prediction of the same runs.

A workload is replayed by time stamp through vLLM's ``LLMEngine`` (``add_request`` at each
request's arrival; a closed-loop turn arrives its think time after the turn it follows
finished), once per system, each engine shut down before the next starts. Systems are setup
names of ``kvtriton.setups`` turned on by name through ``kv_connector_extra_config["setup"]``,
plus ``none`` (the GPU prefix cache alone), ``default`` (the connector with no setup given) and,
on CUDA, ``simple`` (vLLM's own ``SimpleCPUOffloadConnector``). ``eager`` is the connector
configured as vLLM's connector behaves (eager, head-first, LRU, no re-store). Turns carry the
trace's hints in ``kv_transfer_params`` (``kvtriton_hint``); setups without the ``hints`` axis
ignore them.

Per system the JSON has token hit rate, CPU hit tokens, TTFT p50/p90 (arrival to first token,
seconds), output tokens/s, stored and loaded blocks. Every engine step is timed with what it
computed; ``kvtriton.sim.cost.MeasuredCost`` is fitted to all of them (per workload, across
systems) and ``kvtriton.sim.simulate`` replays the same workload, sizes and setups on that
clock: prediction and measurement side by side, with the targets (hit rate within 1 point of the
engine's for every system, the systems' TTFT p50 in the same order, modeled TTFT p50 within 20%).

Without CUDA the engine is vLLM's CPU backend serving a random-weight Llama made at run time
(``MODEL``), large enough that prefill dominates a step (the JSON records ms per 1,000 prefill
tokens); the workloads are shrunk to fit it: the agent generator at small sizes, and the shipped
coding-agent traces' first turns with every ``CC_STRIDE``-th block (``coarsen``) and capped
think times. Outputs are cut to ``MAX_OUTPUT`` tokens with fresh hashes (``fresh_outputs``): the
engine samples its own tokens, which a later prompt built from the trace never matches.

Run: ``python -m bench.vllm.engine [--full] [--workloads agent,cc_agentic] [--systems ...]``;
``--model DIR`` serves a local model folder instead (a GPU box; nothing is downloaded). Writes
``bench/results/vllm_engine.json`` (``vllm_engine_full.json`` with ``--full``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import OneLineParser, machine_info, write_result
from bench.vllm.engine_findings import findings

SYSTEMS = ("none", "eager", "lazy+hints", "eager+s3fifo", "default")
WORKLOADS = ("agent", "cc_agentic")
BLOCK_TOKENS = 64
MAX_OUTPUT = 16
CC_STRIDE = 64
THINK_CAP_S = 12.0
# The random model of the CPU run: 4 layers of width 256 (fp32), about 100 ms per 1,000 prefill
# tokens and 5-10 ms per decode step on 2 cores, so a CPU hit saves most of a turn's time.
MODEL = dict(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
             vocab_size=1000)
TARGET_HIT_POINTS = 1.0
TARGET_TTFT_REL = 0.20


@dataclass(frozen=True)
class Size:
    """One run's size: the workload's knobs and the engine's capacities."""

    agent_conversations: int
    agent_turns: tuple[int, int]
    cc_sessions: int
    cc_turns: int
    gpu_blocks: int  # the engine's KV cache, in blocks of BLOCK_TOKENS
    cpu_ratio: float  # CPU tier / GPU KV cache
    time_scale: float  # arrivals and think times multiplied by this
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 16


# Think times dominate service times (the load is low): the order in which turns arrive, and
# so what the caches hold, follows the trace, not a step's jitter. At higher load the replay is
# chaotic (a few milliseconds move a turn ahead of another and the hit rate by points, in the
# engine run to run as much as between engine and simulator: `--time-scale 0.05` shows it).
# CPU = GPU: the tier is full and the setups differ (at 1.5x or more it holds these workloads
# whole and every setup ties).
QUICK = Size(agent_conversations=6, agent_turns=(3, 4), cc_sessions=4, cc_turns=6,
             gpu_blocks=48, cpu_ratio=1.0, time_scale=0.25)
# The tests' size: every step of the pipeline, a few seconds of serving per engine.
SMOKE = Size(agent_conversations=2, agent_turns=(2, 2), cc_sessions=1, cc_turns=3,
             gpu_blocks=48, cpu_ratio=1.0, time_scale=0.1)
FULL = Size(agent_conversations=16, agent_turns=(4, 8), cc_sessions=10, cc_turns=10,
            gpu_blocks=64, cpu_ratio=1.0, time_scale=0.25)


# ---- workloads -------------------------------------------------------------------------------

def engine_workload(name: str, size: Size):
    """The workload ``name`` as this benchmark replays it (module docstring): the engine and the
    simulator get exactly this."""
    from kvtriton.sim import CC_AGENTIC_SAMPLE, agent_workload, data_path, load_trace
    from kvtriton.sim.workloads import coarsen, first_turns, fresh_outputs, scale_times

    if name == "agent":
        lo, hi = size.agent_turns
        wl = agent_workload(num_conversations=size.agent_conversations, min_turns=lo,
                            max_turns=hi, system_prompt_tokens=384, first_user_tokens=256,
                            user_tokens=96, output_tokens=MAX_OUTPUT, think_s_mean=4.0,
                            start_window_s=6.0, hash_block_size=BLOCK_TOKENS,
                            vocab_size=MODEL["vocab_size"], seed=0)
    elif name == "cc_agentic":
        wl = first_turns(load_trace(data_path(CC_AGENTIC_SAMPLE)), size.cc_turns)
        # The main agents only: a subagent starts at its recorded time, which would stretch
        # the replay by minutes of idle engine.
        sessions = sorted({r.session for r in wl if "/" not in r.session})[:size.cc_sessions]
        keep = [r for r in wl.requests if r.session in sessions]
        keep = [replace(r, think_s=min(r.think_s, THINK_CAP_S)) for r in keep]
        wl = coarsen(type(wl)(keep, wl.hash_block_size, wl.name), CC_STRIDE)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if wl.hash_block_size != BLOCK_TOKENS:
        raise ValueError(f"workload {name!r}: {wl.hash_block_size}-token blocks, the engine "
                         f"runs {BLOCK_TOKENS}")
    return scale_times(fresh_outputs(wl, MAX_OUTPUT), size.time_scale)


def prompt_tokens(wl, vocab: int) -> dict[str, list[int]]:
    """Per request, prompt token ids made from its block hashes (a block's tokens are drawn
    from its hash, so equal hashes give equal tokens and prefixes shared in the trace are
    shared here); the partial last block is drawn from the request id."""
    b = wl.hash_block_size
    cache: dict[int, list[int]] = {}
    out = {}
    for r in wl:
        ids: list[int] = []
        for h in r.hashes[:r.prompt_len // b].tolist():
            blk = cache.get(h)
            if blk is None:
                blk = cache[h] = np.random.default_rng(h).integers(1, vocab, b).tolist()
            ids += blk
        tail = r.prompt_len - len(ids)
        if tail:
            seed = zlib.crc32(r.request_id.encode())  # not hash(): salted per process
            ids += np.random.default_rng(seed).integers(1, vocab, tail).tolist()
        out[r.request_id] = ids
    return out


# ---- one engine run --------------------------------------------------------------------------

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
        for rid, req in reqs.items():
            if rid not in self.hits and req.prefill_stats is not None:
                st = req.prefill_stats
                self.hits[rid] = (st.num_local_cached_tokens, st.num_external_cached_tokens)
        return out

    def take(self) -> list[tuple[int, int, int]]:
        chunks, self.chunks = self.chunks, []
        return chunks


def _percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def replay(engine: Any, recorder: StepRecorder, wl, tokens: dict[str, list[int]],
           hints: bool) -> dict[str, Any]:
    """Serve ``wl`` on ``engine`` by time stamp, as the simulator's clock does: a request
    without a predecessor at its ``arrival_s``, a closed-loop turn ``think_s`` after the turn
    it follows finished. Per request TTFT (from when it was due to the end of the step that gave
    its first token); every step's chunks with its measured seconds (``engine.step()`` whole:
    scheduling, the model, output processing)."""
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
    while waiting or engine.has_unfinished_requests():
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
        if not engine.has_unfinished_requests():
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


# ---- the prediction --------------------------------------------------------------------------

def combine_repeats(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of a system: the first run's fields, with the hit rate, CPU
    hit tokens, TTFT p50/p90 and throughput as the mean over runs (and the hit rate's and TTFT
    p50's range: the engine's own run-to-run spread), and every run's steps for the fit."""
    if len(reps) == 1:
        return reps[0]
    row = dict(reps[0])
    row["repeats"] = len(reps)
    for key in ("token_hit_rate", "cpu_hit_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_mean_s",
                "output_tokens_per_s", "stored_blocks", "loaded_blocks"):
        vals = [r[key] for r in reps if r.get(key) is not None]
        row[key] = float(np.mean(vals)) if vals else None
    for key in ("token_hit_rate", "ttft_p50_s"):
        vals = [r[key] for r in reps]
        row[f"{key}_range"] = [float(min(vals)), float(max(vals))]
    row["_steps"] = [step for r in reps for step in r["_steps"]]
    return row


# On vLLM's CPU backend the worker copies inside the step that issued them (a torch copy, done
# before the step's output): a transfer completes with its step and its time is part of the
# step's measured time, which the fit already charges. The simulator then models it as a link
# this fast: it completes within the step, as in the engine.
SYNC_BYTES_PER_S = 1e15


def fit_cost(rows: list[dict[str, Any]], block_bytes: int, *, synchronous: bool):
    """``MeasuredCost`` from every timed step of ``rows``. Transfer rates: ``synchronous`` (the
    CPU backend) at ``SYNC_BYTES_PER_S``; else the connector's measured copy times, per block,
    scaled to the simulator's ``block_bytes``."""
    from kvtriton.sim.cost import MeasuredCost, step_features

    feats, secs = [], []
    for row in rows:
        for chunks, dt in row["_steps"]:
            feats.append(step_features(chunks))
            secs.append(dt)
    rates = {}
    for kind, key in (("load", "h2d"), ("store", "d2h")):
        blocks = seconds = 0.0
        for row in rows:
            t = row.get("transfers", {}).get(kind)
            if t and t["seconds"]:
                blocks += t["bytes"] / row["_block_bytes"]
                seconds += t["seconds"]
        # No transfer measured: a nominal rate (the tier then moved nothing worth timing).
        rates[key] = (SYNC_BYTES_PER_S if synchronous else
                      blocks * block_bytes / seconds if seconds else 10e9)
    return MeasuredCost.fit(feats, secs, h2d_bytes_per_s=rates["h2d"],
                            d2h_bytes_per_s=rates["d2h"])


def predict(wl, systems: list[str], cost, *, gpu_blocks: int, cpu_blocks: int, size: Size,
            engine: str = "kvtriton") -> dict[str, dict]:
    """The simulator's rows for ``systems`` on ``wl`` at the engine's sizes and ``cost``:
    ``engine="kvtriton"`` is the study's serving loop, ``"vllm"`` the same clock around vLLM's
    own ``Scheduler`` and the connector's scheduler side (``kvtriton.sim.vllm_loop``)."""
    from kvtriton.setups import DEFAULT_SETUP
    from kvtriton.sim import simulate

    names = [DEFAULT_SETUP if s == "default" else "eager" if s == "simple" else s
             for s in systems]
    res = simulate(wl, setups=list(dict.fromkeys(names)), gpu_blocks=gpu_blocks,
                   cpu_blocks=cpu_blocks, token_budget=size.max_num_batched_tokens,
                   max_running=size.max_num_seqs, bound=False, cost=cost, engine=engine)
    by_name = {r["setup"]: r for r in res.rows}
    return {s: by_name[n] for s, n in zip(systems, names, strict=True)}


def compare(measured: list[dict[str, Any]], predicted: dict[str, dict]) -> dict[str, Any]:
    """The targets: hit rate within ``TARGET_HIT_POINTS`` for every system; the systems' TTFT
    p50 in the same order, judged on every pair whose measured p50s differ by more than
    ``TARGET_TTFT_REL`` (closer pairs are within the timing tolerance itself, and several
    setups tie when the tier holds everything); modeled TTFT p50 within ``TARGET_TTFT_REL`` of
    measured."""
    rows, hit_ok, ttft_ok = [], True, True
    for m in measured:
        p = predicted[m["system"]]
        d_hit = 100 * (p["token_hit_rate"] - m["token_hit_rate"])
        rel = p["ttft_p50_s"] / m["ttft_p50_s"] - 1 if m["ttft_p50_s"] else None
        hit_ok &= abs(d_hit) <= TARGET_HIT_POINTS
        ttft_ok &= rel is not None and abs(rel) <= TARGET_TTFT_REL
        rows.append({"system": m["system"], "hit_rate_engine": m["token_hit_rate"],
                     "hit_rate_sim": p["token_hit_rate"], "hit_points_off": d_hit,
                     "ttft_p50_engine_s": m["ttft_p50_s"], "ttft_p50_sim_s": p["ttft_p50_s"],
                     "ttft_p50_rel_off": rel})
    pairs, wrong = 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            lo, hi = sorted((a["ttft_p50_engine_s"], b["ttft_p50_engine_s"]))
            if hi <= lo * (1 + TARGET_TTFT_REL):
                continue
            pairs += 1
            if (a["ttft_p50_engine_s"] < b["ttft_p50_engine_s"]) != \
                    (a["ttft_p50_sim_s"] < b["ttft_p50_sim_s"]):
                wrong.append([a["system"], b["system"]])
    return {"rows": rows,
            "targets": {"hit_rate_within_1_point": bool(hit_ok),
                        "ttft_p50_same_order": not wrong,
                        "ttft_p50_within_20pct": bool(ttft_ok)},
            "ttft_order_engine": [r["system"] for r in sorted(
                rows, key=lambda r: r["ttft_p50_engine_s"])],
            "ttft_order_sim": [r["system"] for r in sorted(
                rows, key=lambda r: r["ttft_p50_sim_s"])],
            "ttft_pairs_compared": pairs, "ttft_pairs_misordered": wrong}


# ---- the run ---------------------------------------------------------------------------------

def _model_dir(args: Any) -> tuple[str, int, int, str]:
    """The model folder, its vocabulary, its KV bytes per block and dtype."""
    if args.model is not None:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.model)
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_block = 2 * cfg.num_hidden_layers * kv_heads * head * 2 * BLOCK_TOKENS  # bf16
        return args.model, cfg.vocab_size, per_block, "bfloat16"
    from bench.vllm.engine_run import tiny_llama

    m = MODEL
    name = "kvtriton-bench-llama-" + "-".join(f"{k}{v}" for k, v in m.items())
    path = tiny_llama(Path(tempfile.gettempdir()) / name, max_model_len=8192, **m)
    head = m["hidden_size"] // m["num_heads"]
    per_block = 2 * m["num_layers"] * m["num_kv_heads"] * head * 4 * BLOCK_TOKENS  # fp32
    return str(path), m["vocab_size"], per_block, "float32"


def _default_setup() -> str:
    from kvtriton.setups import DEFAULT_SETUP

    return DEFAULT_SETUP


def prefill_ms_per_1k(cost) -> float:
    """Modeled ms to prefill 1,000 tokens in one step from an empty context."""
    return 1e3 * (cost.step_overhead_s + cost.prefill_s(1000, 0))


def run_workload(name: str, systems: list[str], args: Any, size: Size) -> dict[str, Any]:
    from kvtriton.specs import preset

    model, vocab, kv_block_bytes, dtype = args.resolved_model
    wl = engine_workload(name, size)
    tokens = prompt_tokens(wl, vocab)
    longest = max(r.prompt_len + r.output_len for r in wl)
    max_model_len = -(-longest // BLOCK_TOKENS) * BLOCK_TOKENS
    if longest > size.gpu_blocks * BLOCK_TOKENS:
        raise ValueError(f"workload {name!r}: a request of {longest} tokens does not fit the "
                         f"{size.gpu_blocks}-block KV cache")
    cpu_bytes = int(size.cpu_ratio * size.gpu_blocks * kv_block_bytes)
    print(f"{name}: {len(wl)} requests, {sum(r.prompt_len for r in wl):,} prompt tokens, "
          f"GPU {size.gpu_blocks} blocks, CPU {size.cpu_ratio:g}x", flush=True)
    measured = []
    for system in systems:
        if system == "simple" and not args.cuda:
            print(f"  {system:14s} skipped: SimpleCPUOffloadConnector needs CUDA", flush=True)
            continue
        reps = [run_system(system, model, wl, tokens, gpu_blocks=size.gpu_blocks,
                           cpu_bytes=cpu_bytes, kv_bytes_per_block=kv_block_bytes, size=size,
                           max_model_len=max_model_len, dtype=dtype)
                for _ in range(args.repeats)]
        row = combine_repeats(reps)
        row["_block_bytes"] = kv_block_bytes
        measured.append(row)
        print(f"  {system:14s} hit {row['token_hit_rate']:6.1%} (CPU {row['cpu_hit_tokens']:,.0f} "
              f"tok)  TTFT p50/p90 {row['ttft_p50_s']:.3f}/{row['ttft_p90_s']:.3f} s  "
              f"{row['output_tokens_per_s']:.1f} tok/s  stored {row['stored_blocks']:,.0f} "
              f"loaded {row['loaded_blocks']:,.0f}", flush=True)
    layout = preset("llama3-8b", block_size=BLOCK_TOKENS)
    cost = fit_cost(measured, layout.cpu_block_bytes, synchronous=not args.cuda)
    cpu_blocks = next((r["cpu_blocks"] for r in measured if r["cpu_blocks"]),
                      int(size.cpu_ratio * size.gpu_blocks))
    sizes = dict(gpu_blocks=measured[0]["engine_gpu_blocks"], cpu_blocks=cpu_blocks, size=size)
    systems = [r["system"] for r in measured]
    predicted = predict(wl, systems, cost, **sizes)
    cmp = compare(measured, predicted)
    # The same clock around vLLM's own scheduler: where the two predictions differ, the study's
    # loop schedules differently from vLLM; where both miss, the clock or the engine's timing.
    predicted_vllm = predict(wl, systems, cost, engine="vllm", **sizes)
    cmp_vllm = compare(measured, predicted_vllm)
    for r, rv in zip(cmp["rows"], cmp_vllm["rows"], strict=True):
        print(f"  {r['system']:14s} sim hit {r['hit_rate_sim']:6.1%} "
              f"({r['hit_points_off']:+.1f} pt)  TTFT p50 {r['ttft_p50_sim_s']:.3f} s "
              f"({r['ttft_p50_rel_off']:+.0%});  on vLLM's scheduler {rv['hit_rate_sim']:6.1%} "
              f"({rv['hit_points_off']:+.1f} pt), {rv['ttft_p50_sim_s']:.3f} s "
              f"({rv['ttft_p50_rel_off']:+.0%})", flush=True)
    print(f"  targets: {cmp['targets']}; on vLLM's scheduler {cmp_vllm['targets']}; step fit "
          f"r2 {cost.r2:.3f} over {cost.samples} steps, {prefill_ms_per_1k(cost):.0f} ms per "
          "1,000 prefill tokens", flush=True)
    for r in measured:
        del r["_steps"], r["_block_bytes"]
    return {"workload": wl.name, "requests": len(wl),
            "prompt_tokens": sum(r.prompt_len for r in wl), "gpu_blocks": size.gpu_blocks,
            "cpu_blocks": cpu_blocks, "cpu_ratio": size.cpu_ratio, "max_model_len": max_model_len,
            "cost_fit": {**cost.conditions(), "prefill_ms_per_1k_tokens": prefill_ms_per_1k(cost),
                         "decode_step_ms": 1e3 * (cost.step_overhead_s
                                                  + cost.decode_step_s([256]))},
            "measured": measured,
            "predicted": _brief(predicted), "predicted_vllm_scheduler": _brief(predicted_vllm),
            **cmp, "vllm_scheduler": cmp_vllm}


def _brief(predicted: dict[str, dict]) -> dict[str, dict]:
    keys = ("token_hit_rate", "cpu_hit_tokens", "ttft_p50_s", "ttft_p90_s", "stored_blocks",
            "loaded_blocks", "ttft_all_s")
    return {s: {k: p[k] for k in keys} for s, p in predicted.items()}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.vllm.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="larger workloads (several minutes)")
    ap.add_argument("--quick", action="store_true", help="the make bench size (the default)")
    ap.add_argument("--smoke", action="store_true", help="the tests' size: seconds per engine")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated: setup names (kvtriton.setups), none, default, "
                         "simple (CUDA only)")
    ap.add_argument("--model", default=None, help="a local model folder (default: a random "
                    "Llama made at run time, for vLLM's CPU backend)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="multiply arrivals and think times by this (default: the size's)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="engine runs per system, their mean compared (default 1; 3 with "
                         "--full): the range shows the engine's own run-to-run spread")
    ap.add_argument("--cpu-ratio", type=float, default=None,
                    help="CPU tier / GPU KV cache (default: the size's)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU backend: the engine's compute threads (default 1: with one thread "
                         "per core, any other process on the machine stalls every step at "
                         "OpenMP's barriers, and the step-time fit then fits noise)")
    ap.add_argument("--out", type=Path, default=None, help="results folder")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats is None:
        args.repeats = 3 if args.full else 1
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    for name in ("time_scale", "cpu_ratio"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r}; choose from {', '.join(WORKLOADS)}")
    systems = list(dict.fromkeys(s for s in args.systems.split(",") if s))
    from kvtriton.setups import parse_setup

    for s in systems:
        if s in ("none", "default", "simple"):
            continue
        try:
            parse_setup(s)
        except ValueError as e:
            ap.error(f"--systems: {e}")
    if "default" in systems and _default_setup() in systems:
        # The connector's default is a setup already listed: its run is that one.
        systems.remove("default")
    if args.model is not None and not Path(args.model).is_dir():
        ap.error(f"--model {args.model!r}: not a folder (no download is attempted)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the step recorder needs the core here
    try:
        import torch
        import vllm
    except ImportError as e:
        print(f"bench_vllm: needs vLLM ({e}); `make test` installs it", file=sys.stderr)
        return 2
    args.cuda = torch.cuda.is_available()
    if not args.cuda:
        # Before the first engine: vLLM's CPU worker then forbids changing it.
        torch.set_num_threads(args.threads)
    args.resolved_model = _model_dir(args)
    size = FULL if args.full else SMOKE if args.smoke else QUICK
    label = "full" if args.full else "smoke" if args.smoke else "quick"
    for name in ("time_scale", "cpu_ratio"):
        if getattr(args, name) is not None:
            size = replace(size, **{name: getattr(args, name)})
    print(f"bench_vllm: vLLM {vllm.__version__} on "
          f"{'CUDA ' + torch.cuda.get_device_name(0) if args.cuda else 'CPU'}, model "
          f"{args.resolved_model[0]}; systems {', '.join(systems)}", flush=True)
    t0 = time.perf_counter()
    runs = {w: run_workload(w, systems, args, size) for w in workloads}
    doc = {"benchmark": "vllm_engine", "machine": machine_info(),
           "conditions": {"size": label, **size.__dict__,
                          "block_tokens": BLOCK_TOKENS, "max_output_tokens": MAX_OUTPUT,
                          "cc_stride": CC_STRIDE, "think_cap_s": THINK_CAP_S,
                          "model": args.model or {"random_llama": MODEL},
                          "backend": "cuda" if args.cuda else "cpu", "vllm": vllm.__version__,
                          "cpu_threads": None if args.cuda else args.threads,
                          "repeats": args.repeats,
                          "default_setup": _default_setup(),
                          "simulator_layout": "llama3-8b preset (blocks given in blocks; "
                                              "transfer rates scaled per block)"},
           "targets": {"hit_rate_points": TARGET_HIT_POINTS, "ttft_p50_rel": TARGET_TTFT_REL},
           "runs": runs, "wall_s": time.perf_counter() - t0}
    path = write_result("vllm_engine_full" if args.full else "vllm_engine", doc, args.out,
                        findings)
    print(f"wrote {path} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
