"""Same-step loads: the per-step byte budget chosen on train parts, judged on test parts
(``sync_loads.json``)."""

from __future__ import annotations

from paper.format import md_table, pct
from paper.results import load, not_run


def sync_loads_section(v: dict) -> None:
    doc = load("sync_loads")
    if doc is None:
        v["sync_loads_text"] = (f"**Same-step loads.** *Pending: `sync_loads.json` is "
                                f"{not_run('sync_loads.json')}.*")
        return
    budgets = ", ".join(f"{b['budget_mib']:g} MiB ({b['link_ms']:.0f} ms of the link)"
                        for b in doc["budgets"] if b["budget_bytes"])
    rows = []
    for c in doc["cells"]:
        off, on = c["test_budget_0"], c["test_chosen"]
        rows.append([f"{c['workload']}, CPU {c['cpu_ratio']}x", f"{c['chosen_budget_mib']:g}",
                     f"{off['ttft_p50_s']:.3f} / {on['ttft_p50_s']:.3f}",
                     f"{off['ttft_p90_s']:.3f} / {on['ttft_p90_s']:.3f}",
                     f"{pct(off['token_hit_rate'])} / {pct(on['token_hit_rate'])}",
                     "yes" if c["test_ttft_no_worse"] else "**no**"])
    overall = doc["overall"]
    worse = [c["workload"] for c in doc["cells"]
             if c["test_chosen"]["ttft_p50_s"] > c["test_budget_0"]["ttft_p50_s"]]
    v["sync_loads_text"] = (
        "**Same-step loads.** vLLM 0.33's offloading connector can load a small CPU hit in the "
        "step that schedules it, within a per-step byte budget, instead of a step later; the "
        "step then waits for the load. kvtriton does the same (`sync_load_budget_bytes`, "
        "`kvtriton/sync_loads.py`, in the connector and the simulator). Under "
        f"`{doc['setup']}`, the budget is chosen per workload on the train part among 0 and "
        f"{budgets}: the lowest train TTFT p50 whose p50 and p90 stay within one step of budget "
        "0's; its test part beside budget 0's (TTFT modeled, seconds):\n\n"
        + md_table(["workload", "chosen (MiB/step)", "TTFT p50 off / chosen",
                    "TTFT p90 off / chosen", "hit rate off / chosen", "no worse on test"], rows)
        + f"\n\nOne budget for every workload, on the train parts: {overall['budget_mib']:g} "
        f"MiB per step (mean train p50 {overall['mean_train_p50_ratio']:.3f}x budget 0's). "
        + (f"The train choice raised the test part's TTFT p50 on {', '.join(worse)}: the "
           "budget does not carry from one part to the other here, and the connector leaves "
           "it off by default." if worse else
           "The train choice lowered or kept the test part's TTFT p50 everywhere."))
