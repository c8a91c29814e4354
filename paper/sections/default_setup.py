"""The connector's default setup and the rule that picks it."""

from __future__ import annotations

from paper.format import md_table
from paper.results import load, not_run


def default_section(v: dict) -> None:
    """The connector's default and the rule that picks it; the build stops if the results no
    longer pick ``kvtriton.setups.DEFAULT_SETUP``."""
    from kvtriton.setups import CONTROL, DEFAULT_SETUP

    got = load("default_setup")
    if got is None:
        v["default_text"] = f"*Pending: `default_setup.json` is {not_run('default_setup.json')}.*"
        return
    if got["setup"] != DEFAULT_SETUP:
        raise SystemExit(f"paper/build.py: the results choose {got['setup']!r} as the "
                         f"connector's default, kvtriton.setups.DEFAULT_SETUP is "
                         f"{DEFAULT_SETUP!r}: the evidence moved (python -m "
                         f"bench.tier_study.default_setup)")
    def pts(x: float | None) -> str:
        return "-" if x is None else f"{x:+.2f}"

    rows = [[f"`{r['setup']}`" + (" **(default)**" if r["setup"] == DEFAULT_SETUP else ""),
             str(r["cells"]), ", ".join(r["workloads"]), pts(r["worst_points"]),
             pts(r["mean_points"]), "yes" if r["eligible"] else "no", pts(t["worst_points"]),
             pts(t["mean_points"])]
            for r, t in zip(got["table"], got["test"], strict=True)]
    best = got["table"][0]
    verdict = (
        "No candidate gains on one workload without losing on another, so the default is the "
        "control itself, vLLM's own connector's behaviour; a user who knows the workload turns "
        "on the setup the study found for it (hints on coding agents, Section {{sec_what}})."
        if DEFAULT_SETUP == CONTROL else
        f"`{best['setup']}` loses nothing in any train part it ran in (worst "
        f"{best['worst_points']:+.2f} points, mean {best['mean_points']:+.2f}); on the test "
        f"parts its worst is {got['test'][0]['worst_points']:+.2f} points and its mean "
        f"{got['test'][0]['mean_points']:+.2f}.")
    v["default_text"] = (
        f"A connector started without a `setup` runs `{DEFAULT_SETUP}`. The candidates are the "
        "setups it runs with nothing from the client or the scheduler (no hints, no waiting-"
        f"queue lookahead, no oracle); the rule: {got['rule']}, over the {got['cells']} cells "
        "(workload x CPU capacity) of the setup study (`bench/tier_study/default_setup.py`). "
        + verdict
        + " A first form of the rule, asking for two workloads, chose `eager+arc` from four "
        "cells; measured on the other workloads it lost points, and the rule asks for every "
        "workload since. The rule reads the train part of each run (Section {{sec_which}}); "
        "the last two columns are the same setups on the test part."
        + ("" if not got["skipped"] else
           " Left out of the choice, written before the split: "
           + ", ".join(f"`{n}`" for n in got["skipped"]) + ".") + "\n\n"
        + md_table(["setup", "train cells", "workloads", "train worst (points)",
                  "train mean (points)", "eligible", "test worst (points)",
                  "test mean (points)"], rows))
