"""The traces: the GLM-5 trace's load and the cache-only replays (``replay_<tag>.json``)."""

from __future__ import annotations

from kvtriton.plots import plot_sweep
from paper.format import machine_line, md_table, pct
from paper.results import FIGURES, load


def glm5_section(v: dict) -> None:
    """What the GLM-5 prefill trace is and the load it runs at, from the trace and the cost
    model (its time scale was fixed so, before any tier ran on it)."""
    from kvtriton.sim.cost import CostModel
    from kvtriton.sim.workloads import GLM5_TIME_SCALE, serving_workload

    wl, _ = serving_workload("glm5")
    span = wl.requests[-1].arrival_s - wl.requests[0].arrival_s
    busy = sum(CostModel.named().prefill_s(r.prompt_len, 0) for r in wl.requests)
    v["glm5_text"] = (
        f"The GLM-5 prefill trace (Alibaba's tair-kvcache sample) is {len(wl):,} prefill requests "
        f"(one output token each) sampled from a production cluster over "
        f"{span / GLM5_TIME_SCALE:.1f} s; it runs with its arrivals spread {GLM5_TIME_SCALE:g}x, "
        f"a serving condition fixed from the trace and the cost model before any tier ran on "
        f"it: the prompts' prefill without any cache would take {busy / span:.0%} of the "
        "modeled GPU's time, a moderate load where Mooncake's second half is overloaded.")


def replay_section(v: dict) -> None:
    parts, tables = [], []
    for tag, label in (("mooncake", "Mooncake synthetic trace"), ("agent", "agent generator"),
                       ("cc_agentic", "coding-agent traces")):
        doc = load(f"replay_{tag}")
        if doc is None:
            continue
        s = doc["sweep"]
        setups = list(s["hit_rate"])
        header = ["capacity (tokens)", *setups]
        rows = [[f"{c:,}"] + [pct(s["hit_rate"][p][i]) for p in setups]
                for i, c in enumerate(s["capacities_tokens"])]
        rows.append(["infinite"] + [pct(s["max_hit_rate"])] * len(setups))
        tables.append(f"**{label}** ({s['requests']:,} requests, {s['hash_block_size']}-token "
                      f"blocks; {machine_line(doc)}):\n\n" + md_table(header, rows))
        plot_sweep(s, FIGURES / f"replay_{tag}.png")
        parts.append(f"![{label}: hit rate vs capacity](figures/replay_{tag}.png)")
        if tag == "mooncake":
            caps = s["capacities_tokens"]
            if 3_000_000 in caps:
                i = caps.index(3_000_000)
                lru = s["hit_rate"]["lru"][i]
                v["mooncake_claim"] = (
                    f"On the shipped Mooncake trace the infinite-cache maximum is "
                    f"{pct(s['max_hit_rate'])} (the paper reports a 66% cache ratio for its "
                    f"synthetic trace), and a 3M-token LRU cache reaches {pct(lru)}, "
                    f"{lru / s['max_hit_rate']:.2f} of the maximum, where the paper reports "
                    "under half; Belady's MIN reaches "
                    f"{pct(s['hit_rate']['belady'][i])} at the same size.")
    v["replay_tables"] = "\n\n".join(tables) or "*Pending: no replay results.*"
    v["fig_replay"] = "\n\n".join(parts)
    v.setdefault("mooncake_claim", "")
