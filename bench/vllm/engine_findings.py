"""What the real-engine study (``bench.vllm.engine``) concludes from its rows: per workload,
the simulator's worst miss of the engine's hit rate (points) and of its TTFT p50 (relative)."""

from __future__ import annotations


def findings(name: str, doc: dict) -> dict:
    out = {}
    for workload, run in doc["runs"].items():
        rel = [abs(r["ttft_p50_rel_off"]) for r in run["rows"]
               if r["ttft_p50_rel_off"] is not None]
        out[workload] = {"worst_hit_points_off": max(abs(r["hit_points_off"])
                                                     for r in run["rows"]),
                         "worst_ttft_p50_rel_off": max(rel, default=0.0)}
    return {"runs": out}
