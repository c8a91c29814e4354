"""Workload records and the multi-turn agent generator."""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest

from kvtriton.hashing import chain_hashes
from kvtriton.sim.trace_stats import trace_stats
from kvtriton.sim.workload import AgentConfig, Workload, WorkloadRequest, agent_workload

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def by_session(w: Workload) -> dict[str, list[WorkloadRequest]]:
    out = defaultdict(list)
    for r in w:
        out[r.session].append(r)
    for turns in out.values():
        turns.sort(key=lambda r: r.request_id)
    return out


@pytest.fixture(scope="module")
def default():
    return agent_workload()


def test_default_scenario_is_the_conversational_agent(default):
    c = AgentConfig()
    assert 10 <= c.num_conversations <= 100 and (c.min_turns, c.max_turns) == (10, 50)
    sessions = by_session(default)
    assert len(sessions) == c.num_conversations
    assert all(10 <= len(t) <= 50 for t in sessions.values())
    assert default.hash_block_size == 16
    assert [r.arrival_s for r in default] == sorted(r.arrival_s for r in default)


def test_deterministic_by_seed():
    a, b, c = agent_workload(**SMALL), agent_workload(**SMALL), agent_workload(**SMALL, seed=1)
    assert [r.request_id for r in a] == [r.request_id for r in b]
    assert all(np.array_equal(x.hashes, y.hashes) for x, y in zip(a, b, strict=True))
    assert [r.prompt_len for r in a] != [r.prompt_len for r in c]


def test_history_grows_with_the_answer_and_a_new_message():
    w = agent_workload(**SMALL)
    b = w.hash_block_size
    for turns in by_session(w).values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.prompt_len > prev.total_len  # previous prompt + answer + new message
            # every full block of the previous turn (prompt and answer) is a prefix of this one
            assert np.array_equal(cur.hashes[: len(prev.hashes)], prev.hashes)
            assert cur.after == prev.request_id and cur.think_s >= 0
            assert cur.arrival_s >= prev.arrival_s
        assert turns[0].after is None and turns[0].think_s == 0.0
        for r in turns:
            assert len(r.hashes) == r.total_len // b


def test_system_prompt_is_shared():
    w = agent_workload(**SMALL)
    n = SMALL["system_prompt_tokens"] // w.hash_block_size
    firsts = {r.hashes[:n].tobytes() for r in w}
    assert len(firsts) == 1
    # and the sessions diverge right after it
    after = {s: turns[-1].hashes[n] for s, turns in by_session(w).items()}
    assert len(set(after.values())) == len(after)


def test_hashes_are_real_chain_hashes():
    # The generator's hashes are chain_hashes of some token sequence: the first block's hash
    # depends only on the system prompt, which we can recompute from the seed's shared stream.
    cfg = AgentConfig(**SMALL)
    rng = np.random.default_rng(np.random.SeedSequence(cfg.seed).spawn(cfg.num_conversations
                                                                        + 1)[0])
    system = rng.integers(0, cfg.vocab_size, cfg.system_prompt_tokens, dtype=np.int64)
    expect = chain_hashes(system, cfg.hash_block_size)
    got = agent_workload(cfg)[0].hashes[: len(expect)]
    assert [int(h) for h in got] == expect


def test_open_loop_and_context_cap():
    w = agent_workload(**SMALL, closed_loop=False)
    assert all(r.after is None for r in w)
    capped = agent_workload(**{**SMALL, "max_turns": 40, "min_turns": 40},
                            max_context_tokens=600)
    assert all(r.total_len <= 600 for r in capped)
    assert all(len(t) < 40 for t in by_session(capped).values())


def test_stats():
    w = agent_workload(**{**SMALL, "min_turns": 10, "max_turns": 10})
    s = trace_stats(w)
    assert s["requests"] == len(w) == 60 and s["sessions"] == 6
    assert s["closed_loop_requests"] == 60 - 6
    assert 0.8 < s["reusable_token_fraction"] < 1.0  # history is re-hit every turn
    assert s["prompt_len"]["p50"] <= s["prompt_len"]["p90"] <= s["prompt_len"]["p99"]


@pytest.mark.parametrize(("overrides", "message"), [
    ({"min_turns": 5, "max_turns": 4}, "max_turns=4 < min_turns=5"),
    ({"num_conversations": 0}, "num_conversations must be a positive int"),
    ({"think_s_mean": -1.0}, "think_s_mean must be finite and >= 0"),
    ({"seed": -1}, "seed must be an int >= 0"),
    ({"turns": 3}, "unknown parameter"),
])
def test_bad_config(overrides, message):
    with pytest.raises(ValueError, match=message):
        agent_workload(**overrides)


def req(rid, p=8, o=0, b=4, after=None, **kw) -> WorkloadRequest:
    return WorkloadRequest(rid, 0.0, p, o, np.arange((p + o) // b, dtype=np.uint64),
                           after=after, **kw)


def test_workload_validation():
    Workload([req("a"), req("b", after="a")], 4)
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        Workload([req("a"), req("a")], 4)
    with pytest.raises(ValueError, match="expected \\(prompt_len \\+ output_len\\) // 4 = 2"):
        Workload([req("a", b=2)], 4)
    with pytest.raises(ValueError, match="after unknown request 'z'"):
        Workload([req("a", after="z")], 4)
    with pytest.raises(ValueError, match="hash_block_size must be a positive int"):
        Workload([], 0)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"p": 0}, "prompt_len must be an int >= 1"),
    ({"o": -1, "p": 8}, "output_len must be an int >= 0"),
    ({"think_s": -1.0}, "think_s must be finite"),
    ({"after": "x"}, "cannot come after itself"),
])
def test_request_validation(kwargs, message):
    kwargs = dict(kwargs)
    p, o = kwargs.pop("p", 8), kwargs.pop("o", 0)
    with pytest.raises(ValueError, match=message):
        WorkloadRequest("x", 0.0, p, o, np.zeros(max(0, (p + max(o, 0)) // 4), np.uint64),
                        **kwargs)
    with pytest.raises(ValueError, match="1-D uint64"):
        WorkloadRequest("x", 0.0, 8, 0, np.zeros(2, np.int64))
