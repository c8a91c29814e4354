"""``paper/build.py``: the comparisons its prose makes come from the results, and its
cross-references from the template's own headings."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

import paper.results
from bench.planner import scaling
from bench.tier_study import lfu_recency as lfu_study
from bench.tier_study.setup_findings import findings as setup_findings
from bench.vllm.engine_findings import findings as engine_findings
from bench.vllm.vs_vllm_findings import findings as vs_vllm_findings
from paper import build
from paper.sections import default_setup, engine, lfu_recency, planner, setups, vs_vllm

ROOT = Path(__file__).resolve().parents[2]


def _doc(belady: float, rates: dict[str, float]) -> dict:
    rows = [{"setup": p, "composition": p, "oracle": p.endswith("nextuse"), "token_hit_rate": h}
            for p, h in rates.items()]
    doc = {"runs": [{"cpu_ratio": 1, "rows": rows, "cache_only_bound": {"hit_rate": belady}}]}
    return _found(doc)


def _found(doc: dict) -> dict:
    """``doc`` with the setup study's findings, as the study writes them."""
    doc["findings"] = setup_findings("setups_agent", doc)
    return doc


def test_the_bounds_sentence_follows_the_rows():
    below = setups._bounds_intro({"agent": _doc(0.9, {"eager": 0.5, "lazy+hints": 0.8,
                                                     "eager+nextuse": 0.95})})
    assert "passed by no online setup" in below and "10.0 points" in below
    assert "`lazy+hints`" in below  # the best online setup, not the oracle row
    # An online setup above the cache-only figure: the text must say so, not "far from".
    above = setups._bounds_intro({"agent": _doc(0.7, {"eager": 0.5, "lazy+hints": 0.8})})
    assert "is passed in 1 run" in above and "-10.0 points" in above
    # A row given oracle closes knows the future: it is not the best online setup.
    doc = _doc(0.9, {"eager": 0.5, "lazy+hints": 0.7, "lazy+hints [oracle closes]": 0.85})
    doc["runs"][0]["rows"][2]["hint_source"] = "oracle closes"
    closes = setups._bounds_intro({"agent": _found(doc)})
    assert "`lazy+hints`" in closes and "20.0 points" in closes and "oracle" not in closes


def test_section_references_follow_the_headings():
    template = "## 3. Evaluation\n### 3.1 Planner cost\n### 3.7 Kernels\n## 4. Limitations\n"
    assert build.section_numbers(template) == {"sec_evaluation": "3", "sec_planner": "3.1",
                                               "sec_kernels": "3.7", "sec_limitations": "4"}
    real = build.section_numbers((ROOT / "paper" / "template.md").read_text())
    assert real["sec_kernels"].startswith("3.") and real["sec_planner"] == "3.1"


def test_the_bookkeeping_sentence_compares_measured_figures():
    rows = [{"variant": "fused_restore", "requests": 128, "restores_per_step": 2000,
             "median_ms": 3.0, "select_median_ms": 1.0},
            {"variant": "fused_control", "requests": 128, "restores_per_step": 0,
             "median_ms": 1.0, "select_median_ms": 0.5}]
    doc = {"rows": rows}
    text = planner._bookkeeping({"findings": scaling.findings("planner", doc)})
    assert "2.00 ms, more than the 1.00 ms" in text
    rows[0]["median_ms"] = 1.5
    assert "0.50 ms, less than the 1.00 ms" in planner._bookkeeping(
        {"findings": scaling.findings("planner", doc)})


def test_the_build_stops_when_the_evidence_picks_another_default(monkeypatch):
    import kvtriton.setups

    v: dict[str, str] = {}
    default_setup.default_section(v)
    assert f"runs `{kvtriton.setups.DEFAULT_SETUP}`" in v["default_text"]
    monkeypatch.setattr(kvtriton.setups, "DEFAULT_SETUP", "eager+second")
    with pytest.raises(SystemExit, match="the evidence moved"):
        default_setup.default_section({})


