"""Which CPU tier design wins, where, and how far from its references: the setup ablation and
the re-store map.

- ``setups_<tag>.json`` (``setups_<tag>_full.json`` with ``--full``): every setup of
  ``bench.tier_study.study.ABLATION`` (each axis changed alone from the control) plus the
  references run in the same loop (``REFERENCES``: next-use eviction, an oracle reference; the
  unbounded tier, an upper bound), at a CPU tier the size of the GPU and at four times that, on
  the agent generator, the shipped coding-agent traces and the shipped Mooncake trace. Every
  row carries ``gain_points`` (token hit-rate points over the control) and ``headroom_share``
  (its share of the headroom to the tightest upper bound at the same memory,
  ``kvtriton.sim.references``). ``targets`` records, per capacity, the best online setup whose
  modeled TTFT p50 and p90 are no worse than the control's, against the targets: a gain of 25%
  of the points the oracle reference gains (10% on Mooncake and on the GLM-5 prefill sample,
  traces without hints).
- ``restore_map_<tag>.json``: the gain of ``eager+restore`` and of its bounded form over
  ``eager`` (token hit-rate points) over the CPU/GPU capacity ratio and the number of running
  requests, with a heat map (``restore_map_<tag>.png``): the agent generator and the
  coding-agent traces (their first ``MAP_CC_TURNS`` turns per session without ``--full``), and
  with ``--full`` (or ``--maps mooncake``) the Mooncake trace.

Run: ``python -m bench.tier_study.setups [--full] [--only ablation|map] [--quiet]``. Without
``--full`` (quick, the ``make bench`` size on 2 cores): the agent generator's quick workload runs
the whole ablation and the hinted combinations (``HINTED_COMBINED``) at both capacities; the
coding-agent traces, cut to their first ``tier_study.QUICK_CC_TURNS`` turns per session, and
the whole GLM-5 sample run ``QUICK_TRACE_SETS`` at ``QUICK_RATIOS``; the maps are small grids
(``map_grid``). The whole Mooncake trace's quick ablation (``QUICK_TRACE_SETS``, CPU 1x) is
not in the default set (``QUICK_WORKLOADS``): ``--workloads mooncake`` runs it. ``--full``
runs the whole ablation plus ``COMBINED`` on the whole traces, every workload, at both
capacities and larger maps; ``--ratios`` overrides the capacities. Simulations run in parallel,
one process per core.
"""

from __future__ import annotations

import time
from collections import Counter

from bench.choice import figures
from bench.common import OneLineParser, write_result
from bench.tier_study.setup_findings import findings
from bench.tier_study.study import (
    ABLATION,
    COMBINED,
    HINTED_COMBINED,
    SPLIT_TEXT,
    SPLITS,
    best_online,
    cc_agentic_with_closes,
    run_all,
    slim,
    ttft_ok,
    ttft_tolerance_s,
    workloads,
)
from kvtriton.setups import CONTROL, REFERENCES, tier_setup
from kvtriton.sim import Workload, agent_workload
from kvtriton.sim.metrics import format_table
from kvtriton.sim.references import add_references
from kvtriton.sim.splits import TEST, TRAIN, split_named
from kvtriton.sim.trace_stats import reuse_profile
from kvtriton.sim.workloads import first_turns

