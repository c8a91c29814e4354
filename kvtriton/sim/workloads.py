"""The workloads by name: one registry for the CLI, the benchmarks and the cross-check.

A name is ``agent`` (the generator), ``chat`` (the generator's sequential-chat shape,
``SEQUENTIAL_CHAT``), ``mooncake``, ``cc_agentic`` or ``glm5`` (traces shipped in
``kvtriton/sim/data``); anything else is read as a trace file or folder. Each named workload
carries the serving setting the benchmarks run it at (``WorkloadSpec.serving``), so a setting is
written once. The transformations every experiment applies are here too: ``limit_workload``
(the first N requests), ``scale_times`` (arrivals and think times stretched),
``first_turns`` (the first turns of every session), ``coarsen`` (every k-th prompt block: a
trace shrunk with its sharing kept) and ``fresh_outputs`` (outputs no later prompt reuses, as
a real engine's generated tokens are not the trace's).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from kvtriton.sim.traces import (
    CC_AGENTIC_SAMPLE,
    GLM5_BLOCK_SIZE,
    GLM5_SAMPLE,
    MOONCAKE_SYNTHETIC,
    data_path,
    load_trace,
)
from kvtriton.sim.workload import AgentConfig, Workload, agent_workload

__all__ = ["SEQUENTIAL_CHAT", "WORKLOADS", "WorkloadSpec", "coarsen", "first_turns",
           "fresh_outputs", "limit_workload", "load_workload", "scale_times", "serving_workload",
           "trace_source"]


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload. ``trace``: its file or folder in ``kvtriton/sim/data`` (None: the
    agent generator). ``serving``: the setting the benchmarks simulate it at: ``block_size``
    (tokens), ``time_scale`` (arrivals stretched by it) and the capacities (``gpu_gib``,
    ``cpu_gib`` or ``gpu_tokens``, ``cpu_tokens``) as ``simulate`` takes them."""

    name: str
    description: str
    trace: str | None
    serving: Mapping[str, Any] = field(default_factory=dict)
    #: Tokens per block id of a Mooncake-format trace (None: its format's own).
    trace_block_size: int | None = None

    def capacities(self) -> dict[str, Any]:
        """The serving setting's capacities, as ``simulate`` keyword arguments."""
        return {k: v for k, v in self.serving.items() if k.startswith(("gpu_", "cpu_"))}


#: How much the GLM-5 sample's arrivals are spread: its prompts' prefill without any cache takes
#: about 13.6 times its 22.4 s on the modeled H100 (Llama-3-8B, ``CostModel.named()``), so at
#: 20x the GPU would be busy about two thirds of the time before any cache hit. Fixed from the
#: trace and the cost model, before any tier ran on it.
GLM5_TIME_SCALE = 20.0

WORKLOADS: Mapping[str, WorkloadSpec] = MappingProxyType({
    # The agent setting of the README's table: GPU 32,768 tokens, CPU 65,536.
    "agent": WorkloadSpec("agent", "agent generator (multi-turn sessions, shared system prompt)",
                          None, {"block_size": 16, "time_scale": 1.0, "gpu_tokens": 32_768,
                                 "cpu_tokens": 65_536}),
    # Where frequency-first eviction loses to recency (SEQUENTIAL_CHAT): a tier of 300 blocks.
    "chat": WorkloadSpec("chat", "sequential chat (about one conversation at a time, small tier)",
                         None, {"block_size": 16, "time_scale": 1.0, "gpu_tokens": 4_096,
                                "cpu_tokens": 4_800}),
    # Recorded on a cluster: its arrivals are spread 4x, or it overruns one modeled GPU.
    # 64-token blocks keep the whole trace within minutes on 2 cores (its own are 512).
    "mooncake": WorkloadSpec("mooncake", "Mooncake's synthetic conversation trace",
                             MOONCAKE_SYNTHETIC, {"block_size": 64, "time_scale": 4.0,
                                                  "gpu_gib": 32.0, "cpu_gib": 256.0}),
    "cc_agentic": WorkloadSpec("cc_agentic", "coding-agent traces (kv-cache-tester)",
                               CC_AGENTIC_SAMPLE, {"block_size": 64, "time_scale": 1.0,
                                                   "gpu_gib": 32.0, "cpu_gib": 256.0}),
    # Prefill requests sampled from a production cluster over 22 s (GLM5_TIME_SCALE).
    "glm5": WorkloadSpec("glm5", "GLM-5 prefill requests (Alibaba's tair-kvcache sample)",
                         GLM5_SAMPLE, {"block_size": 64, "time_scale": GLM5_TIME_SCALE,
                                       "gpu_gib": 32.0, "cpu_gib": 256.0},
                         trace_block_size=GLM5_BLOCK_SIZE),
})

