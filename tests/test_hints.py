"""Continuation hints: the ``WorkloadRequest.hint`` field, the hints the trace loaders read
(kv-cache-tester ``stop``, Mooncake ``hint``), ``mark_session_close``, the agent generator's
hints, and bad hints through the loaders and the command line."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from kvtriton.cli import main
from kvtriton.sim import (
    CC_AGENTIC_SAMPLE,
    HINTS,
    STOP_REASONS,
    TraceError,
    Workload,
    WorkloadRequest,
    agent_workload,
    data_path,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
    mark_session_close,
    trace_stats,
)
from kvtriton.sim.workloads import limit_workload, scale_times

CC_DIR = data_path(CC_AGENTIC_SAMPLE)
SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def raw_stops() -> dict[str, object]:
    """The ``stop`` of every request of the shipped sample, by the id the loader gives it
    (``<stem>#<i>``, ``<stem>#<i>.<j>`` inside a sub-agent marker), read from the raw files."""
    out: dict[str, object] = {}

    def walk(items: list, stem: str, index: str) -> None:
        for i, obj in enumerate(items):
            if obj.get("type") == "subagent":
                walk(obj["requests"], stem, f"{index}{i}.")
            else:
                out[f"{stem}#{index}{i}"] = obj.get("stop", "<missing>")

    for f in sorted(CC_DIR.glob("*.json.gz")):
        walk(json.loads(gzip.decompress(f.read_bytes()))["requests"],
             f.name.removesuffix(".json.gz"), "")
    return out


def by_session(w: Workload) -> dict[str, list[WorkloadRequest]]:
    out: dict[str, list[WorkloadRequest]] = defaultdict(list)
    for r in w:  # a workload is in arrival order
        if r.session is not None:
            out[r.session].append(r)
    return out


def hints(w: Workload) -> list[str | None]:
    return [r.hint for r in w]


def req(rid: str, t: float, *, session: str | None = None, after: str | None = None,
        hint: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(rid, t, 32, 0, np.zeros(2, np.uint64), session=session, after=after,
                           hint=hint)


# ---- the field ----------------------------------------------------------------------------


def test_hints_constant():
    assert HINTS == ("continue", "close")
    assert WorkloadRequest("r", 0.0, 1, 0, np.zeros(0, np.uint64)).hint is None
    for h in (None, *HINTS):
        assert req("r", 0.0, hint=h).hint == h


@pytest.mark.parametrize("bad", ["Continue", "", "tool_use", 1, True, ["close"]])
def test_bad_request_hint(bad):
    with pytest.raises(ValueError) as e:
        req("turn-7", 0.0, hint=bad)
    assert "'turn-7'" in str(e.value) and f"got {bad!r}" in str(e.value)


# ---- kv-cache-tester: stop reasons --------------------------------------------------------


def test_shipped_sample_hints():
    stops = raw_stops()
    w = load_kv_cache_tester(CC_DIR)
    assert {r.request_id for r in w} == set(stops)
    for r in w:
        assert r.hint == ("continue" if stops[r.request_id] == "tool_use" else None), r.request_id
    counts = Counter(hints(w))
    n_tool_use = sum(s == "tool_use" for s in stops.values())
    assert counts == {"continue": n_tool_use, None: len(stops) - n_tool_use}
    assert set(stops.values()) <= set(STOP_REASONS)  # every shipped stop reason is known
    assert n_tool_use > 0 and counts[None] > 0
    s = trace_stats(w)
    assert s["hints"] == {"continue": n_tool_use, "close": 0, "none": len(stops) - n_tool_use}


def conv_doc(requests: list, **top) -> dict:
    return {"id": "t", "block_size": 64, "requests": requests, **top}


def treq(t: float = 0.0, **extra) -> dict:
    return {"t": t, "type": "n", "model": "m", "in": 128, "out": 10, "hash_ids": [1, 2],
            "think_time": 0.0, **extra}


def write_json(path: Path, doc) -> Path:
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_every_known_stop_reason(tmp_path):
    reasons = sorted(STOP_REASONS)
    doc = conv_doc([treq(t=i, stop=s) for i, s in enumerate(reasons)] + [treq(t=len(reasons))])
    w = load_kv_cache_tester(write_json(tmp_path / "c.json.gz", doc))
    got = {r.request_id: r.hint for r in w}
    for i, s in enumerate(reasons):
        assert got[f"c#{i}"] == ("continue" if s == "tool_use" else None)
    assert got[f"c#{len(reasons)}"] is None  # no stop field: no hint
    assert set(STOP_REASONS) == {"tool_use", "end_turn", "max_tokens", "stop_sequence",
                                 "pause_turn", "refusal", ""}


TESTER_BAD = {
    "number": ([treq(), treq(t=1, stop=3)], "requests[1]: field 'stop' must be a string, got 3"),
    "null": ([treq(stop=None)], "requests[0]: field 'stop' must be a string, got None"),
    "list": ([treq(stop=["tool_use"])], "requests[0]: field 'stop' must be a string, got "
                                        "['tool_use']"),
    "unknown": ([treq(stop="tool_call")], "requests[0]: field 'stop' is not a known stop reason: "
                                          "'tool_call'"),
    "case": ([treq(stop="TOOL_USE")], "requests[0]: field 'stop' is not a known stop reason: "
                                      "'TOOL_USE'"),
    "nested": ([treq(), {"t": 1, "type": "subagent", "requests": [treq(t=0, stop="later")]}],
               "requests[1].requests[0]: field 'stop' is not a known stop reason: 'later'"),
}


@pytest.mark.parametrize("case", list(TESTER_BAD))
def test_bad_stop(tmp_path, case):
    requests, message = TESTER_BAD[case]
    p = write_json(tmp_path / "conv.json.gz", conv_doc(requests))
    with pytest.raises(TraceError) as e:
        load_kv_cache_tester(p)
    assert str(e.value).startswith(f"{p}: ") and message in str(e.value)


# ---- Mooncake: the optional hint field ----------------------------------------------------

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}


def write_jsonl(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in lines))
    return path


