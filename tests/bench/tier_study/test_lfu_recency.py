"""Where frequency-first eviction loses (``bench/tier_study/lfu_recency.py``): the sequential-chat
shape shows it on a seed its sizes were not chosen on, and the study's miss-only setting counts only
the keys past a request's GPU prefix hit, leaving the planner as it was once closed."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.tier_study import lfu_recency
from kvtriton.eviction.lfu import LFUQueue
from kvtriton.planner.planner import OffloadPlanner
from kvtriton.planner.stores import Stores
from kvtriton.sim import simulate
from kvtriton.sim.workload import agent_workload
from kvtriton.sim.workloads import SEQUENTIAL_CHAT, WORKLOADS, load_workload

HELD_OUT = SEQUENTIAL_CHAT.seed + 1


def _rows(wl, setups, **kw):
    res = simulate(wl, setups=setups, bound=False, references=(),
                   **WORKLOADS["chat"].capacities(), **kw)
    return {r["setup"]: r for r in res.rows}


def test_frequency_loses_to_recency_on_a_held_out_seed():
    """The real engine's finding, in the simulator: on sequential chat, ``lfu:64`` evicts the
    live conversation's blocks (running requests' CPU copies) to keep a finished one's."""
    wl = agent_workload(replace(SEQUENTIAL_CHAT, seed=HELD_OUT))
    rows = _rows(wl, ["eager", "eager+lfu:64"])
    eager, lfu = rows["eager"], rows["eager+lfu:64"]
    assert eager["cpu_hit_tokens"] > 0
    assert lfu["cpu_hit_tokens"] < 0.5 * eager["cpu_hit_tokens"]
    assert lfu["running_evictions"] > 2 * eager["running_evictions"]


def test_the_chat_name_is_the_shape():
    a, b = load_workload("chat"), agent_workload(SEQUENTIAL_CHAT)
    assert len(a) == len(b)
    assert all(np.array_equal(x.hashes, y.hashes) and x.request_id == y.request_id
               for x, y in zip(a, b, strict=True))


def test_miss_only_counts_the_keys_past_the_gpu_hit(monkeypatch):
    seen: list[int] = []
    on_request = LFUQueue.on_request

    def spy(self, keys):
        seen.append(len(keys))
        return on_request(self, keys)

    monkeypatch.setattr(LFUQueue, "on_request", spy)
    wl = agent_workload(replace(SEQUENTIAL_CHAT, num_conversations=4, seed=HELD_OUT))
    _rows(wl, ["eager+lfu:64"])
    every = list(seen)
    seen.clear()
    lookup, admit = OffloadPlanner.get_num_new_matched_tokens, Stores.admit
    with lfu_recency.miss_only():
        _rows(wl, ["eager+lfu:64"])
    assert OffloadPlanner.get_num_new_matched_tokens is lookup and Stores.admit is admit
    # Same requests admitted; each counts at most its keys, and in all far fewer (the shared
    # system prompt and the history the GPU still holds are not counted).
    assert len(seen) == len(every)
    assert all(m <= a for m, a in zip(seen, every, strict=True))
    assert sum(seen) < 0.5 * sum(every)


def test_the_summary_judges_held_out_seeds_only():
    def rows(cpu):
        return {p: {"cpu_hit_tokens": cpu[p], "running_evictions": 1}
                for p in cpu}

    setups = (*lfu_recency.CHAT_SETUPS, *lfu_recency.REFERENCES)
    results = {}
    for seed, lfu in ((1, 500), (2, 10), (3, 30)):  # seed 1 chose the sizes: not judged
        results[(f"chat/{seed}", "all")] = rows({p: (lfu if "lfu" in p else 100) for p in setups})
        results[(f"chat/{seed}", "miss_only")] = rows(
            {p: 100 for p in lfu_recency.MISS_ONLY_SETUPS})
    s = lfu_recency.summarise(results, [1, 2, 3], 1)
    assert s["held_out_seeds"] == [2, 3] and s["control_cpu_hit_tokens"] == 200
    assert s["cpu_hit_share_of_control"]["eager+lfu:64"] == 40 / 200
    assert s["cpu_hit_share_of_control"]["eager+lfu:64 (miss only)"] == 1.0
    assert s["lfu_loses"]


def test_a_change_is_adopted_only_if_it_recovers_and_keeps_the_gain_on_train():
    def row(train, test):
        return {"parts": {"train": {"token_hit_rate": train}, "test": {"token_hit_rate": test}}}

    study = {"cc_agentic": {"eager+lfu:64": row(0.60, 0.60), "eager+lfu:4": row(0.595, 0.50),
                            "eager+lfu:64 (miss only)": row(0.55, 0.60),
                            "eager+lfu:4 (miss only)": row(0.60, 0.60)}}
    summary = {"cpu_hit_share_of_control": {"eager+lfu:4": 0.95, "eager+lfu:64 (miss only)": 1.0,
                                            "eager+lfu:4 (miss only)": 0.5}}
    got = {v["change"]: v for v in lfu_recency.verdicts(summary, study)}
    # Recovers and keeps the gain on train (0.5 points down): adopted, though test loses 10.
    assert got["eager+lfu:4"]["adopt"] and not got["eager+lfu:4"]["keeps_gain"]["test"]
    assert got["eager+lfu:4"]["points_vs_lfu64"]["test"] == {"cc_agentic": -10.0}
    assert not got["eager+lfu:64 (miss only)"]["adopt"]  # 5 points down on train
    assert not got["eager+lfu:4 (miss only)"]["adopt"]  # does not recover the chat hits


def test_the_study_runs_end_to_end_on_small_workloads(monkeypatch, tmp_path):
    """``main`` on a small chat shape and one small study workload writes every section the
    paper reads (the chat seeds' keys and the study's keys differ in shape)."""
    import json

    from bench.tier_study import study
    from kvtriton.sim import without_closes

    small = replace(SEQUENTIAL_CHAT, num_conversations=4)
    wl = without_closes(agent_workload(num_conversations=6, min_turns=2, max_turns=4, seed=2))
    monkeypatch.setattr(lfu_recency, "chat_shape", lambda: small)
    monkeypatch.setattr(lfu_recency, "STUDY_WORKLOADS", ("agent",))
    monkeypatch.setattr(lfu_recency, "study_workloads", lambda: {"agent": (wl, 4096, None)})
    monkeypatch.setitem(study.SPLITS, "agent", "sessions")
    out = tmp_path / "lfu_recency.json"
    assert lfu_recency.main(["--seeds", "1", "--quiet", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert sorted(doc["chat"]) == [str(small.seed), str(small.seed + 1)]
    assert set(doc["study_workloads"]["agent"]) == {
        "eager", "eager+lfu:64", "eager+lfu:4", "eager+lfu:64 (miss only)",
        "eager+lfu:4 (miss only)"}
    assert [v["change"] for v in doc["verdicts"]] == [c for c, _, _ in lfu_recency.CHANGES]
    assert doc["summary"]["held_out_seeds"] == [small.seed + 1]


def test_bad_seed_count_is_one_line(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        lfu_recency.main(["--seeds", "0"])
    assert e.value.code == 2
    assert "--seeds 0" in capsys.readouterr().err
