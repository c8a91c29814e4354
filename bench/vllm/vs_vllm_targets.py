"""The verdict of ``bench.vllm.vs_vllm``: its targets at R = 128 and 256 (``TARGET_RS``), each a
ratio of per-step medians of the same run (``RATIO_TARGETS``, which the paper's build also
reads) or the change from the smaller block count to the larger, judged on the study's rows.
"""

from __future__ import annotations

# The running requests the targets are judged at.
TARGET_RS = (128, 256)


def _target(name: str, r: int, blocks: int | str, value: float, target: str, ok: bool,
            measure: str, value_min: float | None = None,
            compared: tuple[str, str] | None = None) -> dict:
    """One verdict, judged on the medians; ``value_min`` is the same ratio of the fastest steps,
    beside it: on a loaded machine a long step is more often cut by the OS scheduler, so the
    medians of the longer variants carry more of others' time than the shorter ones'.
    ``compared``: the two variants of the ratio (numerator first), at ``r`` and ``blocks``."""
    return {"name": name, "requests": r, "blocks_per_request": blocks, "value": value,
            "target": target, "met": ok, "measure": measure, "value_min": value_min,
            "compared": None if compared is None else list(compared)}


# The ratio targets at each of ``TARGET_RS``: name, numerator and denominator variants (per-step
# medians), the target as written, and its check on (numerator, denominator).
RATIO_TARGETS = (
    ("fused_restore_over_vllm_control", "kvt_fused_restore", "vllm_control", "<= 1",
     lambda x, y: x <= y),
    ("fused_control_over_vllm_control", "kvt_fused_control", "vllm_control", "<= 0.6",
     lambda x, y: x <= 0.6 * y),
    ("rescan_over_fused_restore", "vllm_rescan_restore", "kvt_fused_restore", ">= 100",
     lambda x, y: x >= 100 * y),
    *((f"connector_over_planner_{mode}", f"kvt_connector_fused_{mode}", f"kvt_fused_{mode}",
       "<= 1.10", lambda x, y: x <= 1.10 * y) for mode in ("control", "restore")),
)


def targets(rows: list[dict]) -> list[dict]:
    """The targets at R = 128 and 256, for every block count run, each with its figure and
    verdict. Ratios are of per-step medians of the same run."""
    at = {(row["variant"], row["requests"], row["blocks_per_request"]): row for row in rows}
    out = []
    counts = sorted({row["blocks_per_request"] for row in rows})

    def ms(v, r, b, key="median_ms"):
        row = at.get((v, r, b))
        return None if row is None else row[key]

    def low(a, b, r, blocks):
        """The ratio a / b of the fastest steps."""
        x, y = ms(a, r, blocks, "min_ms"), ms(b, r, blocks, "min_ms")
        return None if x is None or y is None else x / y

    for b in counts:
        for r in TARGET_RS:
            for name, num, den, target, ok in RATIO_TARGETS:
                x, y = ms(num, r, b), ms(den, r, b)
                if x is not None and y is not None:
                    out.append(_target(name, r, b, x / y, target, ok(x, y),
                                       f"per-step time, {num} / {den}", low(num, den, r, b),
                                       (num, den)))
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        for r in TARGET_RS:
            for v in ("kvt_fused_control", "kvt_connector_fused_control"):
                a, z = ms(v, r, lo), ms(v, r, hi)
                if a is not None and z is not None:
                    out.append(_target(f"blocks_{lo}_to_{hi}_{v}", r, f"{lo}->{hi}", z / a,
                                       "within 0.8-1.2", 0.8 < z / a < 1.2,
                                       "per-step time, same new blocks per step",
                                       ms(v, r, hi, "min_ms") / ms(v, r, lo, "min_ms")))
            for v in ("kvt_fused_restore", "kvt_connector_fused_restore"):
                a, z = at.get((v, r, lo)), at.get((v, r, hi))
                if a is None or z is None or not a["us_per_stored_block"] \
                        or not z["us_per_stored_block"]:
                    continue
                more = z["stored_per_step"] / a["stored_per_step"]
                if abs(more - 1) <= 0.05:
                    # Evictions per request: as many blocks change per step at both counts.
                    ratio = z["median_ms"] / a["median_ms"]
                    measure = (f"per-step time, {z['stored_per_step']:.0f} and "
                               f"{a['stored_per_step']:.0f} blocks stored per step")
                    fastest = z["min_ms"] / a["min_ms"]
                else:
                    # A share of the cached blocks evicted: the changes grow with the blocks
                    # held, so the cost per block changed is what may not grow.
                    ratio = z["us_per_stored_block"] / a["us_per_stored_block"]
                    measure = (f"time per stored block: {more:.1f}x the blocks stored per step "
                               f"at {hi} (per-step time {z['median_ms'] / a['median_ms']:.2f}x)")
                    fastest = None
                out.append(_target(f"blocks_{lo}_to_{hi}_{v}", r, f"{lo}->{hi}", ratio,
                                   "within 0.8-1.2", 0.8 < ratio < 1.2, measure, fastest))
    return out
