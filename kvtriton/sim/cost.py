"""A cost model for the simulator: prefill and decode time, per-step overhead, transfers, TTFT.

Units are in the names: ``_s`` seconds, ``_bytes`` bytes, ``_tokens`` tokens, ``flops`` floating
point operations, ``_bytes_per_s`` and ``flops_per_s`` rates. Every constant says where it comes
from; the ones that are modelling choices say so ("ASSUMPTION").

Prefill is compute bound: a token costs ``2 * params`` FLOPs in the matmuls plus
``4 * q_width * (positions it attends to)`` per attention layer (QK^T and AV, causal), run at
``mfu`` of the GPU's dense BF16 peak. Decode is memory bound: a step reads the weights once and
every running sequence's KV, at ``hbm_efficiency`` of the HBM bandwidth. A transfer costs a
submission per piece plus bytes over the link's bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvtriton.specs import preset

__all__ = [
    "GPUS",
    "MODELS",
    "CostModel",
    "GPUSpec",
    "MeasuredCost",
    "ModelSpec",
    "ServingCost",
    "step_features",
    "transfer_s",
]


@dataclass(frozen=True, slots=True)
class GPUSpec:
    """A GPU's peak rates and its host link, one direction each way."""

    name: str
    bf16_flops_per_s: float
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    link: str


# Peak dense (no sparsity) BF16 tensor FLOP/s and HBM bandwidth from NVIDIA's datasheets; the
# host link figures are measured one-direction rates, each with its source.
_PCIE5_DMA = 50e9  # PCIe Gen5 x16 on H100, DMA or a 16-byte kernel: ~50 GB/s (vLLM blog)
# ASSUMPTION: PCIe Gen4 x16 is 32 GB/s raw per direction; ~25 GB/s achievable, by the same
# ~80% efficiency that Gen5's 64 GB/s raw -> ~50 GB/s shows.
_PCIE4_DMA = 25e9
# NVLink-C2C: 900 GB/s total, 450 GB/s per direction (GH200 datasheet); the figure measured by
# a copy kernel is lower: SGLang HiCache reports ~190 GB/s with TMA over C2C on GB300.
_C2C_MEASURED = 190e9

GPUS: dict[str, GPUSpec] = {
    # H100 SXM5 80 GB datasheet: 989.4 TFLOP/s BF16 dense (1,979 with sparsity), 3.35 TB/s HBM3.
    "H100": GPUSpec("H100", 989.4e12, 3.35e12, _PCIE5_DMA, _PCIE5_DMA, "PCIe Gen5 x16"),
    # H100 PCIe 80 GB datasheet: 756 TFLOP/s BF16 dense, 2.0 TB/s HBM2e.
    "H100-PCIe": GPUSpec("H100-PCIe", 756e12, 2.0e12, _PCIE5_DMA, _PCIE5_DMA, "PCIe Gen5 x16"),
    # H200 SXM 141 GB datasheet: 989 TFLOP/s BF16 dense (same compute as H100 SXM), 4.8 TB/s.
    "H200": GPUSpec("H200", 989e12, 4.8e12, _PCIE5_DMA, _PCIE5_DMA, "PCIe Gen5 x16"),
    # A100 SXM4 80 GB datasheet: 312 TFLOP/s BF16 dense (624 with sparsity), 2,039 GB/s HBM2e.
    "A100": GPUSpec("A100", 312e12, 2.039e12, _PCIE4_DMA, _PCIE4_DMA, "PCIe Gen4 x16"),
    # GH200 datasheet: H100 compute (989 TFLOP/s BF16 dense), 4.0 TB/s HBM3 (96 GB version).
    "GH200": GPUSpec("GH200", 989e12, 4.0e12, _C2C_MEASURED, _C2C_MEASURED, "NVLink-C2C"),
}