RATIOS = (1, 4)
# The smallest gain of the oracle reference over the control (points of token hit rate) against
# which a target is judged.
MATERIAL_GAP_POINTS = 2.0
# GLM-5's prefill sample is judged as Mooncake is: open-loop traffic with no hints.
TARGETS = {"agent": 0.25, "cc_agentic": 0.25, "mooncake": 0.10, "glm5": 0.10}
# Without --full the coding-agent cut runs at CPU = GPU only: at 4x the tier holds every block
# of the cut (no gap to close). Mooncake too: each of its runs takes half a minute to a minute
# and a half on 2 cores, and its target is judged at CPU = GPU; --full adds 4x.
QUICK_RATIOS = {"agent": RATIOS, "cc_agentic": (1,), "mooncake": (1,), "glm5": (1,)}
# The ablations of the quick run (make bench). Mooncake's, the longest (its eight simulations of
# the whole trace were 285 of the quick run's 827 simulation-seconds, measured on 2 cores), runs
# by name (``python -m bench --only mooncake_ablation``, the same file at the same size), so
# that make bench stays under ten minutes.
QUICK_WORKLOADS = ("agent", "cc_agentic", "glm5")
# Without --full the shipped traces run a subset, to keep make bench short: the
# control, the bounded re-store, the signals of section 3.3 and vLLM 0.33's own connector
# (kvtriton.setups.NATIVE_SETUPS); on Mooncake (no hints, and each run a minute on 2 cores)
# only the admission, recency, waiting-queue and session signals and the native connector. Both
# run the
# connector's default (kvtriton.setups.DEFAULT_SETUP), so the rule that picks it
# (bench/tier_study/default_setup.py) sees it on every workload. The agent
# generator runs the whole ablation either way; --full runs it everywhere.
QUICK_TRACE_SETS = {
    "cc_agentic": ("eager", "eager+restore:0.5", "eager+arc", "eager+reqlru", "eager+reqarc",
                   "eager+lfu:64", "eager+second", "eager+refresh+arc", "eager+hints",
                   "eager+waiting", "eager+sessions", "eager+lfu:64+waiting",
                   "eager+lfu:64+sessions", "lazy", "lazy+hints", "lazy+hinted+hints"),
    "mooncake": ("eager", "eager+arc", "eager+reqlru", "eager+reqarc", "eager+lfu:64",
                 "eager+second", "eager+refresh+arc", "eager+waiting", "eager+sessions",
                 "eager+lfu:64+waiting"),
}
# The GLM-5 sample has what Mooncake has (no hints; sessions only as inferred): Mooncake's set.
QUICK_TRACE_SETS["glm5"] = QUICK_TRACE_SETS["mooncake"]


#: Without --full, the references a workload runs when not all of ``REFERENCES``: Mooncake's
#: quick set has eager stores only, whose oracle reference is ``eager+nextuse``, and the
#: unbounded tier, whose parts bound the test part's headroom; --full runs them all.
QUICK_REFERENCES = {"mooncake": ("eager+nextuse", "eager+inf"),
                    "glm5": ("eager+nextuse", "eager+inf")}


ORACLE_CLOSES = " [oracle closes]"


def reads_hints(composition: str) -> bool:
    """Whether a setup reads hints (the ``hints`` axis or ``hinted`` admission)."""
    p = tier_setup(composition)
    return p.hints or (p.planner is not None and p.planner.admission == "hinted")


def workload_traits(wl: Workload, gpu_tokens: int, ratios: tuple[int, ...]) -> dict:
    """What a reader of the decision map needs of a workload, from the workload alone: how far
    apart its prompt blocks are reused against the GPU and the GPU + CPU capacities
    (``reuse_profile``), turns per session, and the share of requests a server is given a
    ``continue`` hint for."""
    caps = {"gpu": gpu_tokens, **{f"gpu+cpu {r}x": (1 + r) * gpu_tokens for r in ratios}}
    turns = Counter(wr.session.split("/")[0] for wr in wl if wr.session is not None)
    return {"reuse": reuse_profile(wl, caps),
            "sessions": len(turns),
            "turns_per_session": sum(turns.values()) / len(turns) if turns else None,
            "continue_share": sum(wr.hint == "continue" for wr in wl) / len(wl)}


def ablation_tasks(wl: Workload, gpu_tokens: int, setups: tuple[str, ...],
                   ratios: tuple[int, ...] = RATIOS, oracle_wl: Workload | None = None,
                   split: str | None = None,
                   references: tuple[str, ...] = REFERENCES) -> list[tuple]:
    """The simulations of ``ablation`` (``tier_study.run_all`` tasks): one per (capacity,
    setup), so that every core stays busy; the control's task also brings the cache-only
    Belady bound."""
    tasks = []
    hinted = [p for p in setups if reads_hints(p)] if oracle_wl is not None else []
    parts = split_named(split, wl) if split is not None else None
    for ratio in ratios:
        cap = {"gpu_tokens": gpu_tokens, "cpu_tokens": ratio * gpu_tokens, "parts": parts}
        for p in dict.fromkeys((CONTROL, *setups, *references)):
            control = p == CONTROL
            tasks.append(((ratio, p), wl, {**cap, "setups": [p], "bound": control,
                                           "references": ()}))
        tasks += [((ratio, p + ORACLE_CLOSES), oracle_wl,
                   {**cap, "setups": [p], "bound": False, "references": ()})
                  for p in hinted]
    return tasks