#: The agent generator's setting where an experiment names only ``agent``.
DEFAULT_AGENT = AgentConfig(num_conversations=24, min_turns=6, max_turns=12, seed=0)

#: Sequential chat: 40 conversations of 6-12 short turns starting over 2,000 s, so that about
#: one runs at a time (a conversation lasts about 40 s), each growing to at most 3,000 tokens
#: over a 512-token shared system prompt. The shape of a finding in the real engine (a long
#: chat-like run on a tier of 150 blocks, where ``lfu:64`` kept 17-29% of the CPU-hit tokens
#: of ``eager``): a finished conversation's blocks were counted at every one of its turns, the
#: next conversation's fresh blocks once, so a frequency sketch keeps the dead conversation and
#: evicts the live one. The sizes were chosen to show that effect
#(``bench/tier_study/lfu_recency.py`` : reports it on other seeds than the one they were chosen on).
SEQUENTIAL_CHAT = AgentConfig(num_conversations=40, min_turns=6, max_turns=12,
                              system_prompt_tokens=512, first_user_tokens=256, user_tokens=128,
                              output_tokens=128, max_context_tokens=3_000, start_window_s=2_000.0,
                              think_s_mean=2.0, seed=1)

_GENERATED = {"agent": DEFAULT_AGENT, "chat": SEQUENTIAL_CHAT}


def load_workload(name: str, *, block_size: int | None = None, limit: int | None = None,
                  time_scale: float = 1.0, turns: int | None = None,
                  agent: AgentConfig | None = None,
                  trace_block_size: int | None = None) -> Workload:
    """The workload called ``name`` (a ``WORKLOADS`` key, or a trace file or folder).

    ``block_size``: hash block size in tokens (default: the trace's own; the generator's 16);
    ``agent``: the generator's setting (default ``DEFAULT_AGENT`` for ``agent``,
    ``SEQUENTIAL_CHAT`` for ``chat``, at ``block_size``);
    ``trace_block_size``: the tokens per block id of a Mooncake-format file given by path (a
    named trace knows its own);
    ``turns``: keep the first ``turns`` turns of every session; ``limit``: then the first
    ``limit`` requests; ``time_scale``: then multiply arrival and think times."""
    if name in _GENERATED:
        if trace_block_size is not None:
            raise ValueError(f"trace_block_size={trace_block_size}: the {name} generator reads "
                             "no trace")
        cfg = agent or _GENERATED[name]
        if block_size is not None:
            cfg = replace(cfg, hash_block_size=block_size)
        wl = agent_workload(cfg)
    else:
        path, trace_block_size = trace_source(name, trace_block_size)
        wl = load_trace(path, hash_block_size=block_size, trace_block_size=trace_block_size)
    if turns is not None:
        wl = first_turns(wl, turns)
    if limit is not None:
        wl = limit_workload(wl, limit)
    return scale_times(wl, time_scale) if time_scale != 1.0 else wl


def trace_source(name: str, trace_block_size: int | None = None) -> tuple[Path, int | None]:
    """The file or folder of the shipped trace called ``name``, or ``name`` read as a path (the
    trace loader says what is wrong with an unknown one), and the tokens per block id to read it
    at: ``trace_block_size`` is for a path; a shipped trace knows its own (``ValueError``)."""
    spec = WORKLOADS.get(name)
    if spec is None or spec.trace is None:
        return Path(name), trace_block_size
    if trace_block_size is not None:
        raise ValueError(f"trace_block_size={trace_block_size} (--trace-block-size): {name!r} is "
                         "a shipped trace that knows its block size; give it for a trace file")
    return data_path(spec.trace), spec.trace_block_size