# cuMemcpyBatchAsync host submission cost per descriptor: ~0.5 us (vLLM #48434).
DMA_SUBMIT_S_PER_PIECE = 0.5e-6


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the cost of a model depends on.

    ``params``: weights (BF16, 2 bytes each). ``attention_layers``: layers with full causal
    attention; ``window_layers`` attend to the last ``window`` positions only. ``q_width``:
    query heads x head dim. ``kv_bytes_per_token``: KV read per token of context at decode, from
    the ``kvtriton.specs`` preset (full-attention groups; a window layer reads at most
    ``window`` tokens, counted separately).
    """

    name: str
    params: float
    attention_layers: int
    q_width: int
    window_layers: int = 0
    window: int = 0
    kv_bytes_per_token: int = 0
    window_kv_bytes_per_token: int = 0


def _kv_bytes(model: str) -> tuple[int, int]:
    """Bytes per token of full-attention and sliding-window KV in a preset (block size 16)."""
    layout = preset(model)
    full = window = 0
    for g, nbytes in zip(layout.groups, layout.group_block_bytes, strict=True):
        if g.kind == "full":
            full += nbytes // g.block_size
        elif g.kind == "sliding_window":
            window += nbytes // g.block_size
    return full, window


def _model(name: str, params: float, attention_layers: int, q_width: int, window_layers: int = 0,
           window: int = 0) -> ModelSpec:
    full, win = _kv_bytes(name)
    return ModelSpec(name, params, attention_layers, q_width, window_layers, window, full, win)


MODELS: dict[str, ModelSpec] = {
    # meta-llama/Meta-Llama-3-8B: 8.03e9 parameters (model card); 32 layers, 32 query heads x 128.
    "llama3-8b": _model("llama3-8b", 8.03e9, 32, 32 * 128),
    # Qwen/Qwen3-8B: 8.2e9 parameters (model card); 36 layers, 32 query heads x 128.
    "qwen3-8b": _model("qwen3-8b", 8.2e9, 36, 32 * 128),
    # google/gemma-3-12b: 12.2e9 parameters with the vision tower (model card; ~11.8e9 in the
    # language model); 48 layers, 16 query heads x 256: 8 global, 40 with a 1,024-token window.
    "gemma3-12b": _model("gemma3-12b", 11.8e9, 8, 16 * 256, window_layers=40, window=1024),
    # nvidia/Nemotron-H-8B-Base-8K: 8e9 parameters (model card); 4 attention layers with 32 query
    # heads x 128; the 24 Mamba-2 layers' cost is linear in tokens and counted in 2 * params.
    "nemotron-h-8b": _model("nemotron-h-8b", 8e9, 4, 32 * 128),
}

# ASSUMPTION: prefill reaches 40% of peak BF16 (MFU) on large chunks; vLLM-class engines report
# 30-50% on H100 for 8B models. With it, Llama-3-8B on H100 prefills ~41 us/token; the re-store
# design document's "~25 ms per 256-token block" (~98 us/token) corresponds to ~17% MFU.
DEFAULT_MFU = 0.4
# ASSUMPTION: decode reads weights and KV at 80% of peak HBM bandwidth.
DEFAULT_HBM_EFFICIENCY = 0.8
# ASSUMPTION: a scheduler step costs 2 ms besides the model (scheduling, input prep, launch);
# vLLM V1 with CUDA graphs sits in the low milliseconds for 8B models.
DEFAULT_STEP_OVERHEAD_S = 2e-3


def transfer_s(nbytes: int, bandwidth_bytes_per_s: float, *, num_pieces: int = 0,
               per_piece_s: float = 0.0) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth_bytes_per_s``, plus ``num_pieces`` submissions
    of ``per_piece_s`` each (e.g. ``DMA_SUBMIT_S_PER_PIECE`` per ``cuMemcpyBatchAsync``
    descriptor)."""
    if nbytes < 0 or num_pieces < 0 or per_piece_s < 0:
        raise ValueError(f"transfer_s: negative input (nbytes={nbytes}, "
                         f"num_pieces={num_pieces}, per_piece_s={per_piece_s})")
    if not bandwidth_bytes_per_s > 0:
        raise ValueError(f"transfer_s: bandwidth must be > 0 bytes/s, "
                         f"got {bandwidth_bytes_per_s!r}")
    return num_pieces * per_piece_s + nbytes / bandwidth_bytes_per_s