def ablation(tag: str, wl: Workload, gpu_tokens: int, setups: tuple[str, ...],
             progress: bool, results_dir=None, ratios: tuple[int, ...] = RATIOS,
             name: str | None = None, oracle_wl: Workload | None = None,
             split: str | None = None, references: tuple[str, ...] = REFERENCES,
             results: dict | None = None, wall_s: float | None = None) -> dict:
    """``setups`` and the references at each CPU/GPU ratio of ``ratios``; writes
    ``<name>.json`` (default ``setups_<tag>``). With ``oracle_wl`` (``wl`` with session
    closes), every hinted setup also runs on it, as a row named ``<setup> [oracle closes]``
    that no target or best setup counts; every hinted row says its ``hint_source``.

    ``split`` (``kvtriton.sim.splits.split_named``): every row also reports the train and test
    parts; each target's best setup is then chosen on the train part and judged on the test
    part (``gain_points_train``, ``judged_gain_points``), as is ``met``. ``references``: the
    references to run (default all of ``REFERENCES``). ``results``: the ``ablation_tasks``
    results by key when the caller ran them (with other studies' tasks in one pool; ``wall_s``
    is then that pool's time), else they are run here."""
    t0 = time.perf_counter()
    hinted = [p for p in setups if reads_hints(p)] if oracle_wl is not None else []
    if results is None:
        results = run_all(ablation_tasks(wl, gpu_tokens, setups, ratios, oracle_wl, split,
                                          references), progress, tag)
    runs, targets = [], []
    for ratio in ratios:
        control = results[(ratio, CONTROL)]
        online = [slim(results[(ratio, p)]["rows"][0]) for p in dict.fromkeys(
            (CONTROL, *setups))]
        for row in online:
            if reads_hints(row["composition"]):
                row["hint_source"] = "causal" if oracle_wl is not None else "as given"
        for p in hinted:
            row = slim(results[(ratio, p + ORACLE_CLOSES)]["rows"][0])
            row.update(setup=p + ORACLE_CLOSES, hint_source="oracle closes")
            online.append(row)
        oracles = [slim(results[(ratio, p)]["rows"][0]) for p in references]
        conditions, cache_only = control["conditions"], control["bound"]
        rows = online + oracles
        refs, target = judge_run(tag, ratio, rows, cache_only, ttft_tolerance_s(conditions),
                                 split)
        targets.append(target)
        runs.append({"cpu_ratio": ratio, "cpu_tokens": ratio * gpu_tokens,
                     "conditions": conditions, "rows": rows, "cache_only_bound": cache_only,
                     "references": refs})
        print(f"\n{tag}: GPU {gpu_tokens:,} tokens, CPU {ratio}x")
        print(format_table(rows))
        t = targets[-1]
        verdict = (f"next-use gains {t['oracle_gain_points']:.1f} points, under "
                   f"{MATERIAL_GAP_POINTS:g}: not judged" if t["no_gap"]
                   else "met" if t["met"] else "missed")
        where = "" if split is None else f" on {TEST} (chosen on {TRAIN})"
        gain = t["judged_gain_points"]
        print(f"best online: {t['best']}: {gain or 0:+.1f} points{where}; target "
              f"{t['target_points']:+.1f} ({t['target']:.0%} of next use's "
              f"{t['oracle_gain_points']:+.1f}): {verdict}")
    payload = {"workload": wl.name, "requests": len(wl), "gpu_tokens": gpu_tokens,
               "ratios": list(ratios), "setups": list(setups), "references": list(references),
               "split": split, "split_text": SPLIT_TEXT.get(split),
               "traits": workload_traits(wl, gpu_tokens, ratios),
               "runs": runs, "targets": targets,
               "wall_s": time.perf_counter() - t0 if wall_s is None else wall_s}
    path = write_result(name or f"setups_{tag}", payload, results_dir, findings)
    print(f"wrote {path}")
    return payload


