"""The planner's cost per step as the running requests grow (``planner.json``)."""

from __future__ import annotations

from bench.plots import PLANNER_VARIANTS, plot_planner
from paper.format import fmt_ms, machine_line, md_table
from paper.results import FIGURES, load, vs_vllm_doc


def _bookkeeping(doc: dict) -> str:
    """The study's re-store run with the most re-stores per step: its bookkeeping against its
    selection."""
    b = doc["findings"]["bookkeeping"]
    if b is None:
        return "no measured run re-stored anything"
    verb = "more" if b["bookkeeping_ms"] > b["select_ms"] else "less"
    return (f"at {b['requests']} running requests and {b['restores_per_step']:,.0f} re-stores "
            f"per step it took {b['bookkeeping_ms']:.2f} ms, {verb} than the "
            f"{b['select_ms']:.2f} ms of the vectorized selection that chose them")


def planner_section(v: dict) -> None:
    doc = load("planner")
    from kvtriton.pool import BlockPool

    v["batch_min"] = str(BlockPool.batch_min)
    v["bookkeeping_text"] = ("the planner benchmark has not been run" if doc is None
                             else _bookkeeping(doc))
    if doc is None:
        v["planner_text"] = "*Pending: `python -m bench.planner.scaling` has not been run.*"
        v["planner_table"] = v["fig_planner"] = ""
        v["abstract_planner"] = "the planner benchmark has not been run"
        return
    c = doc["conditions"]
    rows = [r for r in doc["rows"] if r["evict_fraction"] == c["evict_fraction"]]
    calm = {r["variant"]: r for r in doc["rows"]
            if r["evict_fraction"] == 0.0 and r["requests"] == 128}
    names = PLANNER_VARIANTS
    sizes = sorted({r["requests"] for r in rows})
    by = {(r["variant"], r["requests"]): r for r in rows}
    header = ["running requests"] + [f"{names[k]} (ms)" for k in names]
    table_rows = []
    for n in sizes:
        cells = [str(n)]
        for k in names:
            r = by.get((k, n))
            cells.append("-" if r is None
                         else f"{r['select_median_ms']:.3f} / {r['median_ms']:.3f}")
        table_rows.append(cells)
    v["planner_table"] = (
        f"Planner cost per step, ms (selection / whole build_meta), "
        f"{c['blocks_per_request']:,} blocks per request, {c['evict_fraction']:.0%} of the "
        f"CPU-cached blocks evicted before each step ({machine_line(doc)}):\n\n"
        + md_table(header, table_rows))
    t = doc["targets"]
    lines = [f"Machine: {machine_line(doc)}. Conditions: {c['blocks_per_request']:,} blocks of "
             f"{c['block_tokens']} tokens per request, {c['evict_fraction']:.0%} of the "
             f"CPU-cached blocks evicted before each step, median of {c['timed_steps']} timed "
             "steps after warm-up."]
    lines.append("Each cell is *selection / whole `build_meta`*: the scan that decides what "
                 "to store, then the same plus allocating CPU blocks and pinning GPU blocks "
                 "for every selected block.")
    if "fused_restore" in calm and "loop_control" in calm:
        lines.append(f"With nothing evicted between steps (nothing to re-store, only the cost of "
                     f"looking), the fused re-store scan selects in "
                     f"{calm['fused_restore']['select_median_ms']:.3f} ms at 128 requests, the "
                     f"loop control in {calm['loop_control']['select_median_ms']:.3f} ms.")
    bullets = []
    for key, label in (("fused_vs_loop_restore_speedup_at_128",
                        "fused re-store versus loop re-store at 128 requests"),
                       ("fused_restore_over_loop_control_at_128",
                        "fused re-store over loop control at 128 requests"),
                       ("fused_restore_ms_at_128", "fused re-store at 128 requests")):
        if key in t:
            x = t[key]
            bullets.append(f"- Target {label}: {x['value']:.3g} (target {x['target']}), "
                         f"{'met' if x['met'] else '**missed**'}"
                         + (f"; measured on {x['measure']}" if "measure" in x else "") + ".")
    v["planner_text"] = "\n\n".join(lines) + "\n\n" + "\n".join(bullets)
    f = by.get(("fused_restore", 128))
    lr = by.get(("loop_restore", 128))
    key = "select_median_ms"
    if f and lr:
        v["abstract_planner"] = (f"at 128 running requests of 2,048 blocks the fused scan "
                                 f"selects in {fmt_ms(f[key])} per step against {fmt_ms(lr[key])} "
                                 "for the same semantics as a per-block loop")
    else:
        v["abstract_planner"] = "see Section 3.2"
    plot_planner(doc, FIGURES / "planner.png", vs_vllm_doc())
    v["fig_planner"] = "![planner cost per step](figures/planner.png)"
