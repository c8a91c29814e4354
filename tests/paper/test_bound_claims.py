"""Claims about bounds, in the stored results and in the words: every share in a results file
is of an upper bound's headroom and at most 100%, no row passes the upper bound it is measured
against, and the paper and README call only an upper bound a bound. Each check runs on a
corrupted copy too, and must catch it."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from kvtriton.setups import UPPER_BOUND_SETUPS

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# Keys of a share of next use's gain, the old denominator that online setups pass.
RETIRED_KEYS = {"gap_closed", "judged_share", "gap_closed_test", "gap_closed_train",
                "gap_closed_strict", "train_share", "test_share", "train_gap_share_by_value",
                "mooncake_train_gap_share", "mooncake_test_gap_share"}
# "bound" in the singular names an upper bound, or is the verb ("can bound re-stores").
BOUND_WORD = re.compile(r"\bbound\b", re.IGNORECASE)
ALLOWED_BEFORE = ("upper ", "can ", "to ")
# Phrases that called next-use eviction a bound.
MISNOMERS = re.compile(r"in-loop (belady )?bound|next-use bound|belady bound|of the gap\b|"
                       r"gap closed|the bound\b", re.IGNORECASE)


def share_problems(doc, where: str = "") -> list[str]:
    """Every share over 100% of its headroom and every retired share key in ``doc``."""
    out = []
    if isinstance(doc, dict):
        for k, v in doc.items():
            at = f"{where}.{k}"
            if k in RETIRED_KEYS:
                out.append(f"{at}: a share of next use's gain")
            if "headroom_share" in k and isinstance(v, float) and v > 1 + 1e-9:
                out.append(f"{at}: {v:.3f} of the headroom")
            out += share_problems(v, at)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += share_problems(v, f"{where}[{i}]")
    return out


def passes_upper_bound(doc: dict) -> list[str]:
    """Rows of a setups file above the upper bound their run's references name, per part too."""
    out = []
    for run in doc.get("runs", []):
        refs = run.get("references") if isinstance(run, dict) else None
        if not refs:
            continue
        for r in run["rows"]:
            if r["composition"] in UPPER_BOUND_SETUPS:
                continue
            checks = [(None, r, refs)] + [(n, p, refs["parts"][n])
                                           for n, p in r.get("parts", {}).items()]
            for part, fig, ref in checks:
                bound = ref["upper_bound"]
                if bound and fig["token_hit_rate"] > bound["token_hit_rate"] + 1e-9:
                    out.append(f"{r['setup']} ({part or 'whole run'}) passes {bound['setup']}")
    return out


def wording_problems(text: str) -> list[str]:
    out = [m.group(0) for m in MISNOMERS.finditer(text)]
    for m in BOUND_WORD.finditer(text):
        before = text[max(0, m.start() - 6):m.start()].lower()
        if not before.endswith(ALLOWED_BEFORE):
            out.append(text[max(0, m.start() - 40):m.end() + 20].replace("\n", " "))
    return out


def _results() -> list[Path]:
    return sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", _results(), ids=lambda p: p.name)
def test_every_share_is_of_an_upper_bounds_headroom(path):
    doc = json.loads(path.read_text())
    assert share_problems(doc) == []
    assert passes_upper_bound(doc) == []


def test_the_result_checks_catch_a_share_over_100_and_a_row_past_its_bound():
    doc = json.loads((RESULTS / "setups_agent.json").read_text())
    bad = copy.deepcopy(doc)
    row = next(r for r in bad["runs"][0]["rows"] if r["composition"] == "eager+hints")
    row["headroom_share"] = 1.2
    assert share_problems(bad)
    bad = copy.deepcopy(doc)
    bad["runs"][0]["rows"][1]["parts"]["test"]["token_hit_rate"] = 0.999
    assert passes_upper_bound(bad)
    assert share_problems({"targets": [{"gap_closed_test": 0.3}]})


@pytest.mark.parametrize("name", ["paper/paper.md", "paper/template.md", "README.md"])
def test_only_an_upper_bound_is_called_a_bound(name):
    assert wording_problems((ROOT / name).read_text()) == []


def test_the_wording_check_catches_next_use_called_a_bound():
    assert wording_problems("closes 247% of the gap to the in-loop bound")
    assert wording_problems("next-use eviction, the bound, keeps the popular ones")
    assert wording_problems("`eager+nextuse` (bound) 87.0%")
    assert wording_problems("the unbounded tier is an upper bound") == []
