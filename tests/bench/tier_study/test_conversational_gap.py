"""The conversational-gap study runs end to end on a few requests per workload."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tier_study import conversational_gap


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
    from kvtriton.setups import tier_setup

    for c in conversational_gap.CANDIDATES:
        for g in c.grid:
            assert not tier_setup(g.format(lfu="lfu")).oracle, g
    for g in conversational_gap.CHOSEN.values():
        assert not tier_setup(g).oracle


def _cache_model_loop(seqs, capacity, rule, lookahead=0):
    """The one-cache model, one block at a time: the reference for the vectorized one."""
    n, half = len(seqs), (len(seqs) + 1) // 2
    nxt_of = conversational_gap._next_uses(seqs)
    resident: list[int] = []  # in the order cached
    count: dict[int, float] = {}
    last: dict[int, int] = {}
    nxt: dict[int, int] = {}
    hits, total, seen = [0, 0], [0, 0], 0
    for r, s in enumerate(seqs):
        keys = s.tolist()
        if not keys:
            continue
        part = int(r >= half)
        hit = 0
        while hit < len(keys) and keys[hit] in resident:
            hit += 1
        hits[part] += hit
        total[part] += len(keys)
        for k, after in zip(keys, nxt_of[r].tolist(), strict=True):
            count[k] = count.get(k, 0) + 1
            last[k], nxt[k] = r, after
        seen += len(keys)
        if rule == "lfu" and seen >= 16 * capacity:
            count = {k: c * 0.5 for k, c in count.items()}
            seen //= 2
        resident += [k for k in keys if k not in resident]
        rank = {k: last[k] if rule == "lru" else count[k] * n + last[k] if rule == "lfu"
                else -nxt[k] if rule == "nextuse"
                else 2 * n - nxt[k] if nxt[k] - r <= lookahead else last[k] for k in resident}
        while len(resident) > capacity:
            pos = min(range(len(resident)), key=lambda i: (rank[resident[i]], -i))
            resident.pop(pos)
    return [round(h / t, 4) if t else 0.0 for h, t in zip(hits, total, strict=True)]


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 12), max_size=6, unique=True), max_size=14),
       capacity=st.integers(1, 8), rule=st.sampled_from(["lru", "lfu", "nextuse", "lookahead"]),
       lookahead=st.integers(0, 4))
def test_the_cache_model_matches_a_loop_with_its_tie_order(seqs, capacity, rule, lookahead):
    # The tie order is part of the model: NumPy's argpartition left it to the NumPy version.
    seqs = [np.array(s, dtype=np.int64) for s in seqs]
    got = conversational_gap._cache_model(seqs, conversational_gap._next_uses(seqs), capacity,
                                          rule, lookahead)
    assert got == _cache_model_loop(seqs, capacity, rule, lookahead)
