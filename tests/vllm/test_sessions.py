"""The ``sessions`` axis in vLLM's real ``Scheduler`` (``KVTritonConnector``'s scheduler role; no
model is run): a finished request with a session id has its blocks protected for the session's
next turn until the session is silent past the setup's idle time.

The session id comes from ``Request.session_id`` (vLLM 0.33: the OpenAI body's ``session_id``)
or ``kv_transfer_params["session_id"]`` (any release): both are checked, on whichever release
runs the test. Each effect is checked against the same schedule without it (the negative
controls: no session id, a malformed one, a session aged out, a setup without the axis), where
the tier's plain LRU evicts the older request's blocks.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import BS, assert_idle, build, cpu_hashes, run, tokens
from kvtriton.sim.vllm_scheduler import vllm_request
from kvtriton.vllm.releases import SESSION_KEY
from tests.vllm.test_signals import kvtriton_warnings

pytestmark = pytest.mark.scheduler_role

PROMPT_BLOCKS = 4
TIER_BLOCKS = 2 * PROMPT_BLOCKS  # holds two finished prompts, nothing more


class Clock:
    """The connector's session clock, moved by the test (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def request(rid, seed, session=None, where="params"):
    r = vllm_request(rid, tokens(seed, PROMPT_BLOCKS * BS), 2, BS)
    if session is not None:
        if where == "params":
            r.kv_transfer_params = {SESSION_KEY: session}
        else:  # vLLM 0.33's field, set as its OpenAI server sets it from the body
            r.session_id = session
    return r


def serve(drv, side, req) -> set[bytes]:
    before = cpu_hashes(side)
    drv.add(req)
    run(drv)
    return cpu_hashes(side) - before


# (setup, the older request's session id, seconds of silence before the filler, where the id
# is sent, the request whose blocks the filler evicts)
CASES = [
    ("eager+sessions", None, 0, "params", "older"),  # no session: plain LRU
    ("eager+sessions", "s1", 0, "params", "newer"),  # protected for the session's next turn
    ("eager+sessions", "s1", 0, "request", "newer"),  # the same from Request.session_id
    ("eager+sessions:60", "s1", 59, "params", "newer"),  # still within the idle time
    ("eager+sessions:60", "s1", 61, "params", "older"),  # silent too long: aged out
    ("eager+sessions", 12345, 0, "params", "older"),  # malformed: no session
    ("eager", "s1", 0, "params", "older"),  # a setup without the axis ignores it
]


@pytest.mark.parametrize(("setup", "session", "silent_s", "where", "evicted"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}s-{c[3]}" for c in CASES])
def test_a_sessions_last_turn_is_kept_for_its_next_turn(model_config_dir, setup, session,
                                                        silent_s, where, evicted):
    s, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS, extra_config={"setup": setup})
    clock = side.signals.clock = Clock()
    with kvtriton_warnings() as records:
        older = serve(drv, side, request("older", 1, session, where))
    newer = serve(drv, side, request("newer", 2))
    assert len(older) == len(newer) == PROMPT_BLOCKS
    clock.now += silent_s
    serve(drv, side, request("filler", 3))  # evicts PROMPT_BLOCKS of the 8 cached blocks
    held = cpu_hashes(side)
    kept = {"older": len(older & held), "newer": len(newer & held)}
    other = "older" if evicted == "newer" else "newer"
    assert kept[evicted] == 0 and kept[other] == PROMPT_BLOCKS, kept
    counts, on = side.signals.counters, setup != "eager"
    valid = isinstance(session, str)
    assert counts["session_turns"] == int(on and valid)
    assert counts["sessions_expired"] == int(on and valid and evicted == "older")
    assert counts["malformed_sessions"] == int(on and session is not None and not valid)
    warned = [r.getMessage() for r in records if "session" in r.getMessage()]
    assert len(warned) == counts["malformed_sessions"], warned
    stats = side.get_stats().data
    assert stats["live_sessions"] == int(on and valid and evicted == "newer")
    assert_idle(s, side)


def test_a_sessions_next_turn_renews_its_protection(model_config_dir):
    """A second turn of the session, late in the first turn's idle time, protects the session
    again from its own end: the first turn's idle time passing no longer lets it go."""
    s, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS,
                         extra_config={"setup": "eager+sessions:60"})
    clock = side.signals.clock = Clock()
    first = serve(drv, side, request("t1", 1, "s1"))
    clock.now += 50
    serve(drv, side, request("t2", 1, "s1"))  # the same prompt: a GPU hit, nothing new stored
    newer = serve(drv, side, request("newer", 2))
    clock.now += 20  # 70 s after the first turn, 20 s after the second
    serve(drv, side, request("filler", 3))
    held = cpu_hashes(side)
    assert (len(first & held), len(newer & held)) == (PROMPT_BLOCKS, 0)
    assert side.signals.counters["sessions_expired"] == 0
    assert_idle(s, side)
