"""What the tier studies share (``bench_setups``, ``tune_shares``): the setups they run
(``ABLATION``: each axis changed alone from the control; ``COMBINED``: combinations of axes),
the workloads at their quick and full sizes with the hints a server has and the oracle closes,
how each is split into train and test parts, the TTFT rule's tolerance and the best online
setup under it (``best_online``: the setup study's targets and its findings both choose by it,
with ``bench.choice.choose_on_train``),
and the process pool that runs one simulation per task. Not a study: studies import it, never
each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

from bench.choice import choose_on_train, figures
from kvtriton.setups import CONTROL
from kvtriton.sim import (
    CC_AGENTIC_SAMPLE,
    Workload,
    agent_workload,
    data_path,
    load_trace,
    mark_session_close,
    simulate,
    without_closes,
)
from kvtriton.sim.splits import SPLIT_SEED
from kvtriton.sim.workloads import first_turns, serving_workload

#: Every axis changed alone from the control (the ablation the benchmark runs).
ABLATION = ("eager", "eager+restore", "eager+restore:0.5", "eager+tail", "eager+arc",
            "eager+s3fifo", "eager+lfu:64", "eager+second", "eager+refresh", "eager+hints",
            "eager+waiting", "eager+sessions", "lazy", "eager+reqlru", "eager+reqarc")

#: Combinations of the axes that pay, run beside the ablation.
COMBINED = ("lazy+hints", "lazy+hinted", "lazy+hinted+hints", "eager+refresh+arc",
            "eager+restore:0.5+tail+arc", "eager+lfu:64+waiting", "eager+sessions:60",
            "eager+lfu:64+sessions")
#: The combinations that use hints (the first of ``COMBINED``).
HINTED_COMBINED = COMBINED[:3]


#: How each workload is split (``kvtriton.sim.splits``): the best setup is chosen on the train
#: part and judged on the test part. Mooncake is one long trace: its time halves. The others
#: are sets of independent sessions: whole sessions (a coding-agent trace with its sub-agents)
#: drawn into two sets.
SPLITS = {"agent": "sessions", "cc_agentic": "sessions", "mooncake": "time", "glm5": "time"}
SPLIT_TEXT = {"time": "time halves (the first half of the requests by arrival trains)",
              "sessions": f"sessions drawn into two sets (seed {SPLIT_SEED})"}
QUICK_CC_TURNS = 12


def cc_agentic_with_closes(trace: Workload | None = None) -> Workload:
    """The coding-agent traces (``trace``, default the shipped sample) with each session's last
    turn hinted ``close``. Closes are marked on the whole trace before any cut: a cut's last
    turn is not its session's last."""
    return mark_session_close(trace if trace is not None
                              else load_trace(data_path(CC_AGENTIC_SAMPLE)))


def workloads(quick: bool) -> dict[str, tuple[Workload, int, Workload | None]]:
    """Per tag: the workload with the hints a server has (``continue`` from stop reasons; no
    close), its GPU capacity in tokens, and the same workload with each session's last turn
    hinted ``close`` (an oracle: it knows no turn follows; None where there are no hints)."""
    if quick:
        agent = agent_workload(num_conversations=16, min_turns=4, max_turns=10, seed=0)
        agent_gpu = 16_384
    else:
        agent = agent_workload(num_conversations=64, min_turns=10, max_turns=50, seed=0)
        agent_gpu = 131_072
    cc = load_trace(data_path(CC_AGENTIC_SAMPLE))
    cc_oracle = cc_agentic_with_closes(cc)
    if quick:
        cc, cc_oracle = first_turns(cc, QUICK_CC_TURNS), first_turns(cc_oracle, QUICK_CC_TURNS)
    # The whole Mooncake trace even when quick: its reuse builds up over the trace (the first
    # thousand requests hit under 3% whatever the tier does).
    # Mooncake was recorded on a cluster: its arrivals are spread, as in bench.tier_study.capacity.
    mooncake, _ = serving_workload("mooncake")
    # The GLM-5 sample whole, as Mooncake: 500 prefills, no sessions and no hints.
    glm5, _ = serving_workload("glm5")
    return {"agent": (without_closes(agent), agent_gpu, agent),
            "cc_agentic": (without_closes(cc), 262_144, cc_oracle),
            "mooncake": (mooncake, 262_144, None),
            "glm5": (glm5, 262_144, None)}


def ttft_tolerance_s(conditions: dict) -> float:
    """How much higher a setup's modeled TTFT p50 and p90 may be than the control's and still
    count as no worse: one scheduler step at the full token budget (the step overhead plus a
    prefill of ``token_budget`` tokens). A prompt's prefill moves in whole steps, so a change
    smaller than one is below the cost model's resolution: a turn that lands a step earlier or
    later, not a slower server."""
    from kvtriton.sim.cost import CostModel

    cm = conditions["cost_model"]
    cost = CostModel.named(conditions["model"], conditions["gpu"], mfu=cm["mfu"],
                           hbm_efficiency=cm["hbm_efficiency"],
                           step_overhead_s=cm["step_overhead_s"])
    return cost.step_overhead_s + cost.prefill_s(conditions["token_budget"], 0)


def ttft_within(fig: dict, control: dict, tolerance_s: float = 0.0) -> bool:
    """Whether figures ``fig`` have a modeled TTFT p50 and p90 no more than ``tolerance_s``
    above ``control``'s (figures of the same part)."""
    return (fig["ttft_p50_s"] <= control["ttft_p50_s"] + tolerance_s + 1e-9
            and fig["ttft_p90_s"] <= control["ttft_p90_s"] + tolerance_s + 1e-9)


def ttft_ok(row: dict, control: dict, tolerance_s: float = 0.0, part: str | None = None) -> bool:
    return ttft_within(figures(row, part), figures(control, part), tolerance_s)


def best_online(rows: list[dict], tolerance_s: float = 0.0, part: str | None = None) -> dict | None:
    """The online setup (not the control, not given oracle closes) that gains the most points
    over the control, some, with modeled TTFT p50 and p90 no more than ``tolerance_s`` above
    the control's; None if no such setup. ``part``: judged on that part of the split only (the
    train part, when a choice is to be reported on the test part)."""
    control = figures(next(r for r in rows if r["composition"] == CONTROL), part)
    online = [r for r in rows if not r["oracle"] and r["composition"] not in (CONTROL, "none")
              and r.get("hint_source") != "oracle closes"]
    return choose_on_train(
        online, lambda f: f["gain_points"],
        lambda f: (f.get("gain_points") is not None and f["gain_points"] > 0
                   and ttft_within(f, control, tolerance_s)),
        part)


def slim(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "ttft_all_s"}


def _simulate(args: tuple) -> tuple:
    """One ``simulate`` call in a worker process: ``(key, workload, kwargs)`` -> ``(key,
    SimulationResult as a dict)``."""
    key, wl, kw = args
    return key, simulate(wl, **kw).to_dict()


def run_all(tasks: list[tuple], progress: bool, what: str,
            task: Callable[[tuple], tuple] | None = None) -> dict:
    """Run ``tasks`` on every core, each through ``task`` (a module-level function from a task
    to ``(key, result)``; default ``_simulate``); results by key."""
    out = {}
    workers = max(1, min(len(tasks), os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        for n, (key, res) in enumerate(pool.map(task or _simulate, tasks), 1):
            out[key] = res
            if progress:
                shown = "/".join(map(str, key)) if isinstance(key, tuple) else key
                print(f"  {what}: {n}/{len(tasks)} done ({shown})", flush=True)
    return out
