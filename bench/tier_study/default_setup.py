"""The connector's default setup, chosen from the study's results by a written rule.

A user who turns the connector on without naming a setup has not characterised their workload:
their clients may send no hints, and vLLM's stock scheduler shows the connector no waiting
queue. So the candidates are the setups the connector runs that need neither: no hints, no
waiting-queue lookahead, no oracle (``candidate``). The evidence is every cell (workload x CPU
capacity) of the setup study's JSONs (``SETUP_FILES``, those present). A candidate's score is
its worst hit-rate change against the control (``eager``: vLLM's connector) over every cell it
was measured in; it must have been measured on every workload of the evidence and in at least
``MIN_CELLS`` cells (an uncharacterised workload may be any of them). The default is the best
score, ties broken by the mean change: the setup that gains most where it gains least. The
control scores 0 everywhere, so the default never loses to vLLM's behaviour on the evidence.

(A first form of the rule asked for ``MIN_WORKLOADS`` workloads only. It chose ``eager+arc``
from four cells of two workloads; measured on the other two, it lost 0.35 points on the
coding-agent cut and 0.17 on Mooncake. Every workload is asked for since.)

The rule reads the *train* part of each run's split (``bench.tier_study.study.SPLITS``: Mooncake's
time halves, the other workloads' session sets), and the choice is then reported on the *test* part
(``held_out``): the default is never its own evidence. A results file written before the splits
(no ``parts`` in its rows) is left out of the choice and named.

``python -m bench.tier_study.default_setup`` prints the table and the choice and writes them to
``default_setup.json`` with the connector's current default; it exits 1, and ``paper/build.py``
stops, when the choice differs from ``kvtriton.setups.DEFAULT_SETUP`` (the evidence moved).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, OneLineParser, write_result
from kvtriton.setups import CONTROL

SETUP_FILES = ("setups_agent.json", "setups_cc_agentic.json",
                "setups_cc_agentic_full.json", "setups_mooncake.json", "setups_glm5.json")
MIN_CELLS = 4


def candidate(composition: str) -> bool:
    """Whether the connector runs ``composition`` with nothing from the client or the
    scheduler: a CPU tier, no hints (nor ``hinted`` admission, which reads them), no lookahead,
    no oracle."""
    from kvtriton.setups import parse_setup

    p = parse_setup(composition)
    return (p.planner is not None and not p.oracle and not p.hints and not p.lookahead
            and p.planner.admission != "hinted")


def cells(results_dir: Path = RESULTS_DIR, part: str | None = None,
          skipped: list[str] | None = None) -> list[dict[str, Any]]:
    """Per (setup file, CPU ratio): the workload and each setup's hit-rate change against the
    control, in points, over the whole run or (``part``: ``"train"``, ``"test"``) over that
    part of its split. With ``part``, a file whose rows have no parts is left out and its name
    appended to ``skipped``."""
    out = []
    for name in SETUP_FILES:
        path = Path(results_dir) / name
        if not path.exists():
            continue
        doc = json.loads(path.read_text())
        if part is not None and not all("parts" in r for run in doc["runs"]
                                        for r in run["rows"]):
            if skipped is not None:
                skipped.append(name)
            continue
        for run in doc["runs"]:
            # A row given oracle closes shares its composition with the causal one.
            rows = {r["composition"]: r if part is None else r["parts"][part]
                    for r in run["rows"] if r.get("hint_source") != "oracle closes"}
            if CONTROL not in rows:
                raise ValueError(f"{path}: CPU x{run['cpu_ratio']} has no {CONTROL!r} row")
            base = rows[CONTROL]["token_hit_rate"]
            out.append({"file": name, "workload": doc["workload"].split(" ")[0],
                        "cpu_ratio": run["cpu_ratio"], "part": part,
                        "gain_points": {c: 100 * (r["token_hit_rate"] - base)
                                        for c, r in rows.items()}})
    return out


def held_out(choice: dict[str, Any], test: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row of ``choice["table"]`` (the rule run on the train part) as measured on the
    ``test`` cells: worst and mean change there, in points."""
    out = []
    for r in choice["table"]:
        g = [c["gain_points"][r["setup"]] for c in test if r["setup"] in c["gain_points"]]
        out.append({"setup": r["setup"], "cells": len(g),
                    "worst_points": min(g) if g else None,
                    "mean_points": sum(g) / len(g) if g else None})
    return out


