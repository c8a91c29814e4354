"""The conversational-gap study runs end to end on a few requests per workload."""

from __future__ import annotations

import json

from bench import conversational_gap


def test_the_study_runs_on_a_tiny_limit(tmp_path):
    out = tmp_path / "gap.json"
    assert conversational_gap.main(["--quick", "--limit", "12", "--jobs", "1",
                                    "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    names = [c["candidate"] for c in doc["candidates"]]
    assert names == [c.name for c in conversational_gap.CANDIDATES]
    for c in doc["candidates"]:
        assert c["chosen"] == conversational_gap.CHOSEN[c["candidate"]]
        assert {"hypothesis", "grid", "mooncake_test_hit_rate", "agent_test_points_vs_control",
                "cc_agentic_test_points_vs_control", "target_met"} <= set(c)
    assert set(doc["anatomy"]["cache_model"]["hit_share"]) >= {"lru", "lfu", "nextuse"}
    assert doc["not_built"] and doc["conditions"]["quick"]


def test_every_grid_value_is_an_online_setup():
    from kvtriton.setups import tier_policy

    for c in conversational_gap.CANDIDATES:
        for g in c.grid:
            assert not tier_policy(g.format(lfu="lfu")).oracle, g
    for g in conversational_gap.CHOSEN.values():
        assert not tier_policy(g).oracle