def test_the_engine_section_states_each_target(monkeypatch):
    run = {"requests": 3, "prompt_tokens": 900,
           "cost_fit": {"prefill_ms_per_1k_tokens": 100.0, "decode_step_ms": 5.0, "r2": 0.97,
                        "samples": 40},
           "measured": [{"system": s, "token_hit_rate": 0.5, "cpu_hit_tokens": 64,
                         "ttft_p50_s": t, "ttft_p90_s": 2 * t, "output_tokens_per_s": 9.0,
                         "stored_blocks": 4, "loaded_blocks": 1}
                        for s, t in (("none", 0.3), ("eager", 0.2))],
           "rows": [{"system": "none", "hit_rate_engine": 0.5, "hit_rate_sim": 0.52,
                     "hit_points_off": 2.0, "ttft_p50_engine_s": 0.3, "ttft_p50_sim_s": 0.33,
                     "ttft_p50_rel_off": 0.1},
                    {"system": "eager", "hit_rate_engine": 0.5, "hit_rate_sim": 0.5,
                     "hit_points_off": 0.0, "ttft_p50_engine_s": 0.2, "ttft_p50_sim_s": 0.2,
                     "ttft_p50_rel_off": 0.0}],
           "targets": {"hit_rate_within_1_point": False, "ttft_p50_same_order": True,
                       "ttft_p50_within_20pct": True},
           "ttft_order_engine": ["eager", "none"], "ttft_order_sim": ["eager", "none"]}
    doc = {"machine": {"cpu": "x", "cpu_cores": 2, "gpu": None, "git_sha": "abc", "torch": "2",
                       "triton": "3", "date_utc": "today"},
           "conditions": {"vllm": "0.32.0", "backend": "cpu", "model": {"random_llama": {
               "num_layers": 4, "hidden_size": 256}}, "block_tokens": 64, "gpu_blocks": 48,
               "cpu_ratio": 1.0, "max_num_batched_tokens": 1024, "max_num_seqs": 16,
               "time_scale": 0.05, "max_output_tokens": 16},
           "targets": {"hit_rate_points": 1.0, "ttft_p50_rel": 0.2}, "runs": {"agent": run}}
    doc["findings"] = engine_findings("vllm_engine", doc)
    monkeypatch.setattr(engine, "load", lambda name: doc if name == "vllm_engine" else None)
    v: dict[str, str] = {}
    engine.engine_section(v)
    text = v["engine_text"]
    assert "**missed** (worst 2.0)" in text and "same order met" in text
    assert "100 ms per 1,000 prefill tokens" in text and "| `eager` | 50.0% | 50.0% |" in text
    assert "out-of-sample prediction has not been run" in v["prediction_text"]

    # The out-of-sample file: every clock's miss per system beside the engine's own range.
    predict = copy.deepcopy(doc)
    predict["conditions"]["repeats"] = 3
    for m in predict["runs"]["agent"]["measured"]:
        m["ttft_p50_s_range"] = [0.9 * m["ttft_p50_s"], 1.1 * m["ttft_p50_s"]]
        m["token_hit_rate_range"] = [0.49, 0.51]
    oos_rows = [dict(r, ttft_p50_sim_s=0.4, ttft_p50_rel_off=0.4 / r["ttft_p50_engine_s"] - 1)
                for r in predict["runs"]["agent"]["rows"] if r["system"] != "none"]
    predict["runs"]["agent"]["out_of_sample"] = {
        "fit_on_none": {"rows": oos_rows}, "fit_on_cc_agentic": {"skipped": "few steps"}}
    predict["findings"] = engine_findings("vllm_predict", predict)
    monkeypatch.setattr(engine, "load", lambda name: predict if name == "vllm_predict" else doc)
    text = engine.prediction_text()
    assert "| `eager` | 50.0% (49.0%-51.0%) | 50.0% (+0.0) | 0.200 (0.180-0.220) | 0.200 (+0%) " \
        "| 0.400 (+100%) |" in text
    assert "| `none` |" in text and "| fit on none |" in text
    assert "fit on cc_agentic" not in text  # a skipped fit has no column
    assert "fit on none 100%" in text and "widest range is 20%" in text


