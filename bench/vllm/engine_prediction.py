"""The simulator's side of ``bench.vllm.engine``: the engine's repeated runs combined into one
row per system (``combine_repeats``), the step-time model fitted to their timed steps
(``fit_cost``), the simulator's replay of the same workload on that clock (``predict``) and the
comparison with the engine under the targets (``compare``: ``TARGET_HIT_POINTS``,
``TARGET_TTFT_REL``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.vllm.engine_workloads import Size

TARGET_HIT_POINTS = 1.0
TARGET_TTFT_REL = 0.20


def combine_repeats(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of a system: the first run's fields, with the hit rate, CPU
    hit tokens, TTFT p50/p90 and throughput as the mean over runs (and the hit rate's and TTFT
    p50's range: the engine's own run-to-run spread), and every run's steps for the fit."""
    if len(reps) == 1:
        return reps[0]
    row = dict(reps[0])
    row["repeats"] = len(reps)
    for key in ("token_hit_rate", "cpu_hit_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_mean_s",
                "output_tokens_per_s", "stored_blocks", "loaded_blocks"):
        vals = [r[key] for r in reps if r.get(key) is not None]
        row[key] = float(np.mean(vals)) if vals else None
    for key in ("token_hit_rate", "ttft_p50_s"):
        vals = [r[key] for r in reps]
        row[f"{key}_range"] = [float(min(vals)), float(max(vals))]
    row["_steps"] = [step for r in reps for step in r["_steps"]]
    return row


# On vLLM's CPU backend the worker copies inside the step that issued them (a torch copy, done
# before the step's output): a transfer completes with its step and its time is part of the
# step's measured time, which the fit already charges. The simulator then models it as a link
# this fast: it completes within the step, as in the engine.
SYNC_BYTES_PER_S = 1e15


def fit_cost(rows: list[dict[str, Any]], block_bytes: int, *, synchronous: bool):
    """``MeasuredCost`` from every timed step of ``rows``. Transfer rates: ``synchronous`` (the
    CPU backend) at ``SYNC_BYTES_PER_S``; else the connector's measured copy times, per block,
    scaled to the simulator's ``block_bytes``."""
    from kvtriton.sim.cost import MeasuredCost, step_features

    feats, secs = [], []
    for row in rows:
        for chunks, dt in row["_steps"]:
            feats.append(step_features(chunks))
            secs.append(dt)
    rates = {}
    for kind, key in (("load", "h2d"), ("store", "d2h")):
        blocks = seconds = 0.0
        for row in rows:
            t = row.get("transfers", {}).get(kind)
            if t and t["seconds"]:
                blocks += t["bytes"] / row["_block_bytes"]
                seconds += t["seconds"]
        # No transfer measured: a nominal rate (the tier then moved nothing worth timing).
        rates[key] = (SYNC_BYTES_PER_S if synchronous else
                      blocks * block_bytes / seconds if seconds else 10e9)
    return MeasuredCost.fit(feats, secs, h2d_bytes_per_s=rates["h2d"],
                            d2h_bytes_per_s=rates["d2h"])


def predict(wl, systems: list[str], cost, *, gpu_blocks: int, cpu_blocks: int, size: Size,
            engine: str = "kvtriton") -> dict[str, dict]:
    """The simulator's rows for ``systems`` on ``wl`` at the engine's sizes and ``cost``:
    ``engine="kvtriton"`` is the study's serving loop, ``"vllm"`` the same clock around vLLM's
    own ``Scheduler`` and the connector's scheduler side (``kvtriton.sim.vllm_loop``)."""
    from kvtriton.setups import DEFAULT_SETUP
    from kvtriton.sim import simulate

    names = [DEFAULT_SETUP if s == "default" else "eager" if s == "simple" else s
             for s in systems]
    res = simulate(wl, setups=list(dict.fromkeys(names)), gpu_blocks=gpu_blocks,
                   cpu_blocks=cpu_blocks, token_budget=size.max_num_batched_tokens,
                   max_running=size.max_num_seqs, bound=False, cost=cost, engine=engine)
    by_name = {r["setup"]: r for r in res.rows}
    return {s: by_name[n] for s, n in zip(systems, names, strict=True)}


def compare(measured: list[dict[str, Any]], predicted: dict[str, dict]) -> dict[str, Any]:
    """The targets: hit rate within ``TARGET_HIT_POINTS`` for every system; the systems' TTFT
    p50 in the same order, judged on every pair whose measured p50s differ by more than
    ``TARGET_TTFT_REL`` (closer pairs are within the timing tolerance itself, and several
    setups tie when the tier holds everything); modeled TTFT p50 within ``TARGET_TTFT_REL`` of
    measured."""
    rows, hit_ok, ttft_ok = [], True, True
    for m in measured:
        p = predicted[m["system"]]
        d_hit = 100 * (p["token_hit_rate"] - m["token_hit_rate"])
        rel = p["ttft_p50_s"] / m["ttft_p50_s"] - 1 if m["ttft_p50_s"] else None
        hit_ok &= abs(d_hit) <= TARGET_HIT_POINTS
        ttft_ok &= rel is not None and abs(rel) <= TARGET_TTFT_REL
        rows.append({"system": m["system"], "hit_rate_engine": m["token_hit_rate"],
                     "hit_rate_sim": p["token_hit_rate"], "hit_points_off": d_hit,
                     "ttft_p50_engine_s": m["ttft_p50_s"], "ttft_p50_sim_s": p["ttft_p50_s"],
                     "ttft_p50_rel_off": rel})
    pairs, wrong = 0, []
    for i, a in enumerate(rows):
        for b in rows[i + 1:]:
            lo, hi = sorted((a["ttft_p50_engine_s"], b["ttft_p50_engine_s"]))
            if hi <= lo * (1 + TARGET_TTFT_REL):
                continue
            pairs += 1
            if (a["ttft_p50_engine_s"] < b["ttft_p50_engine_s"]) != \
                    (a["ttft_p50_sim_s"] < b["ttft_p50_sim_s"]):
                wrong.append([a["system"], b["system"]])
    return {"rows": rows,
            "targets": {"hit_rate_within_1_point": bool(hit_ok),
                        "ttft_p50_same_order": not wrong,
                        "ttft_p50_within_20pct": bool(ttft_ok)},
            "ttft_order_engine": [r["system"] for r in sorted(
                rows, key=lambda r: r["ttft_p50_engine_s"])],
            "ttft_order_sim": [r["system"] for r in sorted(
                rows, key=lambda r: r["ttft_p50_sim_s"])],
            "ttft_pairs_compared": pairs, "ttft_pairs_misordered": wrong}


def prefill_ms_per_1k(cost) -> float:
    """Modeled ms to prefill 1,000 tokens in one step from an empty context."""
    return 1e3 * (cost.step_overhead_s + cost.prefill_s(1000, 0))

