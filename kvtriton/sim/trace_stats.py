"""Summary figures of a trace or workload (``kvtriton trace-stats FILE``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtriton.sim.replay import max_hit_rate
from kvtriton.sim.traces import load_trace
from kvtriton.sim.workload import HINTS, Workload

__all__ = ["reuse_distances", "reuse_profile", "trace_stats"]

_PERCENTILES = (50, 90, 99)


def _summary(values: np.ndarray) -> dict:
    if not len(values):
        return {"mean": 0.0, "min": 0, **{f"p{q}": 0.0 for q in _PERCENTILES}, "max": 0}
    pct = np.percentile(values, _PERCENTILES)
    return {
        "mean": float(values.mean()),
        "min": int(values.min()),
        **{f"p{q}": float(v) for q, v in zip(_PERCENTILES, pct, strict=True)},
        "max": int(values.max()),
    }


def trace_stats(path_or_workload: str | Path | Workload, *,
                hash_block_size: int | None = None, trace_block_size: int | None = None) -> dict:
    """Requests, sessions, models, token totals, prompt/output length percentiles (tokens),
    distinct blocks, the reusable-token fraction with an infinite cache (``max_hit_rate``), the
    arrival span (seconds) and the continuation hints (requests per hint: ``continue``,
    ``close``, ``none``) of a workload, or of the trace at a path (loaded with
    ``kvtriton.sim.traces.load_trace`` at ``hash_block_size``, default the trace's own;
    ``trace_block_size`` as ``load_trace`` takes it)."""
    if isinstance(path_or_workload, Workload):
        if hash_block_size is not None and hash_block_size != path_or_workload.hash_block_size:
            raise ValueError(f"hash_block_size={hash_block_size} given for a workload at "
                             f"{path_or_workload.hash_block_size}")
        w = path_or_workload
    else:
        w = load_trace(path_or_workload, hash_block_size=hash_block_size,
                       trace_block_size=trace_block_size)
    reqs = w.requests
    prompt = np.array([r.prompt_len for r in reqs], dtype=np.int64)
    output = np.array([r.output_len for r in reqs], dtype=np.int64)
    arrivals = np.array([r.arrival_s for r in reqs], dtype=np.float64)
    hashes = np.concatenate([r.hashes for r in reqs]) if reqs else np.empty(0, np.uint64)
    unique_blocks = len(np.unique(hashes))
    return {
        "name": w.name,
        "hash_block_size": w.hash_block_size,
        "requests": len(reqs),
        "sessions": len({r.session for r in reqs if r.session is not None}),
        "models": sorted({r.model for r in reqs if r.model is not None}),
        "closed_loop_requests": sum(r.after is not None for r in reqs),
        "prompt_tokens": int(prompt.sum()),
        "output_tokens": int(output.sum()),
        "prompt_len": _summary(prompt),
        "output_len": _summary(output),
        "blocks": len(hashes),
        "unique_blocks": unique_blocks,
        "unique_block_tokens": unique_blocks * w.hash_block_size,
        "reusable_token_fraction": max_hit_rate(w),
        "arrival_span_s": float(arrivals.max() - arrivals.min()) if reqs else 0.0,
        "hints": {**{h: sum(r.hint == h for r in reqs) for h in HINTS},
                  "none": sum(r.hint is None for r in reqs)},
    }


def reuse_distances(w: Workload) -> tuple[np.ndarray, int]:
    """Per reused prompt block, in arrival order of the requests: the prompt tokens that
    arrived from the request that last held the block up to the request that holds it again
    (``cum[j] - cum[i]``, prompt tokens of requests ``i+1..j``). An LRU cache of that many
    tokens, holding every prompt, would still have the block. Also the number of prompt blocks.
    A block's earlier holder is its last in arrival order, ties in workload order."""
    b = w.hash_block_size
    order = sorted(range(len(w)), key=lambda i: (w.requests[i].arrival_s, i))
    prompts = [w.requests[i].hashes[:w.requests[i].prompt_len // b] for i in order]
    if not prompts or not sum(len(p) for p in prompts):
        return np.empty(0, dtype=np.int64), 0
    lens = np.array([w.requests[i].prompt_len for i in order], dtype=np.int64)
    cum = np.cumsum(lens)
    keys = np.concatenate(prompts)
    at = np.repeat(np.arange(len(order)), [len(p) for p in prompts])
    by_key = np.lexsort((at, keys))  # by key, then by request position
    k, r = keys[by_key], at[by_key]
    again = (k[1:] == k[:-1]) & (r[1:] != r[:-1])
    return cum[r[1:][again]] - cum[r[:-1][again]], len(keys)


def reuse_profile(w: Workload, capacities_tokens: dict[str, int]) -> dict:
    """How far apart a workload's prompt blocks are reused (``reuse_distances``): the share of
    prompt blocks that are reuses, percentiles of the distance in tokens, and per named
    capacity (e.g. ``{"gpu": ..., "gpu+cpu": ...}``) the share of reuses within it."""
    d, n = reuse_distances(w)
    return {"prompt_blocks": n, "reuses": len(d),
            "reuse_share": len(d) / n if n else 0.0,
            "distance_tokens": {f"p{q}": float(np.percentile(d, q)) if len(d) else 0.0
                                for q in _PERCENTILES},
            "within": {name: float((d <= cap).mean()) if len(d) else 0.0
                       for name, cap in capacities_tokens.items()}}
