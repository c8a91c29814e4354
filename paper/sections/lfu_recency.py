"""Where frequency-first eviction loses (``lfu_recency.json``)."""

from __future__ import annotations

from paper.format import machine_line, md_table, pct
from paper.results import load


def lfu_recency_section(v: dict) -> None:
    """Where frequency-first eviction loses (``bench/tier_study/lfu_recency.py``; a study by name):
    the sequential-chat shape on held-out seeds, and the sketch's two changes on the tier study's
    workloads by part."""
    doc = load("lfu_recency")
    if doc is None:
        v["lfu_recency_text"] = ("*Where frequency loses has not been measured "
                                 "(`python -m bench --only lfu_recency`).*")
        return
    sm, shape = doc["summary"], doc["shape"]
    cfg, caps = shape["config"], shape["capacities"]
    share, ev = sm["cpu_hit_share_of_control"], sm["running_evictions"]
    seeds = sm["held_out_seeds"]
    rows = [[f"`{k}`", "-" if x is None else f"{x:.2f}",
             f"{ev[k]:,}" if k in ev else "-"]
            for k, x in share.items()]
    table = md_table(["setup", "CPU-hit tokens over `eager`'s", "running requests' CPU blocks "
                    "evicted"], [[ "`eager`", "1.00", f"{ev['eager']:,}"], *rows])
    parts = []
    for tag, by in doc["study_workloads"].items():
        cells = ", ".join(
            f"`{p}` {pct(r['parts']['train']['token_hit_rate'])} / "
            f"{pct(r['parts']['test']['token_hit_rate'])}" for p, r in by.items())
        parts.append(f"{doc['findings']['labels'][tag]}: {cells}")
    verdict = ("frequency loses here" if sm["lfu_loses"] else
               "frequency does not lose on the held-out seeds")
    v["lfu_recency_text"] = (
        f"**Where frequency loses** (`bench/tier_study/lfu_recency.py`; {machine_line(doc)}). A "
        f"long chat-like "
        "run in the real engine on a tier of 150 blocks gave `eager+lfu:64` a fraction of "
        "`eager`'s CPU hits. The simulator's sequential-chat shape (`--workload chat`: "
        f"{cfg['num_conversations']} conversations of {cfg['min_turns']}-{cfg['max_turns']} "
        f"turns starting over {cfg['start_window_s']:,.0f} s, about one at a time, a "
        f"{cfg['system_prompt_tokens']}-token shared system prompt, GPU "
        f"{caps['gpu_tokens']:,} and CPU {caps['cpu_tokens']:,} tokens) was sized on seed "
        f"{shape['chosen_seed']} to show it; on held-out seeds {seeds[0]}-{seeds[-1]} together "
        f"(`eager`: {sm['control_cpu_hit_tokens']:,} CPU-hit tokens), {verdict}:\n\n"
        + table + "\n\n"
        "Why: the sketch counts each admitted request's keys, and a conversation's early blocks "
        "are in every one of its later prompts, so they reach high counts. Once that "
        "conversation has ended they still rank above the next conversation's blocks, counted "
        "once or twice, and the tier evicts the live conversation's blocks (the last column) to "
        "keep the dead one's. Two changes to the sketch were measured: a shorter aging window "
        "(`lfu:4`) and counting only the keys past the GPU prefix hit (*miss only*, a setting "
        "of the study, not a setup). On the tier study's workloads at CPU = GPU (train / test "
        "hit rate): " + "; ".join(parts) + ". " + _lfu_verdicts(doc))


def _lfu_verdicts(doc: dict) -> str:
    """The study's verdict on each change, as it wrote them."""
    rule = doc["rule"]
    out = []
    labels = doc["findings"]["labels"]
    for c, worst in zip(doc["verdicts"], doc["findings"]["worst_vs_lfu64"], strict=True):
        where = ", ".join(f"{part} {pt:+.2f} points ({labels[tag]})"
                          for part, (tag, pt) in worst.items())
        out.append(f"`{c['change']}` {'recovers' if c['recovers_chat'] else 'does not recover'}"
                   f" the chat hits ({c['chat_cpu_hit_share_of_control']:.2f} of `eager`'s), "
                   f"worst against `lfu:64`: {where}; "
                   + ("adopted" if c["adopt"] else "not adopted"))
    adopted = [c["change"] for c in doc["verdicts"] if c["adopt"]]
    return (f"A change is adopted if it keeps at least {rule['recovers_share']:.0%} of "
            f"`eager`'s CPU hits on the chat shape's held-out seeds and loses at most "
            f"{rule['keeps_gain_points']:.1f} point against `lfu:64` on every workload's "
            f"{rule['judged_on']} part: " + "; ".join(out) + ". "
            + ("`lfu:64` stays as chosen: on traffic of one conversation at a time on a small "
               "tier, `eager` keeps the hits that frequency loses." if not adopted else
               "Adopted: " + ", ".join(f"`{a}`" for a in adopted) + "."))
