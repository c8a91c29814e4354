"""What the setup study concludes from its rows (``findings`` of ``setups_<tag>.json`` and
``restore_map_<tag>.json``, written with them by ``bench.tier_study.setups``).

Per setups file: its workload's names in the paper's words; per run (CPU capacity) how far the
best online setup stays below the cache-only Belady figure, and what each online signal adds
over the setup it changes; per capacity the decision map's cell (the workload's traits, the
setup chosen on the train part and its gain on the test part). For the GLM-5 trace, the load
it runs at. Per re-store map: where each form gains and loses.
"""

from __future__ import annotations

from bench.choice import figures
from bench.tier_study.study import best_online
from kvtriton.setups import CONTROL
from kvtriton.sim.splits import TEST

# The names of a results file's workload (``setups_<key>``; ``_full``: a ``--full`` run, the
# whole traces and a larger generator): (in a sentence, in a table cell).
LABELS = {"agent": ("agent generator", "agent"),
          "cc_agentic": ("coding-agent traces (first turns)", "coding agent"),
          "mooncake": ("Mooncake trace", "Mooncake"),
          "glm5": ("GLM-5 prefill trace", "GLM-5"),
          "agent_full": ("agent generator (full size)", "agent_full"),
          "cc_agentic_full": ("coding-agent traces (whole)", "cc_agentic_full"),
          "mooncake_full": ("Mooncake trace (every setup)", "mooncake_full"),
          "glm5_full": ("GLM-5 prefill trace (every setup)", "glm5_full")}
# The workloads by their generator or trace, whatever the run's size.
WORKLOAD_NAMES = {"agent": "agent generator", "cc_agentic": "coding-agent traces",
                  "mooncake": "Mooncake trace", "glm5": "GLM-5 prefill trace"}

# Each online signal against the setup it changes: (with the signal, without).
SIGNAL_PAIRS = (("lazy+hints", "lazy"), ("lazy+hinted", "lazy"),
                ("lazy+hinted+hints", "lazy+hints"), ("eager+hints", "eager"),
                ("eager+second", "eager"), ("eager+waiting", "eager"),
                ("eager+refresh", "eager"), ("eager+arc", "eager"),
                ("eager+s3fifo", "eager"), ("eager+refresh+arc", "eager+arc"))
# Candidates that joined the ablation after their test-part gains had been seen (the
# conversational-gap study recorded Mooncake's test half at 41f4b4d and 5fb9556; they joined at
# c97a823, 37 minutes after the first): each target is also judged without them.
LATE_CANDIDATES = ("eager+lfu:64", "eager+lfu:64+waiting")
# A re-store map's cell counts as a gain or a loss beyond this share of hit rate (0.1 point).
MAP_NOISE = 0.001


def findings(name: str, doc: dict) -> dict:
    if name.startswith("restore_map_"):
        return restore_map_findings(doc)
    key = name.removeprefix("setups_")
    label, short = LABELS.get(key, (key, key))
    out = {"label": label, "short_label": short,
           "runs": [_run_findings(run) for run in doc["runs"]],
           "map_cells": _map_cells(doc, short),
           "without_late": [_without_late(run, t) for run, t in
                            zip(doc["runs"], doc.get("targets", []), strict=False)]}
    if key.split("_")[0] == "glm5":
        out["serving_load"] = glm5_load()
    return out


def _run_findings(run: dict) -> dict:
    rows = run["rows"]
    by = {r["setup"]: r for r in rows}
    cob = run.get("cache_only_bound")
    # Rows given oracle closes know the future too: not online.
    online = [r for r in rows if not r["oracle"] and r.get("hint_source") != "oracle closes"]
    below = None
    if cob and online:
        best = max(online, key=lambda r: r["token_hit_rate"])
        below = {"points": 100 * (cob["hit_rate"] - best["token_hit_rate"]),
                 "setup": best["setup"]}
    pairs = [*SIGNAL_PAIRS, *((r["setup"], r["composition"]) for r in rows
                              if r.get("hint_source") == "oracle closes")]
    gains = [{"setup": a, "over": b,
              "points": 100 * (by[a]["token_hit_rate"] - by[b]["token_hit_rate"])}
             for a, b in pairs if a in by and b in by]
    return {"cpu_ratio": run["cpu_ratio"], "best_online_below_cache_only": below,
            "signal_gains": gains}


