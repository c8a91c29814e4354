"""The cost model: hand-computed FLOPs, times, transfers and TTFT."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtriton.sim.cost import (
    GPUS,
    MODELS,
    CostModel,
    GPUSpec,
    MeasuredCost,
    ModelSpec,
    step_features,
    transfer_s,
)
from kvtriton.specs import PRESETS

# One attention layer of width 1 and no weights: FLOPs are 4 x (positions attended).
TOY = ModelSpec("toy", params=0.0, attention_layers=1, q_width=1)
TOY_WINDOW = ModelSpec("toy-w", params=0.0, attention_layers=0, q_width=1, window_layers=1,
                       window=2)
UNIT_GPU = GPUSpec("unit", bf16_flops_per_s=1.0, hbm_bytes_per_s=1.0, h2d_bytes_per_s=10.0,
                   d2h_bytes_per_s=20.0, link="test")


def test_catalogue_covers_presets_and_gpus():
    assert set(PRESETS) <= set(MODELS)
    assert {"H100", "H200", "A100"} <= set(GPUS)
    assert MODELS["llama3-8b"].kv_bytes_per_token == 32 * 2 * 8 * 128 * 2  # layers, K/V, bf16
    assert MODELS["gemma3-12b"].window == 1024
    for g in GPUS.values():
        assert g.bf16_flops_per_s > 1e14 and g.h2d_bytes_per_s > 1e10


def test_attention_flops_hand_computed():
    c = CostModel(TOY, UNIT_GPU, mfu=1.0)
    assert c.prefill_flops(3) == 4 * (0 + 1 + 2)
    assert c.prefill_flops(3, context_tokens=2) == 4 * (2 + 3 + 4)
    assert c.prefill_flops(0, 5) == 0
    w = CostModel(TOY_WINDOW, UNIT_GPU, mfu=1.0)
    assert w.prefill_flops(5) == 4 * (0 + 1 + 2 + 2 + 2)
    assert w.prefill_flops(2, context_tokens=1) == 4 * (1 + 2)
    assert w.prefill_flops(2, context_tokens=7) == 4 * (2 + 2)


def test_chunked_prefill_adds_up():
    c = CostModel.named("qwen3-8b", "H200")
    whole = c.prefill_flops(10_000)
    parts = c.prefill_flops(4_000) + c.prefill_flops(6_000, context_tokens=4_000)
    assert parts == pytest.approx(whole)


def test_linear_term_and_mfu():
    c = CostModel.named("llama3-8b", "H100", mfu=0.5)
    assert c.prefill_flops(1) == 2 * 8.03e9
    assert c.prefill_s_per_token == pytest.approx(2 * 8.03e9 / (0.5 * 989.4e12))
    assert c.prefill_s(1) == pytest.approx(c.prefill_s_per_token)
    slow = CostModel.named("llama3-8b", "A100", mfu=0.5)
    assert slow.prefill_s(1000) > c.prefill_s(1000)


def test_decode_step_hand_computed():
    m = ModelSpec("d", params=10.0, attention_layers=1, q_width=1, kv_bytes_per_token=3)
    c = CostModel(m, UNIT_GPU, hbm_efficiency=0.5)
    assert c.decode_step_s([4, 6]) == pytest.approx((2 * 10 + 3 * 10) / 0.5)
    mw = ModelSpec("dw", params=0.0, attention_layers=0, q_width=1, window_layers=1, window=5,
                   window_kv_bytes_per_token=2)
    assert CostModel(mw, UNIT_GPU).decode_step_s([3, 100]) == pytest.approx((2 * 3 + 2 * 5) / 0.8)


def test_transfer():
    assert transfer_s(10**9, 50e9) == pytest.approx(0.02)
    assert transfer_s(0, 50e9, num_pieces=4, per_piece_s=0.5e-6) == pytest.approx(2e-6)
    c = CostModel(TOY, UNIT_GPU)
    assert c.h2d_s(100) == pytest.approx(10.0)
    assert c.d2h_s(100) == pytest.approx(5.0)
    assert c.h2d_s(100, num_pieces=2) == pytest.approx(10.0 + 1e-6)
    with pytest.raises(ValueError, match="bandwidth"):
        transfer_s(1, 0.0)
    with pytest.raises(ValueError, match="negative"):
        transfer_s(-1, 1.0)


def test_ttft_hand_computed():
    c = CostModel(TOY, UNIT_GPU, mfu=1.0, step_overhead_s=1.0)
    # 5 tokens in chunks of 2: steps of positions {0,1}, {2,3}, {4} -> 3 overheads + 4 x 10.
    assert c.ttft_s(5, token_budget=2) == pytest.approx(3 + 4 * (0 + 1 + 2 + 3 + 4))
    # 3 cached, loaded in 20 bytes (2 s at 10 B/s) behind one step: then tokens 3, 4.
    assert c.ttft_s(5, 3, load_bytes=20) == pytest.approx(1 + 2 + 1 + 4 * (3 + 4))
    # a fully cached prompt still computes its last token
    assert c.ttft_s(5, 5) == pytest.approx(1 + 4 * 4)
    assert c.ttft_s(5, queue_s=2.5) == pytest.approx(2.5 + 1 + 4 * 10)


def test_ttft_falls_with_cached_tokens():
    c = CostModel.named("llama3-8b", "H100")
    times = [c.ttft_s(32_000, k) for k in (0, 8_000, 16_000, 31_000)]
    assert times == sorted(times, reverse=True)
    cold = c.ttft_s(32_000)
    per_token = MODELS["llama3-8b"].kv_bytes_per_token
    warm = c.ttft_s(32_000, 31_744, load_bytes=31_744 * per_token)
    assert warm < cold / 5  # loading 4 GB at ~50 GB/s beats recomputing 32K tokens


@pytest.mark.parametrize(("call", "message"), [
    (lambda: CostModel.named("gpt-5"), "unknown model"),
    (lambda: CostModel.named("llama3-8b", "TPU"), "unknown GPU"),
    (lambda: CostModel.named("llama3-8b", mfu=0.0), "mfu must be in"),
    (lambda: CostModel.named("llama3-8b", step_overhead_s=-1.0), "step_overhead_s"),
    (lambda: CostModel.named().ttft_s(0), "prompt_tokens must be >= 1"),
    (lambda: CostModel.named().ttft_s(5, 6), "cached_tokens=6 outside"),
    (lambda: CostModel.named().prefill_flops(-1), "negative token count"),
])
def test_bad_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# ---- MeasuredCost: the step-time model fitted to a real engine ----------------------------------

def _random_steps(rng, n):
    """Steps of random prefill chunks and decodes, as the clock sees them."""
    steps = []
    for _ in range(n):
        chunks = []
        for _ in range(int(rng.integers(1, 5))):
            if rng.random() < 0.5:
                prompt = int(rng.integers(64, 2048))
                chunks.append((1, prompt + int(rng.integers(0, 64)), prompt))
            else:
                before = int(rng.integers(0, 1024))
                chunks.append((int(rng.integers(16, 512)), before, before + 600))
        steps.append(chunks)
    return steps


TRUE = dict(step_overhead_s=4e-3, prefill_s_per_token=1e-4, prefill_s_per_attended=2e-8,
            decode_s_per_seq=1e-3, decode_s_per_context_token=2e-7)


def test_fit_recovers_a_known_step_model():
    rng = np.random.default_rng(0)
    truth = MeasuredCost(**TRUE, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    steps = _random_steps(rng, 400)
    x = [step_features(c) for c in steps]
    y = [truth.step_s(f) * (1 + rng.normal(0, 0.01)) for f in x]
    fit = MeasuredCost.fit(x, y, h2d_bytes_per_s=2e9, d2h_bytes_per_s=3e9)
    for name, value in TRUE.items():
        assert getattr(fit, name) == pytest.approx(value, rel=0.1), name
    assert fit.r2 > 0.99 and fit.samples == 400
    assert fit.conditions()["kind"] == "measured" and fit.h2d_s(2e9) == pytest.approx(1.0)


def test_fit_drops_a_term_the_engine_does_not_have():
    """A cost that is not there fits to exactly 0, never below."""
    rng = np.random.default_rng(1)
    truth = MeasuredCost(**{**TRUE, "decode_s_per_context_token": 0.0},
                         h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    x = [step_features(c) for c in _random_steps(rng, 300)]
    y = [max(truth.step_s(f) + rng.normal(0, 2e-4), 0.0) for f in x]
    fit = MeasuredCost.fit(x, y, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    assert all(v >= 0 for v in (fit.step_overhead_s, fit.prefill_s_per_token,
                                fit.prefill_s_per_attended, fit.decode_s_per_seq,
                                fit.decode_s_per_context_token))
    assert fit.prefill_s_per_token == pytest.approx(TRUE["prefill_s_per_token"], rel=0.1)


def test_clock_charges_what_the_fit_predicts():
    """The serving loop's clock and ``step_s(step_features(...))`` are one formula."""
    from types import SimpleNamespace

    from kvtriton.sim.clock import ServingClock

    cost = MeasuredCost(**TRUE, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    for chunks in _random_steps(np.random.default_rng(2), 50):
        clock = SimpleNamespace(cost=cost)
        assert ServingClock._step_seconds(clock, chunks) == pytest.approx(
            cost.step_s(step_features(chunks)), rel=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    ({"features": [np.ones(5)] * 3, "seconds": [1.0] * 3}, "3 samples for 5 terms"),
    ({"features": [np.ones(4)] * 6, "seconds": [1.0] * 6}, "must be (n, 5)"),
    ({"features": [np.ones(5)] * 6, "seconds": [1.0] * 5}, "must be (n, 5)"),
    ({"features": [np.full(5, np.nan)] * 6, "seconds": [1.0] * 6}, "finite"),
])
def test_fit_refuses_bad_samples(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        MeasuredCost.fit(**kwargs, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)


def test_measured_cost_refuses_negative_or_zero_rates():
    with pytest.raises(ValueError, match="decode_s_per_seq must be finite and >= 0"):
        MeasuredCost(**{**TRUE, "decode_s_per_seq": -1.0}, h2d_bytes_per_s=1e9,
                     d2h_bytes_per_s=1e9)
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be finite and > 0"):
        MeasuredCost(**TRUE, h2d_bytes_per_s=0.0, d2h_bytes_per_s=1e9)
