"""Section 2's scenario: the mid-chain hole and what re-store does about it (``hole_demo.json``)."""

from __future__ import annotations

from bench.plots import plot_hole
from paper.format import machine_line
from paper.results import FIGURES, load


def hole_section(v: dict) -> None:
    doc = load("hole_demo")
    if doc is None:
        v["hole_text"] = "*Pending: `python -m bench.planner.hole_demo` has not been run.*"
        v["fig_hole"] = ""
        return
    by = {r["restore"]: r for r in doc["rows"]}
    n = doc["blocks"]
    v["hole_text"] = (
        f"In the run behind the figure ({machine_line(doc)}), a request stores its {n} blocks and "
        f"the CPU then evicts block {doc['evicted_position'] + 1}. With the cursor-only control "
        f"the next step copies {by[False]['phases']['next_step']['blocks_copied']} blocks and a "
        f"new request with the same prefix hits {by[False]['probe_hit_blocks']} of {n} blocks "
        f"({by[False]['chain_holes']} blocks sit in the CPU past the hole, unreachable); with "
        f"re-store the next step copies {by[True]['phases']['next_step']['blocks_copied']} block "
        f"and the new request hits {by[True]['probe_hit_blocks']} of {n}.")
    plot_hole(doc, FIGURES / "hole.png")
    v["fig_hole"] = "![CPU presence of a running request's blocks](figures/hole.png)"
