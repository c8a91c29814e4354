"""The protected shares tuned on train, judged on test (``tune_shares.json``)."""

from __future__ import annotations

from paper.format import machine_line
from paper.results import load


def shares_section(v: dict) -> None:
    """The protected shares tuned on the train part, judged on the test part
    (``bench/tier_study/tune_shares.py``; optional: a study run by name)."""
    doc = load("tune_shares")
    if doc is None:
        v["shares_text"] = ("The protected share of `hints` and `waiting` is 0.5 throughout, fixed "
                            "before any result; tuning it on a train part is a study by name "
                            "(`python -m bench --only tune_shares`), not run for these results.")
        return
    lines = []
    for tag, w in doc["workloads"].items():
        for r in w["setups"]:
            grid = ", ".join(f"{g['share']:g}: {g['train_points']:+.2f}" for g in r["grid"])
            lines.append(
                f"- {doc['findings']['labels'][tag]}, `{r['setup']}`: train gains over the control "
                f"by share ({grid} points); chosen {r['chosen_share']:g}, which gains "
                f"{r['chosen_test_points']:+.2f} points on the test part against "
                f"{r['fixed_test_points']:+.2f} at the fixed {r['fixed_share']:g} "
                f"({r['tuning_gain_test_points']:+.2f} from tuning).")
    v["shares_text"] = (
        "The protected share of `hints` and `waiting` is 0.5 in every other figure, fixed before "
        "any result. Tuned on the train part (`bench/tier_study/tune_shares.py`, shares "
        + ", ".join(f"{x:g}" for x in doc["shares"]) + f"; rule: {doc['rule']}; "
        f"{machine_line(doc)}):\n\n" + "\n".join(lines))
