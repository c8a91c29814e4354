"""Regenerate ``paper/paper.md``, its figures and ``docs/results.md`` from ``bench/results/``.

Every number in the paper comes from a results file written by ``python -m bench``; the prose
lives in ``paper/template.md`` with ``{{name}}`` placeholders that the section formatters
(``paper/sections/``, one module a section) fill from the results files. ``INPUTS``
are the results files it reads. One that the quick run always writes (``bench/studies.py``) must
be there: the build stops with one line naming it, unless ``--allow-missing`` is given; any other
(a GPU run, a full-size run) leaves its section marked as pending. The paper lists every input
with the commit it came from and whether the tracked code was clean (``MANIFEST.json`` beside
the results, else the file's own machine block), so it always states what was and was not run.

Run: ``python paper/build.py [--allow-missing]`` (after ``make bench``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# Run as ``python paper/build.py``: the repository root goes first, for ``paper`` and ``bench``.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paper import results as paper_results
from paper.results import FIGURES, PAPER, ROOT, missing_inputs
from paper.sections.conversational_gap import conversational_gap_section
from paper.sections.decision_map import decision_map_section
from paper.sections.default_setup import default_section
from paper.sections.engine import engine_section
from paper.sections.fleet import fleet_section
from paper.sections.hole import hole_section
from paper.sections.kernels import hybrid_waste, kernel_section
from paper.sections.lfu_recency import lfu_recency_section
from paper.sections.planner import planner_section
from paper.sections.provenance import inputs_section
from paper.sections.restore_map import restore_map_section
from paper.sections.second_tier import second_tier_section
from paper.sections.setups import setups_section
from paper.sections.shares import shares_section
from paper.sections.sync_loads import sync_loads_section
from paper.sections.traces import glm5_section, replay_section
from paper.sections.vs_vllm import vs_vllm_section

# In the order they fill the template (a later one may read an earlier one's values).
SECTIONS = (inputs_section, hole_section, planner_section, vs_vllm_section, setups_section,
            decision_map_section, shares_section, conversational_gap_section,
            lfu_recency_section, restore_map_section, replay_section, glm5_section,
            kernel_section, hybrid_waste, default_section, engine_section, second_tier_section,
            fleet_section, sync_loads_section)


def section_numbers(template: str) -> dict[str, str]:
    """``sec_<first word of the title>`` for every numbered heading (``### 3.7 Kernels`` gives
    ``sec_kernels`` = ``3.7``): a cross-reference follows its section when sections move."""
    out = {}
    for num, title in re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? (\w+)", template, flags=re.M):
        out[f"sec_{title.lower()}"] = num
    return out


def build() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    v: dict[str, str] = {}
    for section in SECTIONS:
        section(v)
    template = (PAPER / "template.md").read_text()
    v.update(section_numbers(template))
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", template)) - set(v))
    if missing:
        raise SystemExit(f"paper/template.md uses values build.py does not make: {missing}")
    text = re.sub(r"\{\{(\w+)\}\}", lambda m: v[m.group(1)], template)
    # A generated value may cite a section ({{sec_...}}): one more pass fills those.
    text = re.sub(r"\{\{(sec_\w+)\}\}", lambda m: v[m.group(1)], text)
    (PAPER / "paper.md").write_text(text)
    results_page = ROOT / "docs" / "results.md"
    summary = "\n\n".join(x for x in (
        f"Abstract figures: {v['abstract_planner']}{v['abstract_vs_vllm']}; "
        f"{v['abstract_setups']}.",
        v.get("planner_table", ""), v.get("targets_text", ""),
        v.get("mooncake_claim", ""),
        "**The connector's default.** " + v.get("default_text", ""),
        "Full write-up with figures and conditions: [paper/paper.md](../paper/paper.md).") if x)
    summary = re.sub(r"\{\{(sec_\w+)\}\}", lambda m: v[m.group(1)], summary)
    body = results_page.read_text()
    new = re.sub(r"(<!-- results:begin[^>]*-->\n).*?(<!-- results:end -->)",
                 lambda m: m.group(1) + summary + "\n" + m.group(2), body, flags=re.S)
    results_page.write_text(new)
    print(f"wrote {PAPER / 'paper.md'}, figures in {FIGURES}, {results_page}")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paper/build.py", description=__doc__.splitlines()[0])
    ap.add_argument("--allow-missing", action="store_true",
                    help="build even without a results file the quick run writes (its section "
                         "says pending)")
    args = ap.parse_args(argv)
    missing = missing_inputs()
    if missing and not args.allow_missing:
        files = ", ".join(_shown(paper_results.RESULTS / f"{n}.json") for n in missing)
        raise SystemExit(f"paper/build.py: missing {files} (`make bench` writes "
                         f"{'it' if len(missing) == 1 else 'them'}; --allow-missing builds "
                         "without)")
    build()
    return 0

if __name__ == "__main__":
    sys.exit(main())
