"""What the real-engine study (``bench.vllm.engine``) concludes from its rows: per workload,
the simulator's worst miss of the engine's hit rate (points) and of its TTFT p50 (relative),
in sample (the clock fitted to the runs it predicts) and out of sample (fitted on the ``none``
runs alone, or on the other workload's runs), beside the engine's own run-to-run spread."""

from __future__ import annotations


def _worst(rows: list[dict]) -> dict:
    rel = [abs(r["ttft_p50_rel_off"]) for r in rows if r["ttft_p50_rel_off"] is not None]
    return {"worst_hit_points_off": max(abs(r["hit_points_off"]) for r in rows),
            "worst_ttft_p50_rel_off": max(rel, default=0.0),
            "systems": [r["system"] for r in rows]}


def _spread(measured: list[dict]) -> dict | None:
    """The engine's own spread over repeats: the widest TTFT p50 range relative to its mean,
    and the widest hit-rate range in points (None for single runs)."""
    ranged = [m for m in measured if "ttft_p50_s_range" in m]
    if not ranged:
        return None
    return {"ttft_p50_rel": max((m["ttft_p50_s_range"][1] - m["ttft_p50_s_range"][0])
                                / m["ttft_p50_s"] for m in ranged),
            "hit_points": max(100 * (m["token_hit_rate_range"][1] - m["token_hit_rate_range"][0])
                              for m in ranged)}


def findings(name: str, doc: dict) -> dict:
    out = {}
    for workload, run in doc["runs"].items():
        w = _worst(run["rows"])
        tiers = [r for r in run["rows"] if r["system"] != "none"]
        out[workload] = {
            "worst_hit_points_off": w["worst_hit_points_off"],
            "worst_ttft_p50_rel_off": w["worst_ttft_p50_rel_off"],
            # In sample over the same systems as each out-of-sample fit judges.
            "in_sample_tiers": _worst(tiers) if tiers else None,
            "out_of_sample": {label: _worst(o["rows"])
                              for label, o in run.get("out_of_sample", {}).items()
                              if "rows" in o},
            "engine_spread": _spread(run["measured"])}
    return {"runs": out}
