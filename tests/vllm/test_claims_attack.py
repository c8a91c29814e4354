"""One client claiming every request costs the others little, in vLLM's whole engine on CPU
(``bench.vllm.claims_attack`` at the size of issue 50's report: 66 GPU blocks, a 150-block
tier, 16 attacker requests of 163 random tokens after each round of victim turns).

Twelve victim conversations of four turns send no session id and no hint. The attacker sends
the same requests twice on one engine: plain, then each with a fresh session id
(``eager+sessions``) or ``continue`` (``lazy+hints``). Target: the victims lose at most 20% of
their CPU-hit tokens to the claims, and no output changes. Negative control: with the probation
bound lifted (the rule before issue 50), the same claims cost the victims over a third.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.vllm.claims_attack import SETUPS, TARGET_LOSS, AttackSize, losses, run_setup

SIZE = AttackSize(victims=12, turns=4)


#: Pairs of arms per setup: one pair's hits vary by up to 10% from run to run on
#: ``eager+sessions`` (the engine's order over sets of request ids); over three pairs the loss
#: measured 6-8% in three runs.
REPEATS = 3


def _loss(rows: list[dict]) -> float:
    """The victims' loss under the claims against the plain arms, over every pair."""
    (setup,) = {r["setup"] for r in rows}
    return losses(rows)[setup]["vs_plain"]


@pytest.mark.parametrize("setup", list(SETUPS))
def test_one_client_claiming_every_request_costs_the_others_at_most_a_fifth(model_dir, setup):
    rows = run_setup(model_dir, setup, SIZE, arms=("plain", "claims") * REPEATS)
    assert all(r["victim_cpu_hit_tokens"] > 0 for r in rows if r["arm"] == "plain")
    for claims in (r for r in rows if r["arm"] == "claims"):
        assert claims["claims_made"] == 3 * SIZE.attack and claims["claims_proven"] == 0
        assert claims["claims_let_go"]["unproven"] > 0
    assert _loss(rows) <= TARGET_LOSS, [r["victim_cpu_hit_tokens"] for r in rows]
    assert rows[0]["outputs_identical"]


def test_without_the_probation_bound_the_claims_take_the_tier(model_dir, monkeypatch):
    import kvtriton.tier_signals as tier_signals

    monkeypatch.setattr(tier_signals, "PROBATION_SHARE", 10.0)
    rows = run_setup(model_dir, "eager+sessions", SIZE, arms=("plain", "claims"))
    assert _loss(rows) > 0.33, rows
    assert rows[1]["outputs_identical"]
