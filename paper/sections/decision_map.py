"""Which setup wins where: each study cell against the workload's traits
(``setups_<tag>.json``)."""

from __future__ import annotations

from paper.format import md_table, pct, points, share_pct
from paper.results import FIGURES, setup_docs


def decision_map_section(v: dict) -> None:
    """Which setup wins where: the study's cells against the workload traits, each winner
    chosen on the train part with its test-part figures, and the rules they support."""
    cells = [c for doc in setup_docs().values() for c in doc["findings"]["map_cells"]]
    if not cells:
        v["decision_map_text"] = ("*Pending: no setup results with a train/test split "
                                  "(`python -m bench --only setups`).*")
        v["fig_decision_map"] = ""
        return
    from bench.plots import plot_decision_map

    plot_decision_map(cells, FIGURES / "decision_map.png")
    queue = ("queueing delay p50 (s)" if all(c["queue_measured"] for c in cells)
             else "TTFT p50 (s)") + ", test part"
    rows = [[c["label"], pct(c["within_gpu"]), pct(c["within_tier"]),
             "-" if c["turns"] is None else f"{c['turns']:.1f}", pct(c["continue"]),
             f"{c['queue_p50_s']:.2f}", f"{c['oracle_gain_points']:+.1f}",
             f"`{c['winner']}`" if c["winner"] else "none gains",
             points(c["train_points"]), points(c["test_points"]),
             "-" if c["no_gap"] else share_pct(c["test_headroom_share"])]
            for c in cells]
    table = md_table(["cell (workload, CPU/GPU)", "reuses within GPU", "within GPU + CPU",
                    "turns per session", "requests hinted continue", f"control's {queue}",
                    "next use's test gain (points)", "chosen on train",
                    "train gain (points)", "test gain (points)", "test share of headroom"],
                     rows)
    claims = []
    by_winner: dict[str, list[dict]] = {}
    for c in cells:
        by_winner.setdefault(c["winner"] or "", []).append(c)
    for w, cs in sorted(by_winner.items(), key=lambda kv: -len(kv[1])):
        where = ", ".join(c["label"] for c in cs)
        hinted = sorted({c["hinted"] for c in cs})
        within = [c["within_tier"] for c in cs]
        tier = (pct(within[0]) if len(set(within)) == 1 else
                f"{pct(min(within))}-{pct(max(within))}")
        gains = [c["test_points"] for c in cs if c["test_points"] is not None]
        if not w:
            claims.append(f"- No online setup gains on its train part in {len(cs)} cell(s) "
                          f"({where}): there the control stays; reuses within the tier "
                          f"{tier}.")
            continue
        span = (f"{min(gains):+.2f}" if len(set(gains)) == 1 else
                f"{min(gains):+.2f} to {max(gains):+.2f}") if gains else ""
        test = f"; on the test part {span} points over the control" if gains else ""
        held = [c for c in cs if c["test_points"] is not None and c["test_points"] < 0]
        claims.append(
            f"- `{w}` is chosen in {len(cs)} cell(s) ({where}): "
            + ("all with continue hints" if hinted == [True] else "none with hints"
               if hinted == [False] else "with and without hints")
            + f", reuses within the tier {tier}{test}"
            + (f"; it does **not** hold on the test part of {', '.join(c['label'] for c in held)}"
               if held else "") + ".")
    v["decision_map_text"] = (
        "Each cell of the study (workload x CPU capacity) against what a server operator can "
        "measure of the workload: the share of prompt-block reuses whose distance (prompt "
        "tokens between two uses, `kvtriton.sim.trace_stats.reuse_distances`) fits in the GPU "
        "and in the GPU + CPU capacity, turns per session, the share of requests a client hints "
        f"`continue`, and the offered load as the control's {queue}. The setup is the best "
        "online one on the train part (Section {{sec_which}}'s rule); the shares and the gain "
        "are the test part's.\n\n" + table + "\n\nWhat the cells support:\n\n"
        + "\n".join(claims))
    v["fig_decision_map"] = "![decision map](figures/decision_map.png)"