def _attended(start: int, n: int, window: int = 0) -> float:
    """Sum over positions p in [start, start + n) of the positions p attends to besides itself
    (``p``, or ``min(p, window)`` with a window)."""
    if n <= 0:
        return 0.0
    end = start + n  # exclusive

    def tri(a: int, b: int) -> float:  # sum of p for p in [a, b)
        return (b - a) * (a + b - 1) / 2 if b > a else 0.0

    if not window:
        return tri(start, end)
    split = min(max(start, window), end)
    return tri(start, split) + (end - split) * window


@dataclass(frozen=True, slots=True)
class CostModel:
    """Modelled times for one model on one GPU; see the module docstring."""

    model: ModelSpec
    gpu: GPUSpec
    mfu: float = DEFAULT_MFU
    hbm_efficiency: float = DEFAULT_HBM_EFFICIENCY
    step_overhead_s: float = DEFAULT_STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        for name in ("mfu", "hbm_efficiency"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"CostModel: {name} must be in (0, 1], got {v!r}")
        if not (self.step_overhead_s >= 0 and math.isfinite(self.step_overhead_s)):
            raise ValueError(f"CostModel: step_overhead_s must be >= 0, "
                             f"got {self.step_overhead_s!r}")

    @classmethod
    def named(cls, model: str = "llama3-8b", gpu: str = "H100", **overrides) -> CostModel:
        """The cost model of a preset model (``MODELS``) on a GPU (``GPUS``); ``overrides`` set
        ``mfu``, ``hbm_efficiency``, ``step_overhead_s``."""
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}; known: {sorted(MODELS)}")
        if gpu not in GPUS:
            raise ValueError(f"unknown GPU {gpu!r}; known: {sorted(GPUS)}")
        return cls(MODELS[model], GPUS[gpu], **overrides)

    # ---- compute ----------------------------------------------------------------------------

    def prefill_flops(self, num_tokens: int, context_tokens: int = 0) -> float:
        """FLOPs to prefill ``num_tokens`` tokens that follow ``context_tokens`` already cached."""
        if num_tokens < 0 or context_tokens < 0:
            raise ValueError(f"prefill_flops: negative token count ({num_tokens}, "
                             f"{context_tokens})")
        m = self.model
        linear = 2.0 * m.params * num_tokens
        attn = 4.0 * m.q_width * (m.attention_layers * _attended(context_tokens, num_tokens)
                                  + m.window_layers
                                  * _attended(context_tokens, num_tokens, m.window))
        return linear + attn

    @property
    def prefill_s_per_token(self) -> float:
        """Seconds per prefilled token from the matmuls alone (no attention, no overhead)."""
        return 2.0 * self.model.params / (self.mfu * self.gpu.bf16_flops_per_s)

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Seconds of GPU compute to prefill ``num_tokens`` after ``context_tokens`` cached ones
        (no step overhead)."""
        rate = self.mfu * self.gpu.bf16_flops_per_s
        return self.prefill_flops(num_tokens, context_tokens) / rate

    def decode_step_s(self, context_tokens: list[int] | tuple[int, ...]) -> float:
        """Seconds of one decode step for running sequences of ``context_tokens`` each: the
        weights once plus each sequence's KV, read from HBM (no step overhead)."""
        m = self.model
        kv = sum(m.kv_bytes_per_token * c + m.window_kv_bytes_per_token * min(c, m.window)
                 for c in context_tokens)
        nbytes = 2.0 * m.params + kv
        return nbytes / (self.hbm_efficiency * self.gpu.hbm_bytes_per_s)

    def conditions(self) -> dict:
        """The constants a result's ``conditions`` record."""
        return {"kind": "modeled", "model": self.model.name, "gpu": self.gpu.name,
                "mfu": self.mfu, "hbm_efficiency": self.hbm_efficiency,
                "step_overhead_s": self.step_overhead_s,
                "h2d_bytes_per_s": self.gpu.h2d_bytes_per_s,
                "d2h_bytes_per_s": self.gpu.d2h_bytes_per_s}

    # ---- transfers ---------------------------------------------------------------------------

    def h2d_s(self, nbytes: int, num_pieces: int = 0) -> float:
        """Seconds to load ``nbytes`` from CPU to GPU over the GPU's host link."""
        return transfer_s(nbytes, self.gpu.h2d_bytes_per_s, num_pieces=num_pieces,
                          per_piece_s=DMA_SUBMIT_S_PER_PIECE if num_pieces else 0.0)

    def d2h_s(self, nbytes: int, num_pieces: int = 0) -> float:
        """Seconds to store ``nbytes`` from GPU to CPU over the GPU's host link."""
        return transfer_s(nbytes, self.gpu.d2h_bytes_per_s, num_pieces=num_pieces,
                          per_piece_s=DMA_SUBMIT_S_PER_PIECE if num_pieces else 0.0)

    # ---- TTFT --------------------------------------------------------------------------------

    def ttft_s(self, prompt_tokens: int, cached_tokens: int = 0, *, load_bytes: int = 0,
               token_budget: int = 8192, queue_s: float = 0.0) -> float:
        """Modelled time to first token of a request running alone: ``queue_s`` waiting, then
        (if ``load_bytes``) one step whose load of the cached KV overlaps nothing (a CPU hit
        costs a step), then the uncached tokens in chunks of ``token_budget``, each chunk a step.
        At least the last prompt token is computed, as in vLLM."""
        if prompt_tokens < 1:
            raise ValueError(f"ttft_s: prompt_tokens must be >= 1, got {prompt_tokens}")
        if not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError(f"ttft_s: cached_tokens={cached_tokens} outside "
                             f"[0, prompt_tokens={prompt_tokens}]")
        if token_budget < 1 or load_bytes < 0 or queue_s < 0:
            raise ValueError(f"ttft_s: token_budget must be >= 1 and load_bytes, queue_s >= 0 "
                             f"(got {token_budget}, {load_bytes}, {queue_s})")
        cached = min(cached_tokens, prompt_tokens - 1)
        todo = prompt_tokens - cached
        t = queue_s
        if load_bytes:
            t += self.step_overhead_s + self.h2d_s(load_bytes)
        done = cached
        while todo > 0:
            chunk = min(todo, token_budget)
            t += self.step_overhead_s + self.prefill_s(chunk, done)
            done += chunk
            todo -= chunk
        return t


