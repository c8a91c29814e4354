"""What a vLLM request tells the tier, read the same way on every release
(``kvtriton.vllm.releases``): the session id from ``Request.session_id`` (0.33) or
``kv_transfer_params``, the hint from ``kv_transfer_params`` or 0.33's ``KvHintsEnvelope``.

The readers are checked on plain objects with the attributes each release has, then on vLLM's
own classes where the running release has them: a hint sent in a real ``KvHintsEnvelope``
protects the request's blocks in vLLM's real scheduler as the same hint in
``kv_transfer_params`` does (without a hint, the negative control, LRU evicts them).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from kvtriton.vllm.releases import (
    HINT_ACTION,
    HINT_KEY,
    MAX_SESSION_CHARS,
    SESSION_KEY,
    request_hint_value,
    request_session,
)

pytestmark = pytest.mark.scheduler_role


def _envelope(*payloads, action_type=HINT_ACTION):
    actions = [SimpleNamespace(action_type=action_type, payload=p) for p in payloads]
    return SimpleNamespace(actions=actions)


@pytest.mark.parametrize(("fields", "want"), [
    ({}, (None, False)),  # a release without the field, no params
    ({"kv_transfer_params": {SESSION_KEY: "s"}}, ("s", False)),
    ({"session_id": "a", "kv_transfer_params": {SESSION_KEY: "b"}}, ("a", False)),  # 0.33 field
    ({"session_id": None, "kv_transfer_params": {SESSION_KEY: "b"}}, ("b", False)),
    ({"kv_transfer_params": {SESSION_KEY: 7}}, (None, True)),
    ({"kv_transfer_params": {SESSION_KEY: ""}}, (None, True)),
    ({"session_id": "x" * (MAX_SESSION_CHARS + 1)}, (None, True)),
    ({"kv_transfer_params": "not a dict"}, (None, False)),
])
def test_the_session_id_comes_from_where_the_release_puts_it(fields, want):
    assert request_session(SimpleNamespace(**fields)) == want


def test_a_hint_comes_from_the_params_first_then_the_envelope():
    both = SimpleNamespace(kv_transfer_params={HINT_KEY: "close"},
                           kv_hints=_envelope({"hint": "continue"}))
    assert request_hint_value(both)[0] == "close"
    env = SimpleNamespace(kv_hints=_envelope({"hint": "close"}, {"hint": "continue"}))
    value, where = request_hint_value(env)
    assert value == "continue" and HINT_ACTION in where  # the last action of ours wins
    other = SimpleNamespace(kv_hints=_envelope({"hint": "close"}, action_type="someone.else"))
    assert request_hint_value(other)[0] is None
    assert request_hint_value(SimpleNamespace())[0] is None  # no kv_hints attribute


# ---- vLLM's own classes, where the release has them --------------------------------------------


def _kv_hints_module():
    pytest.importorskip("vllm")
    try:
        from vllm.v1 import kv_hints
    except ImportError:
        import vllm

        pytest.skip(f"vLLM {vllm.__version__} has no KvHintsEnvelope (0.33 added it)")
    return kv_hints


def test_a_real_kv_hints_envelope_is_read():
    kv_hints = _kv_hints_module()
    env = kv_hints.KvHintsEnvelope(protocol_version="1", message_id="m1", actions=[
        kv_hints.KvHintAction(action_id="a1", action_type=HINT_ACTION, action_version="1",
                              payload={"hint": "continue"})])
    assert request_hint_value(SimpleNamespace(kv_hints=env))[0] == "continue"


@pytest.mark.parametrize("hinted", [True, False])
def test_an_envelope_hint_protects_blocks_in_the_real_scheduler(tmp_path, hinted):
    kv_hints = _kv_hints_module()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from helpers.vllm_driver import BS, build, cpu_hashes, run, tokens
    from kvtriton.sim.vllm_scheduler import tiny_model_dir, vllm_request

    blocks = 4
    _, side, drv = build(tiny_model_dir(tmp_path, 8192), cpu_blocks=2 * blocks,
                         extra_config={"setup": "eager+hints"})

    def serve(rid, seed, envelope=None):
        r = vllm_request(rid, tokens(seed, blocks * BS), 2, BS)
        r.kv_hints = envelope
        before = cpu_hashes(side)
        drv.add(r)
        run(drv)
        return cpu_hashes(side) - before

    env = kv_hints.KvHintsEnvelope(protocol_version="1", message_id="m", actions=[
        kv_hints.KvHintAction(action_id="a", action_type=HINT_ACTION, action_version="1",
                              payload={"hint": "continue"})]) if hinted else None
    older = serve("older", 1, env)
    newer = serve("newer", 2)
    serve("filler", 3)
    held = cpu_hashes(side)
    kept = (len(older & held), len(newer & held))
    assert kept == ((blocks, 0) if hinted else (0, blocks)), kept
    assert side.signals.counters["hints_continue"] == int(hinted)