def test_the_vs_vllm_section_reports_the_same_process_run(monkeypatch, tmp_path):
    """Section 3.1's comparison with vLLM: vLLM's version, the machine and commit, the rows at
    the targets' sizes, every size's whole step, every verdict and, for a missed one, the parts
    that grew come from ``vs_vllm.json``; none is typed."""
    parts = ["lookup", "tables", "selection", "cpu_alloc", "listeners", "pin", "adapter", "meta"]
    rows = [{"variant": v, "requests": r, "blocks_per_request": 2048, "median_ms": ms,
             "x_vs_vllm_control": 1.3 / ms,
             "parts_ms": {**dict.fromkeys(parts, 0.125), "selection": 0.125 + ms / 4}}
            for r in (16, 128) for v, ms in (("vllm_control", 1.3), ("kvt_fused_restore", 2.6))]
    doc = {"machine": {"cpu": "x", "cpu_cores": 2, "gpu": None, "git_sha": "abc123",
                       "torch": "2", "triton": "3", "date_utc": "today", "vllm": "0.32.0"},
           "settings": {"vllm": "0.32.0", "blocks_per_request": [2048], "block_tokens": 16,
                        "evict_fraction": 0.01, "steps": 20, "parts": parts,
                        "grouped": [{"requests": 128, "blocks_per_request": 2048}],
                        "max_blocks_held": 100},
           "rows": rows,
           "targets": [{"name": "fused_restore_over_vllm_control", "requests": 128,
                        "blocks_per_request": 2048, "value": 2.0, "target": "<= 1",
                        "met": False, "measure": "per-step time"}]}
    doc["findings"] = vs_vllm_findings("vs_vllm", doc)
    for module in (paper.results, vs_vllm):
        monkeypatch.setattr(module, "load", lambda name: None if name == "vs_vllm_evict_share"
                            else doc)
    monkeypatch.setattr(vs_vllm, "FIGURES", tmp_path)  # the repo's figure stays as it is
    v: dict[str, str] = {}
    vs_vllm.vs_vllm_section(v)
    assert "vLLM 0.32.0" in v["vs_vllm_text"] and "commit abc123" in v["vs_vllm_text"]
    assert "R = 128, 2048 blocks: 2 (target <= 1), **missed**" in v["vs_vllm_text"]
    # Where the time went: selection is the part that grew (0.325 ms more), named with it.
    assert "grew most over `vllm_control`: selection +0.325 ms." in v["vs_vllm_text"]
    assert "Run in groups: R = 128 at 2,048 blocks" in v["vs_vllm_text"]
    table = v["vs_vllm_table"]
    assert "| kvtriton fused re-store | 128 | 2,048 | 2.600 | - | 2.00 |" in table
    assert "| 16 |" not in table  # the parts: only the targets' sizes
    # Every size's whole step, the grouped one starred.
    assert "| variant | R = 16 | R = 128* |" in table
    assert "| kvtriton fused re-store | 2.600 | 2.600 |" in table
    assert (tmp_path / "vs_vllm.png").exists()
    assert v["abstract_vs_vllm"] == ("; beside vLLM 0.32.0's own scheduler, in one process, a "
                                     "whole step that also re-stores costs 2.00 of vLLM's "
                                     "control step (R = 128, 2,048 blocks)")
    for module in (paper.results, vs_vllm):
        monkeypatch.setattr(module, "load", lambda name: None)
    vs_vllm.vs_vllm_section(v)
    assert "has not been run" in v["vs_vllm_text"] and v["vs_vllm_table"] == ""
    assert v["abstract_vs_vllm"] == ""