def judge_run(tag: str, ratio: int, rows: list[dict], cache_only: dict | None,
              tolerance: float, split: str | None) -> tuple[dict, dict]:
    """One capacity's references and target from its rows (``add_references`` sets every
    row's ``gain_points`` and ``headroom_share``) and its cache-only Belady result; also marks
    each row's ``ttft_no_worse`` (within ``tolerance`` of the control's) and
    ``ttft_no_worse_strict``. Pure: a stored run's rows give the same judgment again."""
    refs = add_references(rows, cache_only)
    control = next(r for r in rows if r["composition"] == CONTROL)
    for r in rows:
        r["ttft_no_worse"] = ttft_ok(r, control, tolerance)
        r["ttft_no_worse_strict"] = ttft_ok(r, control)
    return refs, _target(tag, ratio, rows, refs, tolerance, split)


def _target(tag: str, ratio: int, rows: list[dict], refs: dict, tolerance: float,
            split: str | None) -> dict:
    """The target of one capacity: the best online setup (``best_online``), chosen on the train
    part and judged on the test part when the rows have them, else on the whole run. The target
    asks for ``TARGETS[tag]`` of the points the oracle reference (the better next-use row on the
    judged part) gains over the control (``target_points``); the gain's share of the headroom
    to the upper bound is reported beside it. No target is judged where the oracle gains under
    ``MATERIAL_GAP_POINTS`` (a loss of 1.5 points against a 0.4-point gain is noise against
    noise)."""
    choose_on, judge_on = (TRAIN, TEST) if split is not None else (None, None)
    best = best_online(rows, tolerance, choose_on)
    strict = best_online(rows, 0.0, choose_on)
    control = next(r for r in rows if r["composition"] == CONTROL)
    ref = refs if judge_on is None else refs["parts"][judge_on]
    oracle, upper = ref["oracle_reference"], ref["upper_bound"]
    oracle_points = 100 * (oracle["token_hit_rate"]
                           - figures(control, judge_on)["token_hit_rate"])
    no_gap = oracle_points < MATERIAL_GAP_POINTS
    judged = None if best is None else figures(best, judge_on)
    need = TARGETS[tag] * oracle_points
    t = {"cpu_ratio": ratio, "target": TARGETS[tag], "target_points": need,
         "best": best["setup"] if best else None,
         "gain_points": best["gain_points"] if best else None,
         "judged_gain_points": judged["gain_points"] if judged else None,
         "judged_headroom_share": judged["headroom_share"] if judged else None,
         "ttft_tolerance_s": tolerance,
         "best_strict": strict["setup"] if strict else None,
         "gain_points_strict": figures(strict, judge_on)["gain_points"] if strict else None,
         "met": None if no_gap else bool(judged is not None
                                         and judged["gain_points"] >= need),
         "no_gap": no_gap, "oracle_gain_points": oracle_points,
         "material_gap_points": MATERIAL_GAP_POINTS,
         "control_hit_rate": figures(control, judge_on)["token_hit_rate"],
         "oracle_reference": oracle["setup"], "oracle_hit_rate": oracle["token_hit_rate"],
         "upper_bound": upper["setup"] if upper else None,
         "upper_bound_hit_rate": upper["token_hit_rate"] if upper else None,
         "chosen_on": choose_on or "whole run", "judged_on": judge_on or "whole run"}
    if split is not None:
        train = None if best is None else figures(best, TRAIN)
        t["gain_points_train"] = None if train is None else train["gain_points"]
        t["headroom_share_train"] = None if train is None else train["headroom_share"]
    return t


MAP_FORMS = ("eager+restore", "eager+restore:0.5")


