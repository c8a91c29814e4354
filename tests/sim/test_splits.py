"""Train/test splits (``kvtriton.sim.splits``) and the per-part figures ``simulate(parts=...)``
reports: whole sessions stay in one part, the halves follow arrival order, and each part's
figures are its own requests' (a hand scenario, and sums over random workloads)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.hashing import chain_hashes
from kvtriton.sim import Workload, WorkloadRequest, agent_workload, simulate
from kvtriton.sim.splits import TEST, TRAIN, session_sets, split_named, time_halves

B = 16


def _req(rid: str, prefix: int, prompt: int, *, session: str = "s", after: str | None = None,
         arrival: float = 0.0) -> WorkloadRequest:
    tokens = np.arange(prefix * 10_000, prefix * 10_000 + prompt + 1)
    return WorkloadRequest(rid, arrival, prompt, 1, np.array(chain_hashes(tokens, B),
                                                            dtype=np.uint64),
                           session=session, after=after)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 100), st.integers(0, 5)), min_size=1, max_size=30))
def test_time_halves_put_the_earlier_half_in_train(arrivals):
    wl = Workload([_req(f"r{i}", i, 32, session=f"s{s}", arrival=t)
                   for i, (t, s) in enumerate(arrivals)], B)
    split = time_halves(wl)
    train = [wr.arrival_s for wr in wl if split[wr.request_id] == TRAIN]
    test = [wr.arrival_s for wr in wl if split[wr.request_id] == TEST]
    assert len(train) == (len(wl) + 1) // 2 and len(train) + len(test) == len(wl)
    assert not test or max(train) <= min(test)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 2)), min_size=1, max_size=40),
       st.randoms(use_true_random=False))
def test_session_sets_keep_sessions_whole_and_ignore_order(sessions, rnd):
    # Agent 0 is the trace's own session; others are its sub-agents (``s3/a1``).
    reqs = [_req(f"r{i}", i, 32, session=f"s{s}" + (f"/a{a}" if a else ""))
            for i, (s, a) in enumerate(sessions)]
    split = session_sets(Workload(reqs, B))
    by_session: dict[str, set[str]] = {}
    for wr in reqs:
        by_session.setdefault(wr.session.split("/")[0], set()).add(split[wr.request_id])
    assert all(len(parts) == 1 for parts in by_session.values())
    n_train = sum(parts == {TRAIN} for parts in by_session.values())
    assert n_train == (len(by_session) + 1) // 2
    shuffled = list(reqs)
    rnd.shuffle(shuffled)
    assert session_sets(Workload(shuffled, B)) == split


def test_each_part_reports_its_own_requests():
    # b repeats a's 64-token prompt after a finished: a (train) hits nothing, b (test) hits 48
    # tokens in the GPU prefix cache. Swapping the parts must swap the figures.
    wl = Workload([_req("a", 1, 64), _req("b", 1, 64, after="a")], B)
    kw = {"gpu_blocks": 64, "cpu_blocks": 64, "setups": ["none"], "bound": False}
    row = simulate(wl, parts={"a": TRAIN, "b": TEST}, **kw).rows[0]
    assert row["parts"][TRAIN]["token_hit_rate"] == 0.0
    assert row["parts"][TEST]["gpu_hit_tokens"] == 48
    assert row["parts"][TEST]["token_hit_rate"] == pytest.approx(48 / 64)
    swapped = simulate(wl, parts={"a": TEST, "b": TRAIN}, **kw).rows[0]
    assert swapped["parts"][TRAIN]["gpu_hit_tokens"] == 48
    assert swapped["parts"][TEST]["gpu_hit_tokens"] == 0
    assert "parts" not in simulate(wl, **kw).rows[0]


@pytest.mark.parametrize("kind", ["time", "sessions"])
def test_parts_add_up_to_the_whole_run(kind):
    wl = agent_workload(num_conversations=6, min_turns=2, max_turns=5, seed=4)
    res = simulate(wl, gpu_tokens=16_384, cpu_tokens=8192, setups=["eager", "lazy"],
                   parts=split_named(kind, wl))
    for row in res.rows + res.bounds:
        parts = row["parts"].values()
        for key in ("prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens"):
            assert sum(p[key] for p in parts) == row[key]
        assert row["rejected"] == 0 and all(p["requests"] for p in parts)
        assert sum(p["requests"] for p in parts) == row["requests"]
        ttfts = sorted(row["ttft_all_s"])
        assert sum(p["ttft_mean_s"] * p["requests"] for p in parts) == pytest.approx(
            sum(ttfts), rel=1e-4)
    control = next(r for r in res.rows if r["composition"] == "eager")
    assert all(p["gain_points"] == 0.0 and p["headroom_share"] in (0.0, None)
               for p in control["parts"].values())


def test_bad_parts_are_refused_before_any_run():
    wl = Workload([_req("a", 1, 64)], B)
    with pytest.raises(ValueError, match="'zz' is not in workload"):
        simulate(wl, gpu_blocks=64, cpu_blocks=64, parts={"zz": TRAIN})
    with pytest.raises(ValueError, match="has part ''"):
        simulate(wl, gpu_blocks=64, cpu_blocks=64, parts={"a": ""})
    with pytest.raises(ValueError, match="split 'random'"):
        split_named("random", wl)
