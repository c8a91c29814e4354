"""Tier setups as compositions of policy axes: parsing, presets, refusals, the gap column."""

from __future__ import annotations

import pytest

from kvtriton.planner import PlannerConfig
from kvtriton.setups import ABLATION, BOUNDS, TIER_POLICIES, parse_policy, tier_policy
from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.simulate import add_gap_closed, gap_closed


def test_presets_are_the_setups_they_always_were():
    bounded = PlannerConfig(restore=True, cpu_free_order="tail_first", restore_share=0.5)
    want = {
        "control": (PlannerConfig(restore=False, cpu_free_order="head_first"), "lru"),
        "restore": (PlannerConfig(restore=True, cpu_free_order="head_first"), "lru"),
        "restore_tail": (PlannerConfig(restore=True, cpu_free_order="tail_first"), "lru"),
        "restore_tail_bounded": (bounded, "lru"),
        "restore_tail_bounded_arc": (bounded, "arc"),
        "restore_tail_bounded_s3fifo": (bounded, "s3fifo"),
    }
    for name, (cfg, eviction) in want.items():
        pol = TIER_POLICIES[name]
        assert (pol.planner, pol.cpu_eviction, pol.hints, pol.oracle) == (
            cfg, eviction, False, False), name
    assert TIER_POLICIES["no_cpu"].planner is None
    assert TIER_POLICIES["control"].composition == "eager"


@pytest.mark.parametrize(("spec", "canonical"), [
    ("eager+restore+tail+arc", "eager+restore+tail+arc"),
    ("arc+tail+restore+eager", "eager+restore+tail+arc"),  # any order
    ("restore", "eager+restore"),
    ("eager+head+lru+all", "eager"),  # defaults vanish
    ("lazy+hints:0.25+s3fifo", "lazy+s3fifo+hints:0.25"),
    ("eager+restore:0.5+tail", "eager+restore:0.5+tail"),
    ("eager+second", "eager+second"),
    ("eager+inf", "eager+inf"),
])
def test_compositions_parse_to_one_canonical_name(spec, canonical):
    pol = tier_policy(spec)
    assert pol.composition == canonical
    assert tier_policy(canonical).planner == pol.planner


def test_each_axis_sets_its_own_switch():
    p = parse_policy("lazy+tail+arc+hints:0.3")
    assert (p.planner.lazy, p.planner.restore, p.planner.cpu_free_order, p.cpu_eviction,
            p.hint_protect_share) == (True, False, "tail_first", "arc", 0.3)
    p = parse_policy("eager+restore:0.25+second")
    assert (p.planner.restore_share, p.planner.admission) == (0.25, "second")
    assert parse_policy("eager+nextuse").oracle and parse_policy("eager+inf").oracle
    assert not parse_policy("eager+hints").oracle


@pytest.mark.parametrize(("spec", "named"), [
    ("eager+lfu", "'lfu'"),
    ("eager+lru+arc", "'lru' and 'arc'"),
    ("eager+lazy", "'eager' and 'lazy'"),
    ("lazy+restore", "'lazy' with 're-store'"),
    ("lazy+second", "'second'"),
    ("eager+hinted", "'hinted' admission needs 'lazy'"),
    ("hinted+restore", "'hinted'"),
    ("eager+waiting+hints", "'hints' and 'waiting'"),
    ("eager+nextuse+waiting", "'waiting' with 'nextuse'"),
    ("eager+waiting:2", "'2'"),
    ("eager+waiting+waiting:0.2", "'waiting' and 'waiting:0.2' both set the lookahead"),
    ("eager+restore:1.5", "'1.5'"),
    ("eager+hints:x", "'x'"),
    ("eager+nextuse+hints", "'hints' with 'nextuse'"),
    ("eager++tail", "''"),
    ("", "non-empty"),
    ("fancy", "'fancy'"),
])
def test_bad_compositions_name_the_value(spec, named):
    with pytest.raises(ValueError) as e:
        tier_policy(spec)
    assert named in str(e.value)


def test_the_ablation_changes_one_axis_at_a_time():
    # Each setup differs from the control ("eager") in one axis value: one more token, or the
    # store mode swapped ("lazy"). Combinations are kept apart (COMBINED).
    assert ABLATION[0] == "eager"
    for spec in ABLATION[1:]:
        parts = tier_policy(spec).composition.split("+")
        assert parts == ["lazy"] or (parts[0] == "eager" and len(parts) == 2), spec
    assert all(tier_policy(b).oracle for b in BOUNDS)


def test_gap_closed_is_the_share_of_the_control_to_bound_gap():
    assert gap_closed(0.5, 0.4, 0.6) == pytest.approx(0.5)
    assert gap_closed(0.3, 0.4, 0.6) == pytest.approx(-0.5)
    assert gap_closed(0.5, 0.4, 0.4) is None
    rows = [{"composition": "eager", "token_hit_rate": 0.2},
            {"composition": "lazy", "token_hit_rate": 0.3}]
    bounds = [{"composition": "eager+nextuse", "token_hit_rate": 0.4},
              {"composition": "lazy+nextuse", "token_hit_rate": 0.6}]
    add_gap_closed(rows, bounds)  # the bound is the better next-use run
    assert [r["gap_closed"] for r in rows + bounds] == pytest.approx([0, 0.25, 0.5, 1.0])
    lone = [{"composition": "lazy", "token_hit_rate": 0.3}]
    add_gap_closed(lone, [])
    assert lone[0]["gap_closed"] is None


def test_simulate_runs_compositions_and_the_in_loop_bounds():
    wl = agent_workload(num_conversations=4, min_turns=3, max_turns=4, seed=3)
    res = simulate(wl, gpu_tokens=8192, cpu_tokens=8192, policies=["lazy+hints", "eager+arc"])
    names = [r["policy"] for r in res.rows + res.bounds]
    assert names == ["lazy+hints", "eager+arc", "eager", "eager+nextuse", "lazy+nextuse",
                     "eager+inf"]
    every = res.rows + res.bounds
    assert all(r["finished"] == len(wl) for r in every)
    inf = next(r for r in res.bounds if r["composition"] == "eager+inf")
    assert inf["cpu_blocks"] > res.conditions["cpu_blocks"]
    assert inf["running_evictions"] == 0
    hinted = res.rows[0]
    assert sum(hinted["hints_applied"].values()) == len(wl)
    assert hinted["lazy_stored"] > 0 and hinted["stored_blocks"] > 0
    assert "gap closed" in res.table().splitlines()[0]
    off = simulate(wl, gpu_tokens=8192, cpu_tokens=8192, policies=["eager+arc"], bound=False)
    assert [r["policy"] for r in off.rows] == ["eager+arc"] and off.bounds == []