def map_grid(tag: str, quick: bool) -> tuple[Workload, int, tuple, tuple]:
    """The re-store map's workload, GPU tokens, CPU/GPU ratios and ``max_running`` values."""
    if tag == "agent":
        if quick:
            # 16 conversations never run more than 16 requests at once: a larger max_running
            # repeats the 16 row (measured: 64 gave the same cells), so the quick map stops there;
            # at CPU 4x re-store changed under a point (make bench's time; --full has 4x and 8x).
            return (agent_workload(num_conversations=16, min_turns=4, max_turns=8, seed=1),
                    16_384, (0.5, 1, 2), (4, 16))
        return (agent_workload(num_conversations=48, min_turns=6, max_turns=20, seed=1), 65_536,
                (0.25, 0.5, 1, 2, 4, 8), (4, 16, 64, 256))
    if tag == "cc_agentic":
        cc = cc_agentic_with_closes()
        if quick:
            return first_turns(cc, MAP_CC_TURNS), 262_144, (0.5, 1, 2), (4, 16)
        return cc, 262_144, (0.5, 1, 2, 4), (4, 16, 64)
    wl, gpu, _ = workloads(quick)[tag]
    return wl, gpu, (1, 4), (16, 256)


#: The ablation workloads, longest simulations first (the order their tasks enter the pool).
LONGEST_FIRST = ("mooncake", "glm5", "cc_agentic", "agent")

#: The maps ``make bench`` draws; ``--full`` adds the Mooncake trace.
QUICK_MAPS = ("agent", "cc_agentic")
FULL_MAPS = ("agent", "cc_agentic", "mooncake")
MAP_CC_TURNS = 6


def map_tasks(grid: tuple[Workload, int, tuple, tuple]) -> list[tuple]:
    """The simulations of ``restore_map`` over ``grid`` (``map_grid``'s form)."""
    wl, gpu, ratios, running = grid
    return [((i, j, f), wl, {"gpu_tokens": gpu, "cpu_tokens": int(ratio * gpu),
                             "max_running": mr, "setups": [f], "bound": False})
            for i, mr in enumerate(running) for j, ratio in enumerate(ratios)
            for f in (CONTROL, *MAP_FORMS)]


