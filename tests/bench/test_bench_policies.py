"""The policy benchmark end to end on a tiny workload: its JSON, its targets, its map."""

from __future__ import annotations

import json

from bench import bench_policies
from kvtriton.sim import agent_workload, mark_session_close


def test_ablation_and_map_write_what_the_paper_reads(tmp_path):
    wl = mark_session_close(agent_workload(num_conversations=4, min_turns=2, max_turns=3,
                                           seed=5))
    doc = bench_policies.ablation("agent", wl, 4096, ("eager", "lazy", "lazy+hints"), False,
                                  results_dir=tmp_path)
    saved = json.loads((tmp_path / "policies_agent.json").read_text())
    assert saved["targets"] == doc["targets"] and len(doc["runs"]) == len(bench_policies.RATIOS)
    for run in doc["runs"]:
        comps = [r["composition"] for r in run["rows"]]
        assert comps == ["eager", "lazy", "lazy+hints", "eager+nextuse", "lazy+nextuse",
                         "eager+inf"]
        control = run["rows"][0]
        assert control["gap_closed"] in (0.0, None)
        assert run["cache_only_bound"]["hit_rate"] >= 0
    for t in doc["targets"]:
        assert t["bound"] in ("eager+nextuse", "lazy+nextuse")
        if t["no_gap"]:
            assert t["met"] is None and t["bound_hit_rate"] <= t["control_hit_rate"] + 1e-9
        else:
            assert t["met"] == bool(t["gap_closed"] is not None and t["gap_closed"] >= 0.25)

    m = bench_policies.restore_map("agent", True, False, results_dir=tmp_path,
                                   grid=(wl, 4096, (1, 2), (2, 8)))
    assert set(m["gain"]) == set(bench_policies.MAP_FORMS)
    for form, grid in m["gain"].items():
        for i in range(2):
            for j in range(2):
                assert grid[i][j] == m["hit_rate"][form][i][j] - m["hit_rate"]["eager"][i][j]
    assert (tmp_path / "restore_map_agent.png").stat().st_size > 0


def test_best_online_skips_oracles_and_slower_setups():
    rows = [{"composition": "eager", "oracle": False, "gap_closed": 0.0,
             "ttft_p50_s": 1.0, "ttft_p90_s": 2.0},
            {"composition": "lazy", "oracle": False, "gap_closed": 0.5,
             "ttft_p50_s": 1.5, "ttft_p90_s": 2.0},  # slower: not eligible
            {"composition": "eager+arc", "oracle": False, "gap_closed": 0.1,
             "ttft_p50_s": 0.9, "ttft_p90_s": 2.0},
            {"composition": "eager+nextuse", "oracle": True, "gap_closed": 1.0,
             "ttft_p50_s": 0.5, "ttft_p90_s": 1.0}]
    assert bench_policies.best_online(rows)["composition"] == "eager+arc"
    assert bench_policies.best_online(rows[:2]) is None
    # A setup that ties the control closes nothing: it is no best setup (it was reported as
    # the best, at 0%, when every setup that closed some gap had a worse TTFT).
    tie = {"composition": "eager+restore", "oracle": False, "gap_closed": 0.0,
           "ttft_p50_s": 1.0, "ttft_p90_s": 2.0}
    assert bench_policies.best_online([rows[0], tie, rows[1]]) is None
