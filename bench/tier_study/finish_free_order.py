"""Why a CPU tier could cost GPU prefix hits: the order a finished request's blocks rejoin the
GPU free queue (``PlannerConfig.hold_finished``), traced on the engine benchmark's workload.

Without a tier the scheduler frees a finished request's table tail first, so GPU pressure
evicts its chain's tail and its next turn still hits the head. With eager stores a request
finishes with stores of its last blocks in flight or queued (its finish flush); their GPU
sources stay pinned and rejoin the free queue only as each store completes, after the table's
other blocks and head first (vLLM's ``SimpleCPUOffloadConnector`` does the same): the head is
then the next victim, and one eviction costs the next turn its whole GPU hit. With
``hold_finished`` (the planner's default) the table stays referenced until its last store
completes and is then released tail first, as without a tier.

The run replays ``bench.vllm.engine``'s workload (``engine_workload``, the quick size, its
GPU and CPU sizes) through the simulator's serving loop on the step-time model fitted to the
engine (``bench/results/vllm_engine.json``'s ``cost_fit``; the H100 model without it), per
setup with the hold off and on, then the same requests with every turn at the time it arrived
without a tier (open loop): the loss without the hold is not the tier's effect on arrival
times. ``--trace N`` prints, for ``none`` and ``eager`` with the hold off and on, the first N
steps' GPU free queue (``session:position`` of each cached block, next victim first) and each
request's GPU hit at admission.

Run: ``python -m bench.tier_study.finish_free_order [--workload cc_agentic] [--trace 12]``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

SETUPS = ("none", "eager", "eager+s3fifo", "eager+tail")
RESULTS = Path(__file__).resolve().parents[1] / "results" / "vllm_engine.json"


def engine_cost(workload: str):
    """The step-time model fitted to the engine's run of ``workload`` (its recorded
    ``cost_fit``), or the simulator's H100 model where there is none."""
    from kvtriton.sim.cost import CostModel, MeasuredCost

    try:
        fit = json.loads(RESULTS.read_text())["runs"][workload]["cost_fit"]
    except (OSError, KeyError, ValueError):
        return CostModel.named("llama3-8b", "H100")
    return MeasuredCost(**{k: v for k, v in fit.items() if k in MeasuredCost.__dataclass_fields__})


class Run:
    """One serving-loop run of ``wl`` under ``setup`` (``hold``: the planner's
    ``hold_finished``), with per-request arrivals and, up to step ``trace``, the free queue."""

    def __init__(self, wl, setup: str, hold: bool, cost, size, trace: int = 0) -> None:
        from kvtriton.setups import tier_setup
        from kvtriton.sim.keys import workload_keys
        from kvtriton.sim.loop import ServingLoop
        from kvtriton.specs import preset

        layout = preset("llama3-8b", block_size=wl.hash_block_size)
        keys, _ = workload_keys(layout, wl)
        tier = tier_setup(setup)
        if tier.planner is not None:
            tier = replace(tier, planner=replace(tier.planner, hold_finished=hold))
        gpu = size.gpu_blocks
        self.loop = loop = ServingLoop(
            wl, keys, layout, tier, cost, gpu_blocks=gpu,
            cpu_blocks=max(1, int(size.cpu_ratio * gpu) - 1),
            token_budget=size.max_num_batched_tokens, max_running=size.max_num_seqs)
        self.owner = {}  # key -> "session:position", of the request that made it first
        for i, wr in enumerate(wl.requests):
            for pos, k in enumerate(keys[i][0].tolist()):
                self.owner.setdefault(k, f"{(wr.session or wr.request_id)[-4:]}:{pos}")
        self.arrivals: dict[str, float] = {}
        self.lines: list[str] = []
        add = loop.sched.add

        def add_and_note(seq) -> None:
            self.arrivals[seq.req.request_id] = seq.arrival_s
            add(seq)

        loop.sched.add = add_and_note
        seen: set[str] = set()
        while loop.step():
            if loop.step_no > trace:
                continue
            for rid, (_, gpu_hit, cpu_hit) in loop.sched.first_admit_tokens.items():
                if rid not in seen:
                    seen.add(rid)
                    self.lines.append(f"  admitted {rid}: GPU hit {gpu_hit // wl.hash_block_size}"
                                      f" blocks, CPU hit {cpu_hit // wl.hash_block_size}")
            queue = [self.owner.get(loop.gpu.block_hash(b), "?") for b in loop.gpu.iter_free()
                     if loop.gpu.block_hash(b) is not None]
            self.lines.append(f"step {loop.step_no - 1:3d} t={loop.now:7.3f}s free queue: "
                              + " ".join(queue))
        self.metrics = loop.finish_run(len(wl))


def fixed_arrivals(wl, arrivals: dict[str, float]):
    """``wl`` open loop: every request at ``arrivals[request_id]``, none waiting for another."""
    reqs = [replace(r, after=None, think_s=0.0, arrival_s=arrivals[r.request_id])
            for r in wl.requests]
    return type(wl)(reqs, wl.hash_block_size, f"{wl.name} (fixed arrivals)")


def row(label: str, m) -> dict:
    p = m.prompt_tokens
    out = {"run": label, "token_hit_rate": (m.gpu_hit_tokens + m.cpu_hit_tokens) / p,
           "gpu_hit_tokens": m.gpu_hit_tokens, "cpu_hit_tokens": m.cpu_hit_tokens}
    print(f"{label:44s} hit {100 * out['token_hit_rate']:6.2f}%  GPU hit {m.gpu_hit_tokens:6,}"
          f"  CPU hit {m.cpu_hit_tokens:6,}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from bench.common import OneLineParser
    from bench.vllm.engine_workloads import QUICK, WORKLOADS, engine_workload

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="cc_agentic", choices=WORKLOADS)
    ap.add_argument("--cpu-ratio", type=float, default=QUICK.cpu_ratio,
                    help="CPU tier / GPU KV cache (default: the engine benchmark's)")
    ap.add_argument("--gpu-blocks", type=int, default=QUICK.gpu_blocks)
    ap.add_argument("--trace", type=int, default=0, help="print the first N steps' free queue")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    size = replace(QUICK, cpu_ratio=args.cpu_ratio, gpu_blocks=args.gpu_blocks)
    wl, cost = engine_workload(args.workload, QUICK), engine_cost(args.workload)
    print(f"{wl.name}: {len(wl)} requests, GPU {size.gpu_blocks} blocks, CPU ratio "
          f"{size.cpu_ratio}, cost {cost.conditions().get('kind', 'model')}")
    rows, base = [], None
    for fixed in (False, True):
        work = wl if not fixed else fixed_arrivals(wl, base)
        tag = " (fixed arrivals)" if fixed else ""
        for setup in SETUPS:
            for hold in ((True,) if setup == "none" else (False, True)):
                run = Run(work, setup, hold, cost, size)
                if setup == "none" and not fixed:
                    base = run.arrivals
                label = setup if setup == "none" else f"{setup} hold_finished={hold}"
                rows.append(row(label + tag, run.metrics))
    for setup, hold in (("none", True), ("eager", False), ("eager", True)) if args.trace else ():
        print(f"\n== {setup}" + ("" if setup == "none" else f" hold_finished={hold}"))
        print("\n".join(Run(wl, setup, hold, cost, size, trace=args.trace).lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"workload": wl.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
