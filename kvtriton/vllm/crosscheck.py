"""kvtriton's ``ServingLoop`` beside vLLM's real scheduler (``simulate_vllm``), policy by policy.

Each workload runs through both loops with the same capacities, policies and cost model; a row
gives both hit rates and recomputed tokens and their differences (vLLM minus ServingLoop). A hit
rate difference over one point is a finding, to be explained (see the closing note of issue 12).

Run: ``python -m kvtriton.vllm.crosscheck [--workloads agent cc_agentic mooncake]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvtriton.sim import (
    CC_AGENTIC_SAMPLE,
    MOONCAKE_SYNTHETIC,
    Workload,
    agent_workload,
    data_path,
    load_trace,
    simulate,
)
from kvtriton.sim.setups import DEFAULT_POLICIES

__all__ = ["WORKLOADS", "compare", "cross_check"]


def _agent() -> Workload:
    return agent_workload(num_conversations=24, min_turns=6, max_turns=12, seed=0)


def _trace(name: str, time_scale: float = 1.0) -> Callable[[], Workload]:
    def load() -> Workload:
        # 64-token blocks, as bench_sim's whole-trace Mooncake run.
        wl = load_trace(data_path(name), hash_block_size=64)
        if time_scale == 1.0:
            return wl
        return Workload([replace(r, arrival_s=r.arrival_s * time_scale) for r in wl.requests],
                        wl.hash_block_size, f"{wl.name} (arrivals x{time_scale:g})")

    return load


# name -> (workload, capacities): the agent setting of the README's table (GPU 32,768 tokens,
# CPU 65,536) and bench_sim's whole-trace setting for the shipped traces.
WORKLOADS: dict[str, tuple[Callable[[], Workload], dict[str, Any]]] = {
    "agent": (_agent, {"gpu_tokens": 32_768, "cpu_tokens": 65_536}),
    "cc_agentic": (_trace(CC_AGENTIC_SAMPLE), {"gpu_gib": 32.0, "cpu_gib": 256.0}),
    "mooncake": (_trace(MOONCAKE_SYNTHETIC, 4.0), {"gpu_gib": 32.0, "cpu_gib": 256.0}),
}

_KEEP = ("token_hit_rate", "gpu_hit_tokens", "cpu_hit_tokens", "recomputed_tokens",
         "prefill_tokens", "stored_blocks", "restored_blocks", "loaded_blocks", "preemptions",
         "steps", "ttft_p50_s", "ttft_p90_s", "makespan_s", "wall_s", "finished", "rejected")


def compare(serving_loop: dict, vllm: dict) -> dict:
    """One policy's row: both loops' figures and vLLM minus ServingLoop."""
    row = {"policy": serving_loop["policy"]}
    for k in _KEEP:
        row[f"loop_{k}"] = serving_loop[k]
        row[f"vllm_{k}"] = vllm[k]
    row["hit_rate_diff_points"] = 100 * (vllm["token_hit_rate"] - serving_loop["token_hit_rate"])
    row["recomputed_diff"] = vllm["recomputed_tokens"] - serving_loop["recomputed_tokens"]
    return row


def cross_check(workload: Workload, capacities: dict[str, Any],
                policies: Sequence[str] = DEFAULT_POLICIES, progress: bool = False) -> dict:
    """Both loops on ``workload``; the rows of ``compare`` and each loop's wall time."""
    from kvtriton.vllm.engine_sim import simulate_vllm

    t0 = time.perf_counter()
    loop = simulate(workload, policies=policies, bound=False, progress=progress, **capacities)
    t1 = time.perf_counter()
    vllm = simulate_vllm(workload, policies=policies, bound=False, progress=progress,
                         **capacities)
    t2 = time.perf_counter()
    rows = [compare(a, b) for a, b in zip(loop.rows, vllm.rows, strict=True)]
    return {"workload": workload.name, "requests": len(workload), "capacities": capacities,
            "conditions": vllm.conditions, "rows": rows,
            "wall_s": {"serving_loop": t1 - t0, "vllm": t2 - t1}}


def format_rows(result: dict) -> str:
    head = (f"{'policy':28s} {'hit loop':>9s} {'hit vllm':>9s} {'diff pt':>8s} "
            f"{'recomp loop':>12s} {'recomp vllm':>12s} {'diff':>11s} {'preempt l/v':>12s}")
    lines = [f"{result['workload']}: {result['requests']} requests, {result['capacities']}",
             head, "-" * len(head)]
    lines += [f"{r['policy']:28s} {r['loop_token_hit_rate']:9.1%} "
              f"{r['vllm_token_hit_rate']:9.1%} {r['hit_rate_diff_points']:+8.2f} "
              f"{r['loop_recomputed_tokens']:12,} {r['vllm_recomputed_tokens']:12,} "
              f"{r['recomputed_diff']:+11,} "
              f"{r['loop_preemptions']:>5,}/{r['vllm_preemptions']:<6,}" for r in result["rows"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES))
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    out = []
    for name in args.workloads:
        make, caps = WORKLOADS[name]
        res = cross_check(make(), caps, args.policies, progress=not args.quiet)
        res["name"] = name
        print(format_rows(res), flush=True)
        out.append(res)
        if args.json is not None:
            import vllm

            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({
                "machine": {"python": platform.python_version(), "vllm": vllm.__version__,
                            "processor": platform.processor() or platform.machine()},
                "results": out}, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