class ServingCost(Protocol):
    """What the serving loop's clock asks of a cost model (``CostModel``, ``MeasuredCost``)."""

    step_overhead_s: float

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float: ...

    def decode_step_s(self, context_tokens: list[int] | tuple[int, ...]) -> float: ...

    def h2d_s(self, nbytes: int, num_pieces: int = 0) -> float: ...

    def d2h_s(self, nbytes: int, num_pieces: int = 0) -> float: ...

    def conditions(self) -> dict: ...


#: The terms of ``MeasuredCost``'s step time, in the order ``step_features`` returns them.
STEP_TERMS = ("step_s", "prefill_s_per_token", "prefill_s_per_attended", "decode_s_per_seq",
              "decode_s_per_context_token")


def step_features(chunks: Iterable[tuple[int, int, int]]) -> np.ndarray:
    """One step's regressors for ``MeasuredCost.fit``, from what it computed: per request
    ``(tokens, tokens computed before, prompt tokens)``, a chunk of one token past the prompt
    being a decode (as the serving loop's clock counts them). Returns float64 ``[1, prefill
    tokens, attended positions of the prefill tokens, decoding sequences, their context
    tokens]``."""
    x = np.zeros(len(STEP_TERMS))
    x[0] = 1.0
    for n, before, prompt in chunks:
        if n == 1 and before >= prompt:
            x[3] += 1
            x[4] += before
        else:
            x[1] += n
            x[2] += _attended(before, n)
    return x


