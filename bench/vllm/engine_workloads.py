"""What ``bench.vllm.engine`` serves, and at which size: the sizes of a run (``Size``: the
workload's knobs and the engine's capacities; ``QUICK``, ``SMOKE``, ``FULL``, ``PREDICT``), the
random model of the CPU run (``MODEL``), the workloads shrunk to fit it (``engine_workload``)
and the prompt tokens drawn from their block hashes (``prompt_tokens``).

The engine's replay and the simulator's prediction both take the workload from here, so the two
run exactly the same requests.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, replace

import numpy as np

WORKLOADS = ("agent", "cc_agentic")
BLOCK_TOKENS = 64
MAX_OUTPUT = 16
CC_STRIDE = 64
THINK_CAP_S = 12.0
# The random model of the CPU run: 4 layers of width 256 (fp32), about 100 ms per 1,000 prefill
# tokens and 5-10 ms per decode step on 2 cores, so a CPU hit saves most of a turn's time.
MODEL = dict(hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=4, num_kv_heads=2,
             vocab_size=1000)


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
    agent_start_window_s: float = 6.0  # the agent generator's conversations start within this
    # The coding-agent sessions' starts, this far apart in the order they started (None: as
    # recorded, which spreads twelve sessions over 50 minutes of mostly idle engine).
    cc_start_gap_s: float | None = None


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
# The out-of-sample prediction's size: at least 200 requests per workload (50 conversations of
# 3-5 turns; the twelve main coding-agent sessions, 17 turns each) at QUICK's capacities, the
# conversations' starts spread over a window as long per conversation as QUICK's.
PREDICT = Size(agent_conversations=50, agent_turns=(3, 5), cc_sessions=12, cc_turns=17,
               gpu_blocks=48, cpu_ratio=1.0, time_scale=0.25, agent_start_window_s=50.0,
               cc_start_gap_s=8.0)


def engine_workload(name: str, size: Size):
    """The workload ``name`` as this benchmark replays it (``bench.vllm.engine``'s docstring): the
    engine and the simulator get exactly this."""
    from kvtriton.sim import CC_AGENTIC_SAMPLE, agent_workload, data_path, load_trace
    from kvtriton.sim.workloads import coarsen, first_turns, fresh_outputs, scale_times

    if name == "agent":
        lo, hi = size.agent_turns
        wl = agent_workload(num_conversations=size.agent_conversations, min_turns=lo,
                            max_turns=hi, system_prompt_tokens=384, first_user_tokens=256,
                            user_tokens=96, output_tokens=MAX_OUTPUT, think_s_mean=4.0,
                            start_window_s=size.agent_start_window_s,
                            hash_block_size=BLOCK_TOKENS,
                            vocab_size=MODEL["vocab_size"], seed=0)
    elif name == "cc_agentic":
        wl = first_turns(load_trace(data_path(CC_AGENTIC_SAMPLE)), size.cc_turns)
        # The main agents only: a subagent starts at its recorded time, which would stretch
        # the replay by minutes of idle engine.
        sessions = sorted({r.session for r in wl if "/" not in r.session})[:size.cc_sessions]
        keep = [r for r in wl.requests if r.session in sessions]
        keep = [replace(r, think_s=min(r.think_s, THINK_CAP_S)) for r in keep]
        if size.cc_start_gap_s is not None:
            keep = _restart_sessions(keep, size.cc_start_gap_s)
        wl = coarsen(type(wl)(keep, wl.hash_block_size, wl.name), CC_STRIDE)
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if wl.hash_block_size != BLOCK_TOKENS:
        raise ValueError(f"workload {name!r}: {wl.hash_block_size}-token blocks, the engine "
                         f"runs {BLOCK_TOKENS}")
    return scale_times(fresh_outputs(wl, MAX_OUTPUT), size.time_scale)


def _restart_sessions(requests: list, gap_s: float) -> list:
    """``requests`` with each session moved in time as a whole, so that the sessions start
    ``gap_s`` apart in the order they started; turns keep their think times."""
    first: dict[str, float] = {}
    for r in requests:
        first[r.session] = min(first.get(r.session, r.arrival_s), r.arrival_s)
    order = {s: i for i, s in enumerate(sorted(first, key=lambda s: (first[s], s)))}
    return [replace(r, arrival_s=r.arrival_s - first[r.session] + order[r.session] * gap_s)
            for r in requests]


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


def bench_model() -> tuple[str, int, int, str]:
    """The random model of the CPU runs (``MODEL``), written once into the temp folder: its
    folder, vocabulary, KV bytes per block (fp32) and dtype."""
    import tempfile
    from pathlib import Path

    from bench.vllm.engine_run import tiny_llama

    m = MODEL
    name = "kvtriton-bench-llama-" + "-".join(f"{k}{v}" for k, v in m.items())
    path = tiny_llama(Path(tempfile.gettempdir()) / name, max_model_len=8192, **m)
    head = m["hidden_size"] // m["num_heads"]
    per_block = 2 * m["num_layers"] * m["num_kv_heads"] * head * 4 * BLOCK_TOKENS  # fp32
    return str(path), m["vocab_size"], per_block, "float32"
