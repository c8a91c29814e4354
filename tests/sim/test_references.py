"""What a setup is measured against (``kvtriton.sim.references``): gains in points, shares of
an upper bound's headroom only, references chosen per part; and, on real runs of the loop, that
the upper bounds bound while next-use eviction does not."""

from __future__ import annotations

import pytest

from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.references import add_references, headroom_share
from kvtriton.sim.splits import split_named


def _row(comp: str, whole: float, train: float, test: float, oracle: bool = False) -> dict:
    return {"composition": comp, "oracle": oracle, "token_hit_rate": whole,
            "parts": {"train": {"token_hit_rate": train}, "test": {"token_hit_rate": test}}}


def test_headroom_share_is_the_share_of_control_to_upper_bound():
    assert headroom_share(0.5, 0.4, 0.6) == pytest.approx(0.5)
    assert headroom_share(0.3, 0.4, 0.6) == pytest.approx(-0.5)
    assert headroom_share(0.5, 0.4, 0.4) is None
    # Under 2 points of headroom no share is given (it would magnify noise).
    assert headroom_share(0.39, 0.40, 0.419) is None


def test_references_are_chosen_per_part_and_the_tighter_bound_wins():
    rows = [_row("eager", 0.20, 0.20, 0.20), _row("lazy", 0.30, 0.25, 0.35),
            _row("eager+nextuse", 0.40, 0.50, 0.30, True),
            _row("lazy+nextuse", 0.38, 0.30, 0.46, True),
            _row("eager+inf", 0.70, 0.60, 0.80, True)]
    refs = add_references(rows, {"hit_rate": 0.60})
    # The whole run's upper bound is the cache-only Belady here (tighter than the tier's).
    assert refs["upper_bound"] == {"setup": "belady (cache-only, GPU + CPU)",
                                   "token_hit_rate": 0.60}
    assert refs["oracle_reference"]["setup"] == "eager+nextuse"
    # On the test part the other next-use row is the better; a part's bound is the tier's.
    assert refs["parts"]["test"]["oracle_reference"]["setup"] == "lazy+nextuse"
    assert refs["parts"]["train"]["oracle_reference"]["setup"] == "eager+nextuse"
    assert refs["parts"]["test"]["upper_bound"]["token_hit_rate"] == 0.80
    lazy = rows[1]
    assert lazy["gain_points"] == pytest.approx(10.0)
    assert lazy["headroom_share"] == pytest.approx(0.10 / 0.40)
    assert lazy["parts"]["test"]["gain_points"] == pytest.approx(15.0)
    assert lazy["parts"]["test"]["headroom_share"] == pytest.approx(0.15 / 0.60)
    # The unbounded tier has more memory than the tighter bound: no share of its own.
    assert rows[4]["headroom_share"] is None and rows[4]["gain_points"] == pytest.approx(50.0)


def test_no_control_or_no_bound_gives_no_figure():
    lone = [_row("lazy", 0.3, 0.3, 0.3)]
    add_references(lone)
    assert lone[0]["gain_points"] is None and lone[0]["headroom_share"] is None
    rows = [_row("eager", 0.2, 0.2, 0.2), _row("lazy", 0.3, 0.3, 0.3)]
    refs = add_references(rows)
    assert refs["upper_bound"] is None and rows[1]["gain_points"] == pytest.approx(10.0)
    assert rows[1]["headroom_share"] is None


# The online setups most likely to pass a reference: frequency, hints, lookahead, lazy stores.
ONLINE = ["none", "eager", "lazy", "eager+lfu:64", "eager+hints", "lazy+hints",
          "eager+lfu:64+waiting", "eager+restore:0.5+tail", "eager+s3fifo"]


@pytest.mark.parametrize("seed,gpu,ratio", [(0, 4096, 1), (1, 4096, 4), (3, 4096, 2)])
def test_no_online_setup_passes_an_upper_bound_on_any_part(seed, gpu, ratio):
    """Each upper bound bounds every online setup, whole run and part by part, so no headroom
    share passes 100%; the negative control: next-use eviction is no such bound, and this test
    would have caught calling it one (an online setup passes it in one of these runs)."""
    wl = agent_workload(num_conversations=8, min_turns=3, max_turns=6, seed=seed)
    res = simulate(wl, gpu_tokens=gpu, cpu_tokens=ratio * gpu, setups=ONLINE,
                   parts=split_named("sessions", wl))
    upper = res.references["upper_bound"]["token_hit_rate"]
    for r in res.rows:
        assert r["token_hit_rate"] <= upper + 1e-9, r["setup"]
        assert r["headroom_share"] is None or r["headroom_share"] <= 1 + 1e-9
        for name, part in r["parts"].items():
            bound = res.references["parts"][name]["upper_bound"]["token_hit_rate"]
            assert part["token_hit_rate"] <= bound + 1e-9, (r["setup"], name)
            assert part["headroom_share"] is None or part["headroom_share"] <= 1 + 1e-9


def test_next_use_eviction_is_passed_by_an_online_setup():
    """Why next use is an oracle reference and not a bound: on this run `lazy` hits more than
    both next-use rows (65.6% against 64.1%), so a share of next use's gain would pass 100%."""
    wl = agent_workload(num_conversations=8, min_turns=3, max_turns=6, seed=0)
    res = simulate(wl, gpu_tokens=4096, cpu_tokens=4096, setups=ONLINE)
    oracle = res.references["oracle_reference"]["token_hit_rate"]
    passing = [r["setup"] for r in res.rows if r["token_hit_rate"] > oracle + 1e-9]
    assert passing, "no online setup passed next-use eviction on this run"