def _without_late(run: dict, t: dict) -> dict | None:
    """The target judged again with ``LATE_CANDIDATES`` left out of the choice, where the best
    setup is one of them (None elsewhere): the train choice without them and its test gain."""
    if t["best"] not in LATE_CANDIDATES:
        return None
    rows = [r for r in run["rows"] if r["composition"] not in LATE_CANDIDATES]
    choose_on = None if t["chosen_on"] == "whole run" else t["chosen_on"]
    judge_on = None if t["judged_on"] == "whole run" else t["judged_on"]
    best = best_online(rows, t["ttft_tolerance_s"], choose_on)
    gain = None if best is None else figures(best, judge_on)["gain_points"]
    return {"cpu_ratio": t["cpu_ratio"], "left_out": list(LATE_CANDIDATES),
            "best": best["setup"] if best else None, "judged_gain_points": gain,
            "target_points": t["target_points"],
            "met": None if t["no_gap"] else bool(gain is not None
                                                 and gain >= t["target_points"])}


def _map_cells(doc: dict, short: str) -> list[dict]:
    """One decision-map cell per CPU capacity of a run with a split and traits: the traits, the
    setup chosen on the train part and its figures on the test part."""
    traits = doc.get("traits")
    if not traits or not doc.get("split"):
        return []
    cells = []
    for run, t in zip(doc["runs"], doc["targets"], strict=True):
        ratio = run["cpu_ratio"]
        control = next(r for r in run["rows"] if r["composition"] == CONTROL)
        control_test = figures(control, TEST)
        best = next((r for r in run["rows"] if r["setup"] == t["best"]), None)
        test = None if best is None else 100 * (
            figures(best, TEST)["token_hit_rate"] - control_test["token_hit_rate"])
        cells.append({
            "label": f"{short} {ratio}x", "ratio": ratio,
            "within_gpu": traits["reuse"]["within"]["gpu"],
            "within_tier": traits["reuse"]["within"][f"gpu+cpu {ratio}x"],
            "turns": traits["turns_per_session"], "continue": traits["continue_share"],
            "hinted": traits["continue_share"] > 0,
            "queue_p50_s": control_test.get("queue_delay_p50_s", control["ttft_p50_s"]),
            "queue_measured": "queue_delay_p50_s" in control_test,
            "oracle_gain_points": t["oracle_gain_points"], "no_gap": t["no_gap"],
            "winner": t["best"], "train_points": t.get("gain_points_train"),
            "test_points": test, "test_headroom_share": t.get("judged_headroom_share")})
    return cells


def glm5_load() -> dict:
    """The GLM-5 prefill trace and the load it runs at, from the trace and the cost model (its
    time scale was fixed so, before any tier ran on it): its span in the trace's own time, and
    the share of the modeled GPU's time its prompts' prefill would take with no cache."""
    from kvtriton.sim.cost import CostModel
    from kvtriton.sim.workloads import GLM5_TIME_SCALE, serving_workload

    wl, _ = serving_workload("glm5")
    span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
    busy = sum(CostModel.named().prefill_s(r.prompt_len, 0) for r in wl.requests)
    return {"requests": len(wl), "trace_span_s": span / GLM5_TIME_SCALE,
            "time_scale": GLM5_TIME_SCALE, "prefill_share": busy / span}


def restore_map_findings(doc: dict) -> dict:
    """Per re-store form: the cells where it gains or loses more than ``MAP_NOISE`` of hit rate
    over eager stores, its best and worst cell and the cell of most re-store thrash, each as
    ``[value, max_running, cpu_ratio]``."""
    tag = doc.get("tag") or doc["benchmark"].removeprefix("restore_map_")
    ratios, running = doc["ratios"], doc["max_running"]
    forms = {}
    for form, grid in doc["gain"].items():
        cells = [[grid[i][j], running[i], ratios[j]] for i in range(len(running))
                 for j in range(len(ratios))]
        thrash = doc["restore_thrash"][form]
        forms[form] = {
            "cells": len(cells), "gains": sum(c[0] > MAP_NOISE for c in cells),
            "losses": sum(c[0] < -MAP_NOISE for c in cells),
            "best": max(cells), "worst": min(cells),
            "most_thrash": max([thrash[i][j], running[i], ratios[j]]
                               for i in range(len(running)) for j in range(len(ratios)))}
    return {"label": WORKLOAD_NAMES.get(tag, tag), "noise": MAP_NOISE, "forms": forms}
