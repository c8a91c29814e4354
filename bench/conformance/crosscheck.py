"""kvtriton's ``ServingLoop`` beside vLLM's real scheduler (``VllmLoop``), setup by setup.

Each workload (the agent generator and every trace shipped in ``kvtriton/sim/data``) runs
through both loops with the same capacities, setups and cost model; a row gives both hit rates
and recomputed tokens and their differences (vLLM minus ServingLoop). A hit rate difference over
one point is a finding, to be explained. vLLM runs with its
defaults unless ``--vllm-scheduler`` says otherwise, and ServingLoop with the options that model
the same settings (``serving_loop_options``): like is compared with like.

Run: ``python -m bench.conformance.crosscheck [--workloads agent cc_agentic mooncake]
[--limit N | --limit NAME=N ...] [--json out.json]``. It prints each workload's rows as it
finishes, then one markdown table of every row; ``--json`` holds the machine, date, versions,
conditions and every row, rewritten after each workload so a long run leaves what it finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.common import OneLineParser, machine_info, record_output
from kvtriton.setups import DEFAULT_SETUPS
from kvtriton.sim import Workload, data_path, simulate
from kvtriton.sim.workloads import WORKLOADS as NAMED
from kvtriton.sim.workloads import limit_workload, load_workload, serving_workload

__all__ = ["WORKLOADS", "compare", "cross_check", "markdown_table", "serving_loop_options",
           "shipped_traces"]

#: A hit rate difference above this many percentage points is a finding to explain.
FINDING_POINTS = 1.0


def shipped_traces() -> list[str]:
    """The trace files and folders in ``kvtriton/sim/data`` (everything but its manifest)."""
    return sorted(p.name for p in data_path("").iterdir()
                  if p.name != "MANIFEST.md" and not p.name.startswith((".", "_")))


def _workloads() -> dict[str, tuple[Callable[[], Workload], dict[str, Any]]]:
    """Every named workload at its serving setting, and any trace shipped without a name (at
    the traces' 64-token blocks and capacities): a trace shipped later is cross-checked too."""
    out: dict[str, tuple[Callable[[], Workload], dict[str, Any]]] = {
        name: ((lambda name=name: serving_workload(name)[0]), spec.capacities())
        for name, spec in NAMED.items()}
    named = {spec.trace for spec in NAMED.values()}
    for trace in shipped_traces():
        if trace not in named:
            out[Path(trace).name.split(".")[0]] = (
                (lambda trace=trace: load_workload(str(data_path(trace)), block_size=64)),
                NAMED["cc_agentic"].capacities())
    return out


# name -> (workload, capacities): the agent generator and every shipped trace.
WORKLOADS: dict[str, tuple[Callable[[], Workload], dict[str, Any]]] = _workloads()

_KEEP = ("token_hit_rate", "gpu_hit_tokens", "cpu_hit_tokens", "recomputed_tokens",
         "prefill_tokens", "stored_blocks", "restored_blocks", "loaded_blocks", "preemptions",
         "steps", "ttft_p50_s", "ttft_p90_s", "makespan_s", "wall_s", "finished", "rejected")


def compare(serving_loop: dict, vllm: dict) -> dict:
    """One setup's row: both loops' figures and vLLM minus ServingLoop (hit rates as
    fractions, their difference in percentage points, recomputed tokens in tokens)."""
    row = {"setup": serving_loop["setup"]}
    for k in _KEEP:
        row[f"loop_{k}"] = serving_loop[k]
        row[f"vllm_{k}"] = vllm[k]
    row["hit_rate_diff_points"] = 100 * (vllm["token_hit_rate"] - serving_loop["token_hit_rate"])
    row["recomputed_diff"] = vllm["recomputed_tokens"] - serving_loop["recomputed_tokens"]
    return row


#: vLLM's default for the SchedulerConfig fields ServingLoop models, and its option for each.
_MODELED_FIELDS = {"scheduler_reserve_full_isl": ("reserve_full_isl", True)}


def serving_loop_options(scheduler_overrides: dict[str, Any] | None) -> dict[str, Any]:
    """``simulate`` options that make ServingLoop model vLLM under ``scheduler_overrides``
    (vLLM's value of each field ServingLoop models, its default where not overridden)."""
    overrides = scheduler_overrides or {}
    return {option: bool(overrides.get(field, default))
            for field, (option, default) in _MODELED_FIELDS.items()}


def cross_check(workload: Workload, capacities: dict[str, Any],
                setups: Sequence[str] = DEFAULT_SETUPS, progress: bool = False,
                scheduler_overrides: dict[str, Any] | None = None, check_only: bool = False,
                **sim_kw: Any) -> dict | None:
    """Both loops on ``workload``; the rows of ``compare``, each loop's conditions and wall
    time in seconds. ``sim_kw``: more arguments both simulators take (``model``, ``gpu``,
    ``token_budget``, ``max_running``); ``scheduler_overrides``: vLLM ``SchedulerConfig``
    fields for the vLLM loop (default: vLLM's defaults). Like is compared with like:
    ServingLoop models vLLM 0.32 as shipped, and an override it models is passed to it too
    (``scheduler_reserve_full_isl`` as ``reserve_full_isl``). ``check_only``: check both runs'
    arguments (``ValueError``), run nothing, return None."""
    if check_only:
        simulate(workload, setups=setups, bound=False, check_only=True, **capacities,
                 **serving_loop_options(scheduler_overrides), **sim_kw)
        simulate(workload, setups=setups, bound=False, engine="vllm", check_only=True,
                 scheduler_overrides=scheduler_overrides, **capacities, **sim_kw)
        return None
    t0 = time.perf_counter()
    loop = simulate(workload, setups=setups, bound=False, progress=progress, **capacities,
                    **serving_loop_options(scheduler_overrides), **sim_kw)
    t1 = time.perf_counter()
    vllm = simulate(workload, setups=setups, bound=False, progress=progress,
                    engine="vllm", scheduler_overrides=scheduler_overrides, **capacities,
                    **sim_kw)
    t2 = time.perf_counter()
    rows = [compare(a, b) for a, b in zip(loop.rows, vllm.rows, strict=True)]
    return {"workload": workload.name, "requests": len(workload), "capacities": capacities,
            "conditions": vllm.conditions, "serving_loop_conditions": loop.conditions,
            "rows": rows, "wall_s": {"serving_loop": t1 - t0, "vllm": t2 - t1}}


def format_rows(result: dict) -> str:
    """One workload's rows as a fixed-width text table."""
    head = (f"{'setup':28s} {'hit loop':>9s} {'hit vllm':>9s} {'diff pt':>8s} "
            f"{'recomp loop':>12s} {'recomp vllm':>12s} {'diff':>11s} {'preempt l/v':>12s}")
    lines = [f"{result['workload']}: {result['requests']} requests, {result['capacities']}",
             head, "-" * len(head)]
    lines += [f"{r['setup']:28s} {r['loop_token_hit_rate']:9.1%} "
              f"{r['vllm_token_hit_rate']:9.1%} {r['hit_rate_diff_points']:+8.2f} "
              f"{r['loop_recomputed_tokens']:12,} {r['vllm_recomputed_tokens']:12,} "
              f"{r['recomputed_diff']:+11,} "
              f"{r['loop_preemptions']:>5,}/{r['vllm_preemptions']:<6,}" for r in result["rows"]]
    return "\n".join(lines)


def _label(result: dict) -> str:
    n = result.get("limit")
    return f"{result['name']} (first {n:,} req)" if n else result["name"]


def markdown_table(results: Sequence[dict]) -> str:
    """Every workload's rows as one markdown table, for a closing note; a hit rate difference
    over ``FINDING_POINTS`` is bold."""
    lines = ["| workload | setup | hit % ServingLoop | hit % vLLM | diff (pts) | "
             "recomputed tok ServingLoop | recomputed tok vLLM | diff (tok) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for res in results:
        for r in res["rows"]:
            d = r["hit_rate_diff_points"]
            diff = f"**{d:+.2f}**" if abs(d) > FINDING_POINTS else f"{d:+.2f}"
            lines.append(f"| {_label(res)} | {r['setup']} | {100 * r['loop_token_hit_rate']:.2f}"
                         f" | {100 * r['vllm_token_hit_rate']:.2f} | {diff} | "
                         f"{r['loop_recomputed_tokens']:,} | {r['vllm_recomputed_tokens']:,} | "
                         f"{r['recomputed_diff']:+,} |")
    return "\n".join(lines)


def _limits(items: Sequence[str], names: Sequence[str], ap: argparse.ArgumentParser) -> dict:
    """``--limit`` values as {workload: requests}: ``N`` for every shipped trace (the agent
    generator's setting is already small), ``NAME=N`` for one workload."""
    out: dict[str, int] = {}
    for item in items:
        name, _, n = item.rpartition("=")
        try:
            count = int(n)
        except ValueError:
            count = 0
        if count < 1:
            ap.error(f"--limit {item}: expected N or NAME=N with N a positive integer")
        if not name:
            out.update({w: count for w in names if w != "agent" and w not in out})
        elif name not in WORKLOADS:
            ap.error(f"--limit {item}: unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        else:
            out[name] = count
    return out


def _document(args, limits: dict, results: list[dict], wall_s: float, done: bool) -> dict:
    over = [{"workload": _label(res), "setup": r["setup"],
             "hit_rate_diff_points": r["hit_rate_diff_points"]}
            for res in results for r in res["rows"]
            if abs(r["hit_rate_diff_points"]) > FINDING_POINTS]
    return {
        "benchmark": "crosscheck", "machine": machine_info(), "complete": done,
        "command": " ".join(["python -m bench.conformance.crosscheck", *args.argv]),
        "wall_s": wall_s,
        "conditions": {
            "model": args.model, "gpu": args.gpu, "setups": args.setups,
            "token_budget": args.token_budget, "max_running": args.max_running,
            "vllm_scheduler_overrides": args.scheduler_overrides,
            "serving_loop_options": serving_loop_options(args.scheduler_overrides),
            "workloads": {name: {"capacities": WORKLOADS[name][1],
                                 "limit_requests": limits.get(name)}
                          for name in args.workloads},
            "limits_note": ("limit_requests: only the first N requests of the workload (and the "
                            "turns they lead to) ran, to fit the run on this machine; null: the "
                            "whole workload") if limits else None,
            "finding_points": FINDING_POINTS,
        },
        "over_finding_points": over, "markdown": markdown_table(results), "results": results,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    from kvtriton.sim.cost import GPUS
    from kvtriton.specs import PRESETS

    argv = list(sys.argv[1:] if argv is None else argv)
    ap = OneLineParser(prog="python -m bench.conformance.crosscheck",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--setups", nargs="+", default=list(DEFAULT_SETUPS))
    ap.add_argument("--limit", action="append", default=[], metavar="N|NAME=N",
                    help="keep only the first N requests of every shipped trace (N) or of one "
                         "workload (NAME=N); repeatable; recorded in the JSON")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--gpu", default="H100", choices=sorted(GPUS), help="cost model's GPU")
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens per step")
    ap.add_argument("--max-running", type=int, default=256, help="requests per step")
    ap.add_argument("--vllm-scheduler", action="append", default=[], metavar="FIELD=JSON",
                    help="a vLLM SchedulerConfig field for the vLLM loop, e.g. "
                         "scheduler_reserve_full_isl=false (ServingLoop then admits on the "
                         "first chunk too); repeatable; recorded in the JSON")
    ap.add_argument("--json", type=Path, default=None, help="write every row here")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.vllm_scheduler:
        field, sep, value = item.partition("=")
        try:
            overrides[field] = json.loads(value) if sep else None
        except json.JSONDecodeError:
            ap.error(f"--vllm-scheduler {item!r}: the value must be JSON (true, 1, \"x\")")
        if not sep or not field:
            ap.error(f"--vllm-scheduler {item!r}: expected FIELD=JSON")
    args.scheduler_overrides = overrides
    args.argv = argv
    limits = _limits(args.limit, args.workloads, ap)
    sim_kw = {"model": args.model, "gpu": args.gpu, "token_budget": args.token_budget,
              "max_running": args.max_running}
    t_start = time.perf_counter()
    # Every workload and both loops' arguments are checked before anything runs: a bad value
    # is one line now, not a traceback after the first workload's minutes.
    loaded = {}
    for name in args.workloads:
        make, caps = WORKLOADS[name]
        wl = make()
        n_all = len(wl)
        if name in limits:
            wl = limit_workload(wl, limits[name])
        try:
            cross_check(wl, caps, args.setups, scheduler_overrides=overrides or None,
                        check_only=True, **sim_kw)
        except (ValueError, ImportError) as e:
            ap.error(f"{name}: {e}")
        loaded[name] = (wl, caps, n_all)
    out: list[dict] = []
    for i, name in enumerate(args.workloads, 1):
        wl, caps, n_all = loaded[name]
        if not args.quiet:
            print(f"[{i}/{len(args.workloads)}] {name}: {len(wl):,} of {n_all:,} requests, "
                  f"{len(args.setups)} setups x 2 loops ({time.perf_counter() - t_start:.0f}"
                  " s so far)", file=sys.stderr, flush=True)
        res = cross_check(wl, caps, args.setups, progress=not args.quiet,
                          scheduler_overrides=overrides or None, **sim_kw)
        res.update(name=name, limit=limits.get(name), requests_in_workload=n_all)
        print(format_rows(res), flush=True)
        out.append(res)
        if args.json is not None:
            doc = _document(args, limits, out, time.perf_counter() - t_start,
                            done=i == len(args.workloads))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
            tmp.replace(args.json)  # never a half-written file if the run is stopped
            record_output(args.json)  # in the manifest when under bench/results/
    wall = time.perf_counter() - t_start
    print()
    print(markdown_table(out))
    over = [(_label(res), r["setup"], r["hit_rate_diff_points"]) for res in out
            for r in res["rows"] if abs(r["hit_rate_diff_points"]) > FINDING_POINTS]
    print(f"\nrows over {FINDING_POINTS:g} point: " + (
        "; ".join(f"{w} {p} {d:+.2f}" for w, p, d in over) if over else "none"))
    print(f"wall time {wall:.0f} s", flush=True)
    if args.json is not None:
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()
