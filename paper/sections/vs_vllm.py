"""The planner beside vLLM's own scheduler in one process (``vs_vllm*.json``)."""

from __future__ import annotations

from bench.plots import plot_vs_vllm
from paper.format import machine_line, md_table
from paper.results import FIGURES, load, vs_vllm_doc


def _evictions(settings: dict) -> str:
    """What the scenario evicts before each step, as ``bench.vllm.vs_vllm`` recorded it."""
    if settings.get("evict_per_request") is not None:
        return (f"{settings['evict_per_request']} of the CPU's cached blocks per running "
                "request, its LRU victims, evicted before each step (as many at every block "
                "count)")
    return (f"{settings['evict_fraction']:.0%} of the CPU's cached blocks, its LRU victims, "
            "evicted before each step")


def _abstract_vs_vllm(doc: dict) -> str:
    """The abstract's clause on the planner beside vLLM's own scheduler: the whole step with
    re-store over vLLM's control step, and the re-scan design over it, at the targets' sizes
    (each cell as measured, in ``vs_vllm.json``)."""
    by = {(t["name"], t["requests"], t["blocks_per_request"]): t["value"]
          for t in doc["targets"]}
    cells = sorted({(r, b) for n, r, b in by if n == "fused_restore_over_vllm_control"})
    if not cells:
        return ""
    ratio = " / ".join(f"{by['fused_restore_over_vllm_control', r, b]:.2f}" for r, b in cells)
    where = " / ".join(f"R = {r}, {b:,} blocks" for r, b in cells)
    text = (f"; beside vLLM {doc['settings']['vllm']}'s own scheduler, in one process, a whole "
            f"step that also re-stores costs {ratio} of vLLM's control step ({where})")
    if all(("rescan_over_fused_restore", r, b) in by for r, b in cells):
        rescan = " / ".join(f"{by['rescan_over_fused_restore', r, b]:.0f}" for r, b in cells)
        text += f", and re-scanning for the holes instead costs {rescan}x as much"
    return text


def _where_time_went(grew: dict | None) -> str:
    """For a missed ratio target: the parts in which its numerator's step exceeded the
    denominator's most, as the study found them."""
    if not grew or not grew["parts"]:
        return ""
    return (f"; the parts that grew most over `{grew['compared'][1]}`: "
            + ", ".join(f"{k} +{d:.3f} ms" for k, d in grew["parts"]))


def _sizes_table(doc: dict) -> str:
    """Whole-step medians (ms) of every variant at every size run, one table per block count;
    a size whose variants ran in groups is starred."""
    grouped = {(g["requests"], g["blocks_per_request"])
               for g in doc["settings"].get("grouped", [])}
    out = []
    for blocks in sorted({r["blocks_per_request"] for r in doc["rows"]}):
        rows = [r for r in doc["rows"] if r["blocks_per_request"] == blocks]
        sizes = sorted({r["requests"] for r in rows})
        at = {(r["variant"], r["requests"]): r["median_ms"] for r in rows}
        header = ["variant"] + [f"R = {n}" + ("*" if (n, blocks) in grouped else "")
                                for n in sizes]
        names = doc["findings"]["labels"]["variants"]
        body = [[names.get(v, v)] + [f"{at[v, n]:.3f}" if (v, n) in at else "-" for n in sizes]
                for v in dict.fromkeys(r["variant"] for r in rows)]
        out.append(f"Whole step, ms (median), {blocks:,} blocks per request:\n\n"
                   + md_table(header, body))
    note = ("\n\n\\* run in groups (see above)." if grouped else "")
    return "\n\n".join(out) + note


def _evict_share_text(doc: dict | None) -> str:
    """The same targets with evictions as a share of the cached blocks (``bench.vllm.vs_vllm --name
    vs_vllm_evict_share``): the blocks a re-store step redoes grow with the context there."""
    if doc is None:
        return ("\n\nWith evictions as a share of the cached blocks (the study "
                "`vs_vllm_evict_share`): *not run* (`python -m bench --only vs_vllm_evict_share`).")
    s = doc["settings"]
    at = {(r["variant"], r["requests"], r["blocks_per_request"]): r for r in doc["rows"]}
    by = {(t["name"], t["requests"], t["blocks_per_request"]): t for t in doc["targets"]}
    cells = sorted({(r, b) for v, r, b in at if v == "kvt_fused_restore"}, key=lambda c: c[::-1])
    parts = []
    for r, b in cells:
        row, t = at["kvt_fused_restore", r, b], by.get(("fused_restore_over_vllm_control", r, b))
        if t is None:
            continue
        parts.append(f"R = {r}, {b:,} blocks: {t['value']:.2f} of vLLM's control "
                     f"({'met' if t['met'] else '**missed**'}), {row['stored_per_step']:,.0f} "
                     f"blocks stored per step, {row['us_per_stored_block']:.3f} us each")
    growth = [f"R = {t['requests']}: {t['measure']}" for t in doc["targets"]
              if t["name"] == "blocks_2048_to_8192_kvt_fused_restore"]
    text = (f"\n\nWith evictions as a share of the cached blocks instead "
            f"({_evictions(s)}; `python -m bench --only vs_vllm_evict_share`, "
            f"{machine_line(doc)}), the blocks evicted per step, and so the blocks re-store "
            "redoes, grow with the blocks held: the fused re-store step over vLLM's control step, "
            + "; ".join(parts) + ".")
    if growth:
        text += " From 2,048 to 8,192 blocks, " + "; ".join(growth) + "."
    return text