@dataclass(frozen=True, slots=True)
class MeasuredCost:
    """A step-time model fitted to an engine's measured steps: a fixed cost per step, per
    prefilled token, per attended position (causal attention), per decoding sequence and per
    token of its context, all in seconds and all >= 0; transfers at measured byte rates.

    Built by ``fit`` from ``(step_features(chunks), measured seconds)`` samples, so the
    simulator's clock can replay a workload at the speed of the engine that was measured
    (``bench.vllm.engine``). ``r2`` and ``samples`` say how well and from how much it was fitted.
    """

    step_overhead_s: float
    prefill_s_per_token: float
    prefill_s_per_attended: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    samples: int = 0
    r2: float = float("nan")

    def __post_init__(self) -> None:
        for name in ("step_overhead_s", "prefill_s_per_token", "prefill_s_per_attended",
                     "decode_s_per_seq", "decode_s_per_context_token"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"MeasuredCost: {name} must be finite and >= 0, got {v!r}")
        for name in ("h2d_bytes_per_s", "d2h_bytes_per_s"):
            v = getattr(self, name)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"MeasuredCost: {name} must be finite and > 0, got {v!r}")

    @classmethod
    def fit(cls, features: Sequence[np.ndarray], seconds: Sequence[float], *,
            h2d_bytes_per_s: float, d2h_bytes_per_s: float) -> MeasuredCost:
        """Least squares with every coefficient >= 0: a term whose unconstrained fit is negative
        (noise, or a cost the engine does not have) is dropped and the rest refitted.
        ``ValueError`` with fewer samples than terms or mismatched lengths."""
        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(STEP_TERMS) or len(y) != len(x):
            raise ValueError(f"MeasuredCost.fit: features must be (n, {len(STEP_TERMS)}) and "
                             f"seconds (n,), got {x.shape} and {y.shape}")
        if len(y) < len(STEP_TERMS):
            raise ValueError(f"MeasuredCost.fit: {len(y)} samples for {len(STEP_TERMS)} terms")
        if not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError("MeasuredCost.fit: samples must be finite")
        # Scale columns so the solve is well conditioned (attended positions run to 1e7).
        scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
        xs = x / scale
        keep = np.ones(len(STEP_TERMS), dtype=bool)
        coef = np.zeros(len(STEP_TERMS))
        while keep.any():
            sol, *_ = np.linalg.lstsq(xs[:, keep], y, rcond=None)
            coef[:] = 0.0
            coef[keep] = sol
            if (sol >= 0).all():
                break
            keep[np.flatnonzero(keep)[sol < 0]] = False
        coef[~keep] = 0.0
        coef /= scale
        resid = y - x @ coef
        total = float(((y - y.mean()) ** 2).sum())
        r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else float("nan")
        return cls(*(float(c) for c in coef), h2d_bytes_per_s=h2d_bytes_per_s,
                   d2h_bytes_per_s=d2h_bytes_per_s, samples=len(y), r2=r2)

    def step_s(self, features: np.ndarray) -> float:
        """Modeled seconds of a step with ``step_features`` ``features``."""
        return float(np.dot(features, [self.step_overhead_s, self.prefill_s_per_token,
                                       self.prefill_s_per_attended, self.decode_s_per_seq,
                                       self.decode_s_per_context_token]))

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` after ``context_tokens`` cached (no step cost)."""
        return (self.prefill_s_per_token * num_tokens
                + self.prefill_s_per_attended * _attended(context_tokens, num_tokens))

    def decode_step_s(self, context_tokens: list[int] | tuple[int, ...]) -> float:
        """Seconds of one decode step for sequences of ``context_tokens`` (no step cost)."""
        return (self.decode_s_per_seq * len(context_tokens)
                + self.decode_s_per_context_token * sum(context_tokens))

    def h2d_s(self, nbytes: int, num_pieces: int = 0) -> float:
        """Seconds to load ``nbytes`` at the measured rate (``num_pieces`` is in the rate)."""
        return transfer_s(nbytes, self.h2d_bytes_per_s)

    def d2h_s(self, nbytes: int, num_pieces: int = 0) -> float:
        """Seconds to store ``nbytes`` at the measured rate."""
        return transfer_s(nbytes, self.d2h_bytes_per_s)

    def conditions(self) -> dict:
        """The fitted constants, as a result's ``conditions`` record them."""
        return {"kind": "measured", "step_overhead_s": self.step_overhead_s,
                "prefill_s_per_token": self.prefill_s_per_token,
                "prefill_s_per_attended": self.prefill_s_per_attended,
                "decode_s_per_seq": self.decode_s_per_seq,
                "decode_s_per_context_token": self.decode_s_per_context_token,
                "h2d_bytes_per_s": self.h2d_bytes_per_s,
                "d2h_bytes_per_s": self.d2h_bytes_per_s, "samples": self.samples,
                "r2": self.r2}