def test_mooncake_hints(tmp_path):
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": "continue"},
                                           {**GOOD, "hint": "close"}, {**GOOD, "hint": None}])
    assert hints(load_mooncake(p)) == [None, "continue", "close", None]
    assert hints(load_trace(p)) == [None, "continue", "close", None]
    shipped = load_trace(data_path("mooncake_synthetic_trace.jsonl"))
    assert set(hints(shipped)) == {None}  # the shipped trace has none


@pytest.mark.parametrize("bad", ["maybe", "", "Close", 1, True, ["continue"], {"a": 1}])
def test_mooncake_bad_hint(tmp_path, bad):
    p = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": bad}])
    with pytest.raises(TraceError) as e:
        load_mooncake(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2: field 'hint' must be null or one of") and repr(bad) in msg


# ---- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("command", ["simulate", "replay", "trace-stats"])
@pytest.mark.parametrize("fmt", ["tester-stop", "tester-unknown-stop", "mooncake-hint"])
def test_cli_bad_hint_is_one_line_and_exit_2(tmp_path, capsys, fmt, command):
    if fmt == "mooncake-hint":
        path = write_jsonl(tmp_path / "t.jsonl", [GOOD, {**GOOD, "hint": "soon"}])
        message = ":2: field 'hint' must be null or one of ('continue', 'close'), got 'soon'"
    elif fmt == "tester-stop":
        path = write_json(tmp_path / "c.json.gz", conv_doc([treq(stop=7)]))
        message = ": requests[0]: field 'stop' must be a string, got 7"
    else:
        path = write_json(tmp_path / "c.json.gz", conv_doc([treq(), treq(t=1, stop="halt")]))
        message = ": requests[1]: field 'stop' is not a known stop reason: 'halt'"
    argv = (["trace-stats", str(path)] if command == "trace-stats"
            else [command, "--workload", str(path), "--quiet"])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvtriton: error: "), err
    assert "Traceback" not in err
    assert f"{path}{message}" in err


def test_cli_copies_keep_hints():
    w = agent_workload(**SMALL)
    assert hints(scale_times(w, 2.0)) == hints(w)
    assert hints(limit_workload(w, 10)) == hints(w)[:10]


# ---- mark_session_close ---------------------------------------------------------------------


def test_mark_session_close():
    w = Workload([
        req("a0", 0.0, session="a", hint="continue"),
        req("x0", 0.5),  # no session: left alone
        req("b0", 1.0, session="b"),
        req("a1", 2.0, session="a", after="a0", hint="continue"),  # a's last: close overrides
        req("x1", 2.5, hint="continue"),
        req("b1", 3.0, session="b", after="b0", hint="continue"),
        req("b2", 4.0, session="b", after="b1"),  # b's last
        req("c0", 5.0, session="c"),  # a one-turn session is closed too
        req("d0", 6.0, session="d", hint="continue"),
        req("e0", 7.0, session="e", after="d0"),  # d's last is named in after: no close for d
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
    w = load_kv_cache_tester(CC_DIR)
    m = mark_session_close(w)
    sessions = by_session(w)
    closed = {r.request_id for r in m if r.hint == "close"}
    assert closed == {turns[-1].request_id for turns in sessions.values()}
    assert len(closed) == len(sessions) > 12  # the 12 conversations and their sub-agents
    for a, b in zip(w, m, strict=True):
        assert b.hint == ("close" if a.request_id in closed else a.hint)
    s = trace_stats(m)["hints"]
    before = trace_stats(w)["hints"]
    assert s["close"] == len(closed)
    assert s["continue"] + s["none"] == before["continue"] + before["none"] - len(closed)


# ---- the agent generator -------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    {}, {"closed_loop": False, "seed": 4}, {"max_context_tokens": 600, "min_turns": 40,
                                            "max_turns": 40}])
def test_agent_hints(overrides):
    w = agent_workload(**{**SMALL, **overrides})
    for turns in by_session(w).values():
        turns.sort(key=lambda r: r.request_id)
        assert [r.hint for r in turns] == ["continue"] * (len(turns) - 1) + ["close"]
    assert hints(mark_session_close(w)) == hints(w)  # already marked
    s = trace_stats(w)
    n_sessions = len(by_session(w))
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
