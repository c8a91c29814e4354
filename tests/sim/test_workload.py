"""Workload records and the multi-turn agent generator (``kvtriton.sim.workload``): the records'
checks, the generator's sessions and hashes, continuation hints (the ``WorkloadRequest.hint``
field, the agent generator's hints) and ``mark_session_close``.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import defaultdict

import numpy as np
import pytest

from kvtriton.hashing import chain_hashes
from kvtriton.sim import CC_AGENTIC_SAMPLE, HINTS, data_path, load_kv_cache_tester, trace_stats
from kvtriton.sim.workload import (
    AgentConfig,
    Workload,
    WorkloadRequest,
    agent_workload,
    mark_session_close,
)

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


# ---- continuation hints --------------------------------------------------------------------------


def session_turns(w: Workload) -> dict[str, list[WorkloadRequest]]:
    """Each session's turns in arrival order (requests without a session left out)."""
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in w:  # a workload is in arrival order
        if r.session is not None:
            out[r.session].append(r)
    return out


def hints(w: Workload) -> list[str | None]:
    return [r.hint for r in w]


def turn(rid: str, t: float, *, session: str | None = None, after: str | None = None,
         hint: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(rid, t, 32, 0, np.zeros(2, np.uint64), session=session, after=after,
                           hint=hint)


def test_hints_constant():
    assert HINTS == ("continue", "close")
    assert WorkloadRequest("r", 0.0, 1, 0, np.zeros(0, np.uint64)).hint is None
    for h in (None, *HINTS):
        assert turn("r", 0.0, hint=h).hint == h


@pytest.mark.parametrize("bad", ["Continue", "", "tool_use", 1, True, ["close"]])
def test_bad_request_hint(bad):
    with pytest.raises(ValueError) as e:
        turn("turn-7", 0.0, hint=bad)
    assert "'turn-7'" in str(e.value) and f"got {bad!r}" in str(e.value)


# ---- mark_session_close --------------------------------------------------------------------------


def test_mark_session_close():
    w = Workload([
        turn("a0", 0.0, session="a", hint="continue"),
        turn("x0", 0.5),  # no session: left alone
        turn("b0", 1.0, session="b"),
        turn("a1", 2.0, session="a", after="a0", hint="continue"),  # a's last: close overrides
        turn("x1", 2.5, hint="continue"),
        turn("b1", 3.0, session="b", after="b0", hint="continue"),
        turn("b2", 4.0, session="b", after="b1"),  # b's last
        turn("c0", 5.0, session="c"),  # a one-turn session is closed too
        turn("d0", 6.0, session="d", hint="continue"),
        turn("e0", 7.0, session="e", after="d0"),  # d's last is named in after: no close for d
    ], 16, "hand-made")
    before = hints(w)
    m = mark_session_close(w)
    assert hints(w) == before  # the input is not modified
    assert m.name == w.name and m.hash_block_size == w.hash_block_size
    assert [r.request_id for r in m] == [r.request_id for r in w]
    assert dict(zip([r.request_id for r in m], hints(m), strict=True)) == {
        "a0": "continue", "x0": None, "b0": None, "a1": "close", "x1": "continue",
        "b1": "continue", "b2": "close", "c0": "close", "d0": "continue", "e0": "close"}
    for a, b in zip(w, m, strict=True):  # nothing but the hint changes
        assert (a.request_id, a.arrival_s, a.prompt_len, a.output_len, a.session, a.after,
                a.think_s, a.model) == (b.request_id, b.arrival_s, b.prompt_len, b.output_len,
                                        b.session, b.after, b.think_s, b.model)
        assert np.array_equal(a.hashes, b.hashes)
    assert hints(mark_session_close(m)) == hints(m)  # idempotent


def test_mark_session_close_on_the_sample():
    w = load_kv_cache_tester(data_path(CC_AGENTIC_SAMPLE))
    m = mark_session_close(w)
    sessions = session_turns(w)
    closed = {r.request_id for r in m if r.hint == "close"}
    assert closed == {turns[-1].request_id for turns in sessions.values()}
    assert len(closed) == len(sessions) > 12  # the 12 conversations and their sub-agents
    for a, b in zip(w, m, strict=True):
        assert b.hint == ("close" if a.request_id in closed else a.hint)
    s = trace_stats(m)["hints"]
    before = trace_stats(w)["hints"]
    assert s["close"] == len(closed)
    assert s["continue"] + s["none"] == before["continue"] + before["none"] - len(closed)


# ---- the agent generator's hints -----------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {}, {"closed_loop": False, "seed": 4}, {"max_context_tokens": 600, "min_turns": 40,
                                            "max_turns": 40}])
def test_agent_hints(overrides):
    w = agent_workload(**{**SMALL, **overrides})
    for turns in session_turns(w).values():
        turns.sort(key=lambda r: r.request_id)
        assert [r.hint for r in turns] == ["continue"] * (len(turns) - 1) + ["close"]
    assert hints(mark_session_close(w)) == hints(w)  # already marked
    s = trace_stats(w)
    n_sessions = len(session_turns(w))
    assert s["hints"] == {"continue": len(w) - n_sessions, "close": n_sessions, "none": 0}


def test_agent_generator_unchanged_by_hints():
    """The hints feed no random stream: everything else the generator makes is what it made
    before hints existed (digest measured on the generator without hints)."""
    h = hashlib.sha256()
    for kw in [{}, {"seed": 3, "num_conversations": 7},
               {"closed_loop": False, "seed": 5, "num_conversations": 5},
               {"max_context_tokens": 8000, "seed": 2, "num_conversations": 10},
               {"hash_block_size": 64, "seed": 9, "num_conversations": 4}]:
        w = agent_workload(**kw)
        h.update(w.name.encode())
        for r in w:
            h.update(repr((r.request_id, r.arrival_s, r.prompt_len, r.output_len, r.session,
                           r.after, r.think_s, r.model)).encode())
            h.update(r.hashes.tobytes())
    assert h.hexdigest() == "2917cb9b2817917e1fe46342f36480b8b19bc9ee2d6e769dc3302b4d200f5f90"