def vs_vllm_section(v: dict) -> None:
    """Section 3.1's comparison with vLLM's own scheduler, measured in the same process
    (``bench.vllm.vs_vllm``): per-step time by part at the targets' sizes, and each target's
    verdict, all from ``vs_vllm.json``."""
    doc = vs_vllm_doc()
    v["abstract_vs_vllm"] = ""
    if doc is None:
        v["vs_vllm_text"] = ("*Pending: `python -m bench.vllm.vs_vllm` (needs vLLM) has not "
                             "been run.*")
        v["vs_vllm_table"] = ""
        return
    v["abstract_vs_vllm"] = _abstract_vs_vllm(doc)
    labels = doc["findings"]["labels"]
    s = doc["settings"]
    parts = s["parts"]
    sizes = sorted({t["requests"] for t in doc["targets"]}) or sorted(
        {r["requests"] for r in doc["rows"]})
    header = ["variant", "R", "blocks", "ms per step", "fastest (ms)", "x vLLM control"] + \
        [f"{p} (ms)" for p in parts]
    rows = []
    for r in doc["rows"]:
        if r["requests"] not in sizes:
            continue
        rows.append([labels["variants"].get(r["variant"], r["variant"]), str(r["requests"]),
                     f"{r['blocks_per_request']:,}", f"{r['median_ms']:.3f}",
                     f"{r['min_ms']:.3f}" if "min_ms" in r else "-",
                     f"{1 / r['x_vs_vllm_control']:.2f}" if r.get("x_vs_vllm_control")
                     else "-"]
                    + [f"{r['parts_ms'][p]:.3f}" for p in parts])
    m = doc["machine"]
    lines = [f"Beside vLLM {s['vllm']}'s own scheduler, in one process "
             f"(`python -m bench.vllm.vs_vllm`): {machine_line(doc)}. Every variant runs the same "
             f"scenario, interleaved step by step: R running requests of "
             f"{' or '.join(f'{b:,}' for b in s['blocks_per_request'])} blocks of "
             f"{s['block_tokens']} tokens, one new block each per step, "
             f"{_evictions(s)}; median of {s['steps']} timed steps "
             "(the verdicts are on "
             "the medians; on a loaded machine the OS scheduler cuts the longer steps more "
             "often, so each target also gives the ratio of the fastest steps). The parts are "
             "the medians of the "
             "planner's own counters for kvtriton and of timed extra steps for vLLM, whose "
             "manager's table updates and batch fall under *meta*."]
    if m.get("vllm") and m["vllm"] != s["vllm"]:
        lines.append(f"(vLLM imported: {m['vllm']}.)")
    bullets = []
    for t, grew in zip(doc["targets"], doc["findings"]["grew_most"], strict=True):
        label = labels["targets"].get(t["name"], t["name"].replace("_", " "))
        low = "" if t.get("value_min") is None else \
            f"; the same ratio of the fastest steps: {t['value_min']:.3g}"
        bullets.append(f"- Target {label}, R = {t['requests']}, {t['blocks_per_request']} "
                       f"blocks: {t['value']:.3g} (target {t['target']}), "
                       f"{'met' if t['met'] else '**missed**'}; {t['measure']}{low}"
                       f"{_where_time_went(grew)}.")
    if s.get("grouped"):
        lines.append("Run in groups: " + ", ".join(
            f"R = {k['requests']} at {k['blocks_per_request']:,} blocks" for k in s["grouped"])
            + f": the variants' pools together would hold more than {s['max_blocks_held']:,} "
            "blocks, past this machine's memory, so they ran in groups, each interleaved step by "
            "step on its own, one group after the other; the table's rows name their group.")
    share = _evict_share_text(load("vs_vllm_evict_share"))
    v["vs_vllm_text"] = "\n\n".join(lines) + "\n\n" + "\n".join(bullets) + share
    v["vs_vllm_table"] = (f"Per-step time and its parts at R = "
                          f"{', '.join(map(str, sizes))}:\n\n" + md_table(header, rows))
    if len({r["requests"] for r in doc["rows"]}) > 1:
        plot_vs_vllm(doc, FIGURES / "vs_vllm.png")
        v["vs_vllm_table"] += ("\n\n" + _sizes_table(doc) + "\n\n![whole-step time beside "
                               "vLLM's, every size run](figures/vs_vllm.png)")