def restore_map(tag: str, quick: bool, progress: bool, results_dir=None, grid=None,
                results: dict | None = None, wall_s: float | None = None) -> dict:
    """Gain of each re-store form over eager stores on workload ``tag``, over the CPU/GPU ratio
    and ``max_running``; writes ``restore_map_<tag>.json`` and ``.png``. ``grid``:
    ``(workload, gpu_tokens, ratios, max_running)`` instead of ``map_grid``'s. ``results`` and
    ``wall_s``: as ``ablation`` takes them, for ``map_tasks(grid)``."""
    from bench.common import RESULTS_DIR, record_output
    from bench.plots import plot_restore_map

    grid = grid if grid is not None else map_grid(tag, quick)
    wl, gpu, ratios, running = grid
    t0 = time.perf_counter()
    forms = (CONTROL, *MAP_FORMS)
    if results is None:
        results = run_all(map_tasks(grid), progress, f"re-store map {tag}")
    hit = {f: [[0.0] * len(ratios) for _ in running] for f in forms}
    thrash = {f: [[0] * len(ratios) for _ in running] for f in MAP_FORMS}
    for (i, j, f), res in results.items():
        row = res["rows"][0]
        hit[f][i][j] = row["token_hit_rate"]
        if f in thrash:
            thrash[f][i][j] = row["restore_thrash"]
    gain = {f: [[hit[f][i][j] - hit[CONTROL][i][j] for j in range(len(ratios))]
                for i in range(len(running))] for f in MAP_FORMS}
    payload = {"tag": tag, "workload": wl.name, "requests": len(wl), "gpu_tokens": gpu,
               "ratios": list(ratios), "max_running": list(running), "hit_rate": hit,
               "gain": gain, "restore_thrash": thrash,
               "wall_s": time.perf_counter() - t0 if wall_s is None else wall_s}
    path = write_result(f"restore_map_{tag}", payload, results_dir, findings)
    record_output(plot_restore_map(payload,
                                   (results_dir or RESULTS_DIR) / f"restore_map_{tag}.png"))
    print(f"wrote {path}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.tier_study.setups",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--full", action="store_true", help="whole traces, larger map")
    ap.add_argument("--only", choices=("ablation", "map"), default=None)
    ap.add_argument("--workloads", default=None,
                    help="comma-separated ablation workloads (agent, cc_agentic, mooncake, glm5; "
                         "default: all with --full, QUICK_WORKLOADS without)")
    ap.add_argument("--ratios", default=None,
                    help="comma-separated CPU/GPU capacity ratios for the ablation (default: "
                         "1,4; without --full the shipped traces run 1 only)")
    ap.add_argument("--maps", default=None,
                    help="comma-separated re-store maps (default: agent,cc_agentic; with "
                         "--full also mooncake)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    quick = not args.full
    progress = not args.quiet
    tags = [t.strip() for t in args.workloads.split(",") if t.strip()] if args.workloads \
        else list(TARGETS if args.full else QUICK_WORKLOADS)
    unknown = [t for t in tags if t not in TARGETS]
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(map(repr, unknown))}; known: "
                 f"{', '.join(TARGETS)}")
    try:
        ratios_arg = tuple(int(x) for x in args.ratios.split(",")) if args.ratios else None
    except ValueError:
        ap.error(f"--ratios: expected comma-separated positive ints, got {args.ratios!r}")
    if ratios_arg is not None and (not ratios_arg or min(ratios_arg) < 1):
        ap.error(f"--ratios: expected comma-separated positive ints, got {args.ratios!r}")
    maps = [t.strip() for t in args.maps.split(",") if t.strip()] if args.maps \
        else list(FULL_MAPS if args.full else QUICK_MAPS)
    if bad := [t for t in maps if t not in FULL_MAPS]:
        ap.error(f"--maps: unknown {', '.join(map(repr, bad))}; known: {', '.join(FULL_MAPS)}")
    studies = []  # (kind, tag, arguments, tasks)
    if args.only in (None, "ablation"):
        wls = workloads(quick)
        for tag in tags:
            wl, gpu, oracle_wl = wls[tag]
            if not quick:
                setups = ABLATION + COMBINED
            else:
                setups = ABLATION + HINTED_COMBINED if tag == "agent" \
                    else QUICK_TRACE_SETS[tag]
            ratios = ratios_arg or (QUICK_RATIOS[tag] if quick else RATIOS)
            # --full runs other workloads (the whole traces, a larger generator): their own file.
            name = f"setups_{tag}" if quick else f"setups_{tag}_full"
            references = QUICK_REFERENCES.get(tag, REFERENCES) if quick else REFERENCES
            kw = {"ratios": ratios, "oracle_wl": oracle_wl, "split": SPLITS[tag],
                  "references": references}
            studies.append(("ablation", tag, (wl, gpu, setups, name, kw),
                            ablation_tasks(wl, gpu, setups, **kw)))
    if args.only in (None, "map"):
        for tag in maps:
            grid = map_grid(tag, quick)
            studies.append(("map", tag, grid, map_tasks(grid)))
    # Every simulation in one pool, the longest studies' first: one pool per study left a core
    # idle at the end of each.
    studies.sort(key=lambda s: LONGEST_FIRST.index(s[1]) if s[0] == "ablation"
                 else len(LONGEST_FIRST))
    t0 = time.perf_counter()
    results = run_all([((n, key), wl, kw) for n, (*_, tasks) in enumerate(studies)
                        for key, wl, kw in tasks], progress, "tier study")
    wall = time.perf_counter() - t0
    mine = [{} for _ in studies]
    for (n, key), res in results.items():
        mine[n][key] = res
    out = {}
    for (kind, tag, arguments, _), res in zip(studies, mine, strict=True):
        if kind == "ablation":
            wl, gpu, setups, name, kw = arguments
            out[name] = ablation(tag, wl, gpu, setups, progress, name=name, results=res,
                                 wall_s=wall, **kw)
        else:
            out[f"restore_map_{tag}"] = restore_map(tag, quick, progress, grid=arguments,
                                                    results=res, wall_s=wall)
    return out


if __name__ == "__main__":
    main()
