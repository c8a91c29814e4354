"""``paper/build.py``: the comparisons its prose makes come from the results, and its
cross-references from the template's own headings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("paper_build", ROOT / "paper" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _doc(belady: float, rates: dict[str, float]) -> dict:
    rows = [{"policy": p, "composition": p, "oracle": p.endswith("nextuse"), "token_hit_rate": h}
            for p, h in rates.items()]
    return {"runs": [{"cpu_ratio": 1, "rows": rows, "cache_only_bound": {"hit_rate": belady}}]}


def test_the_bounds_sentence_follows_the_rows(build):
    below = build._bounds_intro({"agent": _doc(0.9, {"eager": 0.5, "lazy+hints": 0.8,
                                                     "eager+nextuse": 0.95})})
    assert "passed by no online setup" in below and "10.0 points" in below
    assert "`lazy+hints`" in below  # the best online setup, not the oracle row
    # An online setup above the cache-only figure: the text must say so, not "far from".
    above = build._bounds_intro({"agent": _doc(0.7, {"eager": 0.5, "lazy+hints": 0.8})})
    assert "is passed in 1 run" in above and "-10.0 points" in above


def test_section_references_follow_the_headings(build):
    template = "## 3. Evaluation\n### 3.1 Planner cost\n### 3.7 Kernels\n## 4. Limitations\n"
    assert build.section_numbers(template) == {"sec_evaluation": "3", "sec_planner": "3.1",
                                               "sec_kernels": "3.7", "sec_limitations": "4"}
    real = build.section_numbers((ROOT / "paper" / "template.md").read_text())
    assert real["sec_kernels"].startswith("3.") and real["sec_planner"] == "3.1"


def test_the_bookkeeping_sentence_compares_measured_figures(build):
    rows = [{"variant": "fused_restore", "requests": 128, "restores_per_step": 2000,
             "median_ms": 3.0, "select_median_ms": 1.0},
            {"variant": "fused_control", "requests": 128, "restores_per_step": 0,
             "median_ms": 1.0, "select_median_ms": 0.5}]
    text = build._bookkeeping({"rows": rows})
    assert "2.00 ms, more than the 1.00 ms" in text
    rows[0]["median_ms"] = 1.5
    assert "0.50 ms, less than the 1.00 ms" in build._bookkeeping({"rows": rows})