def test_the_evict_share_setting_is_reported_from_its_own_file():
    """The re-store step with evictions that grow with the blocks held: every cell's ratio,
    verdict, blocks stored and cost per block from ``vs_vllm_evict_share.json``."""
    doc = {"machine": {"cpu": "x", "cpu_cores": 2, "gpu": None, "git_sha": "abc123",
                       "torch": "2", "triton": "3", "date_utc": "today"},
           "settings": {"evict_fraction": 0.01, "evict_per_request": None},
           "rows": [{"variant": "kvt_fused_restore", "requests": 128, "blocks_per_request": b,
                     "stored_per_step": 1000.0 * b, "us_per_stored_block": 0.5 / b}
                    for b in (1, 4)],
           "targets": [{"name": "fused_restore_over_vllm_control", "requests": 128,
                        "blocks_per_request": b, "value": 0.5 * b, "met": b == 1}
                       for b in (1, 4)]
           + [{"name": "blocks_2048_to_8192_kvt_fused_restore", "requests": 128,
               "blocks_per_request": "1->4", "measure": "time per stored block: 3.8x"}]}
    text = vs_vllm._evict_share_text(doc)
    assert "1% of the CPU's cached blocks" in text and "commit abc123" in text
    assert "R = 128, 1 blocks: 0.50 of vLLM's control (met), 1,000 blocks stored" in text
    assert "R = 128, 4 blocks: 2.00 of vLLM's control (**missed**), 4,000 blocks" in text
    assert "0.125 us each" in text and "R = 128: time per stored block: 3.8x" in text
    assert "*not run*" in vs_vllm._evict_share_text(None)


def test_the_lfu_section_formats_the_studys_verdicts(monkeypatch):
    """``lfu_recency.json``: the held-out share table and each change's verdict as the study
    wrote it; without the file, a line saying how to run it."""
    machine = {"cpu": "x", "cpu_cores": 2, "gpu": None, "git_sha": "abc123", "torch": "2",
               "triton": "3", "date_utc": "today"}
    cfg = {"num_conversations": 40, "min_turns": 6, "max_turns": 12, "start_window_s": 2000.0,
           "system_prompt_tokens": 512}

    def row(train, test):
        return {"parts": {"train": {"token_hit_rate": train}, "test": {"token_hit_rate": test}}}

    doc = {"machine": machine,
           "shape": {"config": cfg, "capacities": {"gpu_tokens": 4096, "cpu_tokens": 4800},
                     "chosen_seed": 1},
           "summary": {"held_out_seeds": [2, 3], "control_cpu_hit_tokens": 1234,
                       "cpu_hit_share_of_control": {"eager+lfu:64": 0.25},
                       "running_evictions": {"eager": 10, "eager+lfu:64": 99},
                       "lfu_loses": True},
           "study_workloads": {"cc_agentic": {"eager+lfu:64": row(0.5, 0.6)}},
           "rule": {"recovers_share": 0.9, "keeps_gain_points": 1.0, "judged_on": "train"},
           "verdicts": [{"change": "eager+lfu:4", "chat_cpu_hit_share_of_control": 0.97,
                         "recovers_chat": True, "adopt": False,
                         "points_vs_lfu64": {"train": {"cc_agentic": -3.5},
                                             "test": {"cc_agentic": -2.0}}}]}
    doc["findings"] = lfu_study.findings("lfu_recency", doc)
    monkeypatch.setattr(lfu_recency, "load", lambda name: doc if name == "lfu_recency" else None)
    v: dict = {}
    lfu_recency.lfu_recency_section(v)
    text = v["lfu_recency_text"]
    assert "held-out seeds 2-3" in text and "1,234 CPU-hit tokens" in text
    assert "| `eager+lfu:64` | 0.25 | 99 |" in text
    assert "`eager+lfu:4` recovers the chat hits (0.97 of `eager`'s)" in text
    assert "train -3.50 points (coding-agent traces)" in text and "not adopted" in text
    assert "`lfu:64` stays as chosen" in text
    monkeypatch.setattr(lfu_recency, "load", lambda name: None)
    lfu_recency.lfu_recency_section(v)
    assert "--only lfu_recency" in v["lfu_recency_text"]
