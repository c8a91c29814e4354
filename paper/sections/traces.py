"""The traces: the GLM-5 trace's load and the cache-only replays (``replay_<tag>.json``)."""

from __future__ import annotations

from kvtriton.plots import plot_sweep
from paper.format import machine_line, md_table, pct
from paper.results import FIGURES, load


def glm5_section(v: dict) -> None:
    """What the GLM-5 prefill trace is and the load it runs at (the setup study's finding)."""
    doc = load("setups_glm5") or load("setups_glm5_full")
    if doc is None:
        v["glm5_text"] = "*Pending: `python -m bench --only setups` has not been run.*"
        return
    g = doc["findings"]["serving_load"]
    v["glm5_text"] = (
        f"The GLM-5 prefill trace (Alibaba's tair-kvcache sample) is {g['requests']:,} prefill "
        f"requests (one output token each) sampled from a production cluster over "
        f"{g['trace_span_s']:.1f} s; it runs with its arrivals spread {g['time_scale']:g}x, "
        f"a serving condition fixed from the trace and the cost model before any tier ran on "
        f"it: the prompts' prefill without any cache would take {g['prefill_share']:.0%} of the "
        "modeled GPU's time, a moderate load where Mooncake's second half is overloaded.")


def replay_section(v: dict) -> None:
    parts, tables = [], []
    v["mooncake_claim"] = ""
    for tag in ("mooncake", "agent", "cc_agentic"):
        doc = load(f"replay_{tag}")
        if doc is None:
            continue
        s, label = doc["sweep"], doc["findings"]["label"]
        setups = list(s["hit_rate"])
        header = ["capacity (tokens)", *setups]
        rows = [[f"{c:,}"] + [pct(s["hit_rate"][p][i]) for p in setups]
                for i, c in enumerate(s["capacities_tokens"])]
        rows.append(["infinite"] + [pct(s["max_hit_rate"])] * len(setups))
        tables.append(f"**{label}** ({s['requests']:,} requests, {s['hash_block_size']}-token "
                      f"blocks; {machine_line(doc)}):\n\n" + md_table(header, rows))
        plot_sweep(s, FIGURES / f"replay_{tag}.png")
        parts.append(f"![{label}: hit rate vs capacity](figures/replay_{tag}.png)")
        c = doc["findings"]["compared"]
        if tag == "mooncake" and c is not None:
            v["mooncake_claim"] = (
                f"On the shipped Mooncake trace the infinite-cache maximum is "
                f"{pct(s['max_hit_rate'])} (the paper reports a 66% cache ratio for its "
                f"synthetic trace), and a {c['tokens'] / 1e6:g}M-token LRU cache reaches "
                f"{pct(c['lru'])}, {c['lru_share_of_max']:.2f} of the maximum, where the paper "
                f"reports under half; Belady's MIN reaches {pct(c['belady'])} at the same size.")
    v["replay_tables"] = "\n\n".join(tables) or "*Pending: no replay results.*"
    v["fig_replay"] = "\n\n".join(parts)