def serving_workload(name: str, **kw: Any) -> tuple[Workload, dict[str, Any]]:
    """``WORKLOADS[name]`` at its serving setting (block size, time scale), and its capacities
    as ``simulate`` keyword arguments; ``kw`` as ``load_workload`` takes them."""
    spec = WORKLOADS[name]
    s = spec.serving
    kw.setdefault("block_size", s["block_size"])
    kw.setdefault("time_scale", s["time_scale"])
    return load_workload(name, **kw), spec.capacities()


def limit_workload(wl: Workload, n: int) -> Workload:
    """The first ``n`` requests of ``wl`` whose predecessors (closed loop) are kept too."""
    kept, ids = [], set()
    for r in wl.requests:
        if len(kept) == n:
            break
        if r.after is None or r.after in ids:
            kept.append(r)
            ids.add(r.request_id)
    return Workload(kept, wl.hash_block_size, f"{wl.name}[:{n}]")


def scale_times(wl: Workload, factor: float) -> Workload:
    """``wl`` with every arrival and think time multiplied by ``factor`` (> 1 lightens the
    load)."""
    reqs = [replace(r, arrival_s=r.arrival_s * factor, think_s=r.think_s * factor)
            for r in wl.requests]
    return Workload(reqs, wl.hash_block_size, f"{wl.name} (times x{factor:g})")


def first_turns(wl: Workload, turns: int) -> Workload:
    """The first ``turns`` turns of every session (and every request without one); a kept turn
    whose predecessor was cut no longer waits for it."""
    seen: dict[str | None, int] = {}
    kept = []
    for r in wl.requests:
        n = seen.get(r.session, 0)
        if r.session is None or n < turns:
            kept.append(r)
            seen[r.session] = n + 1
    ids = {r.request_id for r in kept}
    kept = [replace(r, after=None) if r.after is not None and r.after not in ids else r
            for r in kept]
    return Workload(kept, wl.hash_block_size, f"{wl.name} (first {turns} turns per session)")


def _with_outputs(r, prompt_hashes: np.ndarray, prompt_len: int, output_len: int, b: int):
    """``r`` with the given prompt and ``output_len`` tokens of output whose blocks carry hashes
    drawn from the request id: no other request holds them."""
    n_out = (prompt_len + output_len) // b - len(prompt_hashes)
    rng = np.random.default_rng(zlib.crc32(r.request_id.encode()))
    out = rng.integers(1 << 62, 1 << 63, n_out, dtype=np.uint64)
    return replace(r, prompt_len=prompt_len, output_len=output_len,
                   hashes=np.concatenate([prompt_hashes, out]).astype(np.uint64))


def coarsen(wl: Workload, stride: int) -> Workload:
    """``wl`` shrunk ``stride`` times: each prompt keeps its blocks 0, stride, 2 stride, ...
    (and its partial last block). Chain hashes name whole prefixes, so two prompts still share
    exactly the kept blocks before the point where they diverged: the sharing structure stays,
    at ``stride`` times coarser resolution. Outputs are cut by ``stride`` too and get fresh
    hashes (``fresh_outputs``). For replaying long traces on a small engine."""
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise ValueError(f"coarsen: stride must be an int >= 1, got {stride!r}")
    b = wl.hash_block_size
    reqs = []
    for r in wl.requests:
        full = r.prompt_len // b
        kept = r.hashes[:full][::stride]
        prompt_len = len(kept) * b + r.prompt_len % b
        reqs.append(_with_outputs(r, kept, prompt_len, max(1, r.output_len // stride), b))
    return Workload(reqs, b, f"{wl.name} (every {stride}th block)")


def fresh_outputs(wl: Workload, max_output_tokens: int) -> Workload:
    """``wl`` with every output cut to ``max_output_tokens`` and its blocks given hashes no
    other request holds: a real engine samples its own output tokens, so a later turn's prompt
    (built from the trace's hashes) never matches them, and a simulation of the same replay
    must not either."""
    if not isinstance(max_output_tokens, int) or max_output_tokens < 1:
        raise ValueError(f"fresh_outputs: max_output_tokens must be an int >= 1, got "
                         f"{max_output_tokens!r}")
    b = wl.hash_block_size
    reqs = [_with_outputs(r, r.hashes[:r.prompt_len // b], r.prompt_len,
                          min(r.output_len, max_output_tokens), b) for r in wl.requests]
    return Workload(reqs, b, f"{wl.name} (outputs <= {max_output_tokens} tokens, fresh)")
