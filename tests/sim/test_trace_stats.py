"""``trace_stats`` (``kvtriton.sim.trace_stats``): the summary figures of a workload."""

from __future__ import annotations

from kvtriton.sim.trace_stats import trace_stats
from kvtriton.sim.workload import agent_workload

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def test_stats():
    w = agent_workload(**{**SMALL, "min_turns": 10, "max_turns": 10})
    s = trace_stats(w)
    assert s["requests"] == len(w) == 60 and s["sessions"] == 6
    assert s["closed_loop_requests"] == 60 - 6
    assert 0.8 < s["reusable_token_fraction"] < 1.0  # history is re-hit every turn
    assert s["prompt_len"]["p50"] <= s["prompt_len"]["p90"] <= s["prompt_len"]["p99"]
