"""What the planner-beside-vLLM study (``bench.vllm.vs_vllm``) concludes from its rows: its
variants and targets in the paper's words, and for each missed ratio target the parts of the
step in which its numerator's time exceeds its denominator's most."""

from __future__ import annotations

from bench.vllm.vs_vllm_targets import RATIO_TARGETS

VARIANTS = {
    "vllm_control": "vLLM control (cursor scan)",
    "vllm_rescan_restore": "vLLM re-scan re-store",
    "kvt_loop_control": "kvtriton loop control",
    "kvt_fused_control": "kvtriton fused control",
    "kvt_fused_restore": "kvtriton fused re-store",
    "kvt_connector_fused_control": "connector, fused control",
    "kvt_connector_fused_restore": "connector, fused re-store",
}
TARGETS = {
    "fused_restore_over_vllm_control": "fused re-store over vLLM's control",
    "fused_control_over_vllm_control": "fused control over vLLM's control",
    "rescan_over_fused_restore": "vLLM's re-scan re-store over fused re-store",
    "connector_over_planner_control": "through the connector over the planner alone (control)",
    "connector_over_planner_restore": "through the connector over the planner alone "
                                      "(re-store)",
}
# A part counts as grown when the numerator's median exceeds the denominator's by more (ms).
GROWN_MS = 0.0005


def findings(name: str, doc: dict) -> dict:
    """``labels``: variants and targets by name; ``grew_most``: per missed ratio target (in the
    order of ``doc["targets"]``, ``None`` for the others) the up to three parts that grew most
    over the denominator, ``[part, ms]``; ``compared``: that target's ``[numerator,
    denominator]``."""
    by_name = {n: (num, den) for n, num, den, _, _ in RATIO_TARGETS}
    at = {(r["variant"], r["requests"], r["blocks_per_request"]): r for r in doc["rows"]}
    grew = []
    for t in doc["targets"]:
        compared = t.get("compared") or by_name.get(t["name"])
        rows = (None if t["met"] or not compared else
                [at.get((v, t["requests"], t["blocks_per_request"])) for v in compared])
        if not rows or None in rows:
            grew.append(None)
            continue
        a, b = rows
        more = sorted(((a["parts_ms"][k] - b["parts_ms"].get(k, 0.0), k) for k in a["parts_ms"]),
                      reverse=True)
        grew.append({"compared": list(compared),
                     "parts": [[k, d] for d, k in more[:3] if d > GROWN_MS]})
    return {"labels": {"variants": VARIANTS, "targets": TARGETS}, "grew_most": grew}
