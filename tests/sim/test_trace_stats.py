"""``trace_stats`` (``kvtriton.sim.trace_stats``): the summary figures of a workload."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.sim.trace_stats import reuse_distances, reuse_profile, trace_stats
from kvtriton.sim.workload import Workload, WorkloadRequest, agent_workload

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def test_stats():
    w = agent_workload(**{**SMALL, "min_turns": 10, "max_turns": 10})
    s = trace_stats(w)
    assert s["requests"] == len(w) == 60 and s["sessions"] == 6
    assert s["closed_loop_requests"] == 60 - 6
    assert 0.8 < s["reusable_token_fraction"] < 1.0  # history is re-hit every turn
    assert s["prompt_len"]["p50"] <= s["prompt_len"]["p90"] <= s["prompt_len"]["p99"]


def _loop_reuse_distances(w):
    """The loop reference of ``reuse_distances``."""
    order = sorted(range(len(w)), key=lambda i: (w.requests[i].arrival_s, i))
    cum, total = [], 0
    for i in order:
        total += w.requests[i].prompt_len
        cum.append(total)
    last, out, n = {}, [], 0
    for pos, i in enumerate(order):
        r = w.requests[i]
        seen = dict.fromkeys(int(x) for x in r.hashes[:r.prompt_len // w.hash_block_size])
        out += [cum[pos] - cum[last[h]] for h in seen if h in last]
        for h in r.hashes[:r.prompt_len // w.hash_block_size]:
            n += 1
            last[int(h)] = pos
    return sorted(out), n


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 6), st.floats(0, 10)),
                min_size=1, max_size=12))
def test_reuse_distances_match_the_loop_reference(reqs):
    # Each request's prompt is the first n blocks of chain c: requests share prefixes.
    wl = Workload([WorkloadRequest(f"r{i}", t, n * 16, 0,
                                   np.array([c * 100 + k for k in range(n)], dtype=np.uint64))
                   for i, (c, n, t) in enumerate(reqs)], 16)
    got, n = reuse_distances(wl)
    assert (sorted(got.tolist()), n) == _loop_reuse_distances(wl)
    prof = reuse_profile(wl, {"small": 32, "all": 10**9})
    assert prof["reuses"] == len(got) and prof["prompt_blocks"] == n
    if len(got):
        assert prof["within"]["all"] == 1.0
        assert prof["within"]["small"] == pytest.approx(float((got <= 32).mean()))