def choose_on_train(results_dir: Path = RESULTS_DIR) -> dict[str, Any]:
    """The rule on the train parts, with each candidate's figures on the test parts
    (``test``, in the order of ``table``) and the files left out (``skipped``)."""
    skipped: list[str] = []
    got = choose(cells(results_dir, "train", skipped))
    got["test"] = held_out(got, cells(results_dir, "test"))
    got["skipped"] = skipped
    got["rule"] += "; chosen on the train part of every run, reported on its test part"
    return got


def choose(evidence: list[dict[str, Any]]) -> dict[str, Any]:
    """The rule (module docstring) over ``cells``: the chosen setup and every candidate's
    score."""
    table: dict[str, dict[str, Any]] = {}
    for cell in evidence:
        for comp, gain in cell["gain_points"].items():
            if not candidate(comp):
                continue
            t = table.setdefault(comp, {"setup": comp, "gains": [], "workloads": set()})
            t["gains"].append(gain)
            t["workloads"].add(cell["file"].removeprefix("setups_").removesuffix(".json")
                               .removesuffix("_full"))
    every = {cell["file"].removeprefix("setups_").removesuffix(".json").removesuffix("_full")
             for cell in evidence}
    rows = []
    for t in table.values():
        g = t["gains"]
        rows.append({"setup": t["setup"], "cells": len(g), "workloads": sorted(t["workloads"]),
                     "worst_points": min(g), "mean_points": sum(g) / len(g),
                     "eligible": len(g) >= MIN_CELLS and t["workloads"] == every})
    rows.sort(key=lambda r: (r["eligible"], r["worst_points"], r["mean_points"]), reverse=True)
    eligible = [r for r in rows if r["eligible"]]
    if not eligible:
        raise ValueError(f"no candidate was measured in {MIN_CELLS} cells covering every "
                         "workload: run python -m bench --only setups")
    return {"setup": eligible[0]["setup"], "table": rows, "cells": len(evidence),
            "workloads": sorted(every),
            "rule": f"worst hit-rate change against {CONTROL} over the cells measured (on every "
                    f"workload, at least {MIN_CELLS} cells), ties by the mean"}


def main(argv: list[str] | None = None) -> int:
    from kvtriton.setups import DEFAULT_SETUP

    ap = OneLineParser(prog="python -m bench.tier_study.default_setup",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                    help="where the setup study's files are, and where to write")
    args = ap.parse_args(argv)
    got = choose_on_train(args.results_dir)
    print(f"{'':28s} {'train':>21s}   {'test':>13s}")
    print(f"{'setup':28s} {'cells':>5s} {'worst':>7s} {'mean':>7s}   {'worst':>6s} {'mean':>6s}")
    for r, t in zip(got["table"], got["test"], strict=True):
        flag = "" if r["eligible"] else "  (not measured on every workload)"
        test = ("   " + " ".join(f"{x:+6.2f}" for x in (t["worst_points"], t["mean_points"]))
                if t["cells"] else "")
        print(f"{r['setup']:28s} {r['cells']:5d} {r['worst_points']:+7.2f} "
              f"{r['mean_points']:+7.2f}{test}{flag}")
    if got["skipped"]:
        print(f"left out (written before the train/test split): {', '.join(got['skipped'])}")
    same = got["setup"] == DEFAULT_SETUP
    print(f"rule: {got['rule']}; chosen {got['setup']!r}; kvtriton.setups.DEFAULT_SETUP is "
          f"{DEFAULT_SETUP!r}" + ("" if same else ": they differ"))
    path = write_result("default_setup", {**got, "connector_default": DEFAULT_SETUP,
                                          "agrees": same}, args.results_dir)
    print(f"wrote {path}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
