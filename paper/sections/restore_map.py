"""Where re-store pays: the re-store maps (``restore_map_<tag>.json``)."""

from __future__ import annotations

from bench.plots import plot_restore_map
from paper.format import machine_line
from paper.results import FIGURES, MAP_TAGS, load


def restore_map_section(v: dict) -> None:
    docs = {tag: doc for tag in MAP_TAGS if (doc := load(f"restore_map_{tag}"))}
    if not docs:
        v["restore_map_text"] = "*Pending: `python -m bench.tier_study.setups --only map`.*"
        v["fig_restore_map"] = ""
        v["abstract_restore"] = "the re-store map has not been run"
        return
    labels = {tag: doc["findings"]["label"] for tag, doc in docs.items()}
    lines, figs, summary = [], [], []
    for tag, doc in docs.items():
        lines.append(f"**{labels[tag]}**: `{doc['workload']}` ({doc['requests']:,} requests), "
                     f"GPU {doc['gpu_tokens']:,} tokens; {machine_line(doc)}. Each cell: the token "
                     "hit rate of the re-store form minus that of `eager` at the same capacity "
                     "and concurrency.")
        for form, f in doc["findings"]["forms"].items():
            best, worst, most = f["best"], f["worst"], f["most_thrash"]
            lines.append(
                f"- `{form}`: gains more than 0.1 point in {f['gains']} of {f['cells']} cells and "
                f"loses more than 0.1 point in {f['losses']}; best {100 * best[0]:+.1f} points "
                f"(max_running {best[1]}, CPU {best[2]:g}x), worst {100 * worst[0]:+.1f} "
                f"points (max_running {worst[1]}, CPU {worst[2]:g}x); most re-store thrash "
                f"{most[0]:,} (max_running {most[1]}, CPU {most[2]:g}x).")
            summary.append((tag, form, f["gains"], f["losses"], f["cells"], best[0], worst[0]))
        plot_restore_map(doc, FIGURES / f"restore_map_{tag}.png")
        figs.append(f"![{labels[tag]}: re-store gain over eager](figures/"
                    f"restore_map_{tag}.png)")
    total = sum(n for *_, n, _, _ in summary)
    pays = sum(p for _, _, p, _, _, _, _ in summary)
    hurts = sum(h for _, _, _, h, _, _, _ in summary)
    top = max(summary, key=lambda x: x[5])
    verdict = (f"Over every map and both forms, re-store gains more than 0.1 point of hit rate "
               f"in {pays} of {total} cells and loses more than 0.1 point in {hurts}; its best "
               f"gain is {100 * top[5]:+.1f} points (`{top[1]}`, {labels[top[0]]}).")
    v["restore_map_text"] = verdict + "\n\n" + "\n\n".join(lines)
    v["abstract_restore"] = verdict[0].lower() + verdict[1:] + " In detail: " + "; ".join(
        f"`{form}` gains more than 0.1 point over eager stores in {p} of {n} cells of the "
        f"{labels[tag]} map and loses in {h} (best {100 * b:+.1f}, worst {100 * w:+.1f} points)"
        for tag, form, p, h, n, b, w in summary)
    v["fig_restore_map"] = "\n\n".join(figs)
