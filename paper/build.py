"""Regenerate ``paper/paper.md``, its figures and ``docs/results.md`` from ``bench/results/``.

Every number in the paper comes from a results file written by ``python -m bench``; the prose
lives in ``paper/template.md`` with ``{{name}}`` placeholders that this script fills. ``INPUTS``
are the results files it reads. One that the quick run always writes (``bench/studies.py``) must
be there: the build stops with one line naming it, unless ``--allow-missing`` is given; any other
(a GPU run, a full-size run) leaves its section marked as pending. The paper lists every input
with the commit it came from and whether the tracked code was clean (``MANIFEST.json`` beside
the results, else the file's own machine block), so it always states what was and was not run.

Run: ``python paper/build.py [--allow-missing]`` (after ``make bench``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAPER = ROOT / "paper"
FIGURES = PAPER / "figures"

sys.path.insert(0, str(ROOT))

from bench.studies import always_written, writers  # noqa: E402
from bench.vllm.vs_vllm_targets import RATIO_TARGETS  # noqa: E402 - the repo root goes first
from kvtriton.plots import (  # noqa: E402
    PLANNER_VARIANTS,
    plot_gain_over_control,
    plot_hole,
    plot_kernels,
    plot_planner,
    plot_restore_map,
    plot_sweep,
    plot_vs_vllm,
)

WORKLOADS = (("agent", "agent generator"), ("cc_agentic", "coding-agent traces"),
             ("mooncake", "Mooncake trace"), ("glm5", "GLM-5 prefill trace"))
# The workloads with a re-store map (``bench.tier_study.setups.FULL_MAPS``).
MAP_TAGS = ("agent", "cc_agentic", "mooncake")
# Every results file the paper reads, by name (``bench/results/<name>.json``).
INPUTS = ("hole_demo", "planner", "vs_vllm", "vs_vllm_quick", "vs_vllm_evict_share",
          *(f"setups_{key}" for tag, _ in WORKLOADS for key in (tag, f"{tag}_full")),
          *(f"restore_map_{tag}" for tag in MAP_TAGS),
          "replay_mooncake", "replay_agent", "replay_cc_agentic", "kernel_check", "bench_kernels",
          "vllm_engine", "tune_shares", "conversational_gap", "lfu_recency")


def _load(name: str) -> dict | None:
    if name not in INPUTS:
        raise KeyError(f"{name!r} is not in INPUTS, the list of the paper's results files")
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def missing_inputs() -> list[str]:
    """The inputs the quick run always writes that are not in ``bench/results/``."""
    return [n for n in INPUTS
            if always_written(f"{n}.json") and not (RESULTS / f"{n}.json").exists()]


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _ms(x: float) -> str:
    return f"{x:.3g} ms" if x < 10 else f"{x:.0f} ms"


def _machine(doc: dict | None) -> str:
    if not doc:
        return "not run"
    m = doc["machine"]
    gpu = m["gpu"] or "no GPU"
    return (f"{m['cpu']} ({m['cpu_cores']} cores), {gpu}; torch {m['torch']}, triton "
            f"{m['triton']}; commit {m['git_sha']}, {m['date_utc']}")


def _table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---"
                                                             for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def hole_section(v: dict) -> None:
    doc = _load("hole_demo")
    if doc is None:
        v["hole_text"] = "*Pending: `python -m bench.planner.hole_demo` has not been run.*"
        v["fig_hole"] = ""
        return
    by = {r["restore"]: r for r in doc["rows"]}
    n = doc["blocks"]
    v["hole_text"] = (
        f"In the run behind the figure ({_machine(doc)}), a request stores its {n} blocks and "
        f"the CPU then evicts block {doc['evicted_position'] + 1}. With the cursor-only control "
        f"the next step copies {by[False]['phases']['next_step']['blocks_copied']} blocks and a "
        f"new request with the same prefix hits {by[False]['probe_hit_blocks']} of {n} blocks "
        f"({by[False]['chain_holes']} blocks sit in the CPU past the hole, unreachable); with "
        f"re-store the next step copies {by[True]['phases']['next_step']['blocks_copied']} block "
        f"and the new request hits {by[True]['probe_hit_blocks']} of {n}.")
    plot_hole(doc, FIGURES / "hole.png")
    v["fig_hole"] = "![CPU presence of a running request's blocks](figures/hole.png)"


def _bookkeeping(doc: dict) -> str:
    """The re-store run with the most re-stores per step: its bookkeeping (the whole
    ``build_meta`` less the selection) against its selection, both measured."""
    runs = [r for r in doc["rows"] if r["restores_per_step"] > 0 and "fused" in r["variant"]]
    if not runs:
        return "no measured run re-stored anything"
    r = max(runs, key=lambda r: (r["restores_per_step"], r["requests"]))
    rest = r["median_ms"] - r["select_median_ms"]
    verb = "more" if rest > r["select_median_ms"] else "less"
    return (f"at {r['requests']} running requests and {r['restores_per_step']:,.0f} re-stores "
            f"per step it took {rest:.2f} ms, {verb} than the {r['select_median_ms']:.2f} ms of "
            "the vectorized selection that chose them")


def planner_section(v: dict) -> None:
    doc = _load("planner")
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
        f"CPU-cached blocks evicted before each step ({_machine(doc)}):\n\n"
        + _table(header, table_rows))
    t = doc["targets"]
    lines = [f"Machine: {_machine(doc)}. Conditions: {c['blocks_per_request']:,} blocks of "
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
                                 f"selects in {_ms(f[key])} per step against {_ms(lr[key])} "
                                 "for the same semantics as a per-block loop")
    else:
        v["abstract_planner"] = "see Section 3.2"
    plot_planner(doc, FIGURES / "planner.png", _vs_vllm())
    v["fig_planner"] = "![planner cost per step](figures/planner.png)"


# The variants of ``bench.vllm.vs_vllm`` in the paper's words.
VS_VLLM_VARIANTS = {
    "vllm_control": "vLLM control (cursor scan)",
    "vllm_rescan_restore": "vLLM re-scan re-store",
    "kvt_loop_control": "kvtriton loop control",
    "kvt_fused_control": "kvtriton fused control",
    "kvt_fused_restore": "kvtriton fused re-store",
    "kvt_connector_fused_control": "connector, fused control",
    "kvt_connector_fused_restore": "connector, fused re-store",
}
VS_VLLM_TARGETS = {
    "fused_restore_over_vllm_control": "fused re-store over vLLM's control",
    "fused_control_over_vllm_control": "fused control over vLLM's control",
    "rescan_over_fused_restore": "vLLM's re-scan re-store over fused re-store",
    "connector_over_planner_control": "through the connector over the planner alone (control)",
    "connector_over_planner_restore": "through the connector over the planner alone "
                                      "(re-store)",
}


# The variants of each ratio target, numerator first (a results file written before
# ``bench.vllm.vs_vllm`` recorded them with each target).
VS_VLLM_COMPARED = {name: (num, den) for name, num, den, _, _ in RATIO_TARGETS}


def _vs_vllm() -> dict | None:
    """The planner beside vLLM: the full run (every size) when there is one, else the quick
    run's (``make bench``: R = 128 only)."""
    return _load("vs_vllm") or _load("vs_vllm_quick")


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


def _where_time_went(doc: dict, t: dict) -> str:
    """For a missed ratio target: the parts (medians) in which its numerator's step exceeds
    the denominator's most, from the same rows."""
    compared = t.get("compared") or VS_VLLM_COMPARED.get(t["name"])
    if not compared:
        return ""
    at = {(r["variant"], r["requests"], r["blocks_per_request"]): r for r in doc["rows"]}
    a, b = (at.get((v, t["requests"], t["blocks_per_request"])) for v in compared)
    if a is None or b is None:
        return ""
    more = sorted(((a["parts_ms"][k] - b["parts_ms"].get(k, 0.0), k) for k in a["parts_ms"]),
                  reverse=True)
    named = [f"{k} +{d:.3f} ms" for d, k in more[:3] if d > 0.0005]
    return "" if not named else (f"; the parts that grew most over `{compared[1]}`: "
                                 + ", ".join(named))


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
        body = [[VS_VLLM_VARIANTS.get(v, v)] + [f"{at[v, n]:.3f}" if (v, n) in at else "-"
                                                 for n in sizes]
                for v in dict.fromkeys(r["variant"] for r in rows)]
        out.append(f"Whole step, ms (median), {blocks:,} blocks per request:\n\n"
                   + _table(header, body))
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
            f"{_machine(doc)}), the blocks evicted per step, and so the blocks re-store redoes, "
            "grow with the blocks held: the fused re-store step over vLLM's control step, "
            + "; ".join(parts) + ".")
    if growth:
        text += " From 2,048 to 8,192 blocks, " + "; ".join(growth) + "."
    return text


def vs_vllm_section(v: dict) -> None:
    """Section 3.1's comparison with vLLM's own scheduler, measured in the same process
    (``bench.vllm.vs_vllm``): per-step time by part at the targets' sizes, and each target's
    verdict, all from ``vs_vllm.json``."""
    doc = _vs_vllm()
    v["abstract_vs_vllm"] = ""
    if doc is None:
        v["vs_vllm_text"] = ("*Pending: `python -m bench.vllm.vs_vllm` (needs vLLM) has not "
                             "been run.*")
        v["vs_vllm_table"] = ""
        return
    v["abstract_vs_vllm"] = _abstract_vs_vllm(doc)
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
        rows.append([VS_VLLM_VARIANTS.get(r["variant"], r["variant"]), str(r["requests"]),
                     f"{r['blocks_per_request']:,}", f"{r['median_ms']:.3f}",
                     f"{r['min_ms']:.3f}" if "min_ms" in r else "-",
                     f"{1 / r['x_vs_vllm_control']:.2f}" if r.get("x_vs_vllm_control")
                     else "-"]
                    + [f"{r['parts_ms'][p]:.3f}" for p in parts])
    m = doc["machine"]
    lines = [f"Beside vLLM {s['vllm']}'s own scheduler, in one process "
             f"(`python -m bench.vllm.vs_vllm`): {_machine(doc)}. Every variant runs the same "
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
    for t in doc["targets"]:
        label = VS_VLLM_TARGETS.get(t["name"], t["name"].replace("_", " "))
        low = "" if t.get("value_min") is None else \
            f"; the same ratio of the fastest steps: {t['value_min']:.3g}"
        bullets.append(f"- Target {label}, R = {t['requests']}, {t['blocks_per_request']} "
                       f"blocks: {t['value']:.3g} (target {t['target']}), "
                       f"{'met' if t['met'] else '**missed**'}; {t['measure']}{low}"
                       f"{'' if t['met'] else _where_time_went(doc, t)}.")
    if s.get("grouped"):
        lines.append("Run in groups: " + ", ".join(
            f"R = {k['requests']} at {k['blocks_per_request']:,} blocks" for k in s["grouped"])
            + f": the variants' pools together would hold more than {s['max_blocks_held']:,} "
            "blocks, past this machine's memory, so they ran in groups, each interleaved step by "
            "step on its own, one group after the other; the table's rows name their group.")
    share = _evict_share_text(_load("vs_vllm_evict_share"))
    v["vs_vllm_text"] = "\n\n".join(lines) + "\n\n" + "\n".join(bullets) + share
    v["vs_vllm_table"] = (f"Per-step time and its parts at R = "
                          f"{', '.join(map(str, sizes))}:\n\n" + _table(header, rows))
    if len({r["requests"] for r in doc["rows"]}) > 1:
        plot_vs_vllm(doc, FIGURES / "vs_vllm.png")
        v["vs_vllm_table"] += ("\n\n" + _sizes_table(doc) + "\n\n![whole-step time beside "
                               "vLLM's, every size run](figures/vs_vllm.png)")


def _gap(x) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


# ``bench.tier_study.setups --full`` writes ``setups_<tag>_full``: the whole traces, a larger
# generator.
SETUP_LABELS = {**dict(WORKLOADS), "cc_agentic": "coding-agent traces (first turns)",
                 "agent_full": "agent generator (full size)",
                 "cc_agentic_full": "coding-agent traces (whole)",
                 "mooncake_full": "Mooncake trace (every setup)",
                 "glm5_full": "GLM-5 prefill trace (every setup)"}


def _setup_docs() -> dict[str, dict]:
    """Per tag (``_full`` for a ``--full`` run), the setup benchmark's results; a file written
    before hints were split into causal and oracle ones is read as what it was
    (``_legacy_hints``)."""
    docs = {key: doc for tag, _ in WORKLOADS for key in (tag, f"{tag}_full")
            if (doc := _load(f"setups_{key}")) is not None}
    for doc in docs.values():
        _legacy_hints(doc)
    return docs


def _legacy_hints(doc: dict) -> None:
    """Before ``hint_source``, every hinted setup ran on a workload with each session's last
    turn marked ``close`` (an oracle). Such rows are renamed ``[oracle closes]`` and each
    target's best setup is chosen again without them, by the benchmark's own rule."""
    from bench.tier_study.setups import ORACLE_CLOSES, best_online, reads_hints

    for run, t in zip(doc["runs"], doc["targets"], strict=True):
        rows = run["rows"]
        if any("hint_source" in r for r in rows):
            return
        legacy = [r for r in rows if reads_hints(r["composition"])]
        if not legacy:
            continue
        for r in legacy:
            r["hint_source"] = "oracle closes"
            r["setup"] = r["composition"] + ORACLE_CLOSES
        best = best_online(rows)
        t.update(best=best["setup"] if best else None,
                 gap_closed=best["gap_closed"] if best else None)
        if not t.get("no_gap"):
            t["met"] = bool(best and best["gap_closed"] >= t["target"])
        doc["legacy_hints"] = True


def _bounds_intro(docs: dict) -> str:
    """How far the best online setup of each run stays from the cache-only Belady figure, from
    the rows: the comparison the text makes, never typed by hand."""
    gaps = []
    for tag, doc in docs.items():
        for run in doc["runs"]:
            cob = run.get("cache_only_bound")
            # Rows given oracle closes know the future too: not online.
            online = [r for r in run["rows"]
                      if not r["oracle"] and r.get("hint_source") != "oracle closes"]
            if cob and online:
                best = max(online, key=lambda r: r["token_hit_rate"])
                gaps.append((100 * (cob["hit_rate"] - best["token_hit_rate"]), tag,
                             run["cpu_ratio"], best["setup"]))
    if not gaps:
        return "No run recorded the cache-only Belady figure."
    far, near = max(gaps), min(gaps)

    def where(g: tuple) -> str:
        return f"{SETUP_LABELS[g[1]]}, CPU {g[2]}x, `{g[3]}`"

    passes = [g for g in gaps if g[0] < 0]
    head = ("The cache-only Belady figure over GPU + CPU capacity is passed by no online setup "
            "in the loop" if not passes else
            f"The cache-only Belady figure over GPU + CPU capacity is passed in {len(passes)} "
            "run(s) (the loop's chains are not the cache's independent items)")
    return (f"{head}; the best online setup of each run is between {near[0]:.1f} points "
            f"({where(near)}) and {far[0]:.1f} points ({where(far)}) below it.")


def _overload_note(doc: dict, t: dict) -> str:
    """For a best setup that reads the waiting queue: the load it was judged under (the
    lookahead shows a future only where requests wait), from the control's test part."""
    if not any(a.split(":")[0] == "waiting" for a in t["best"].split("+")):
        return ""
    run = next(r for r in doc["runs"] if r["cpu_ratio"] == t["cpu_ratio"])
    control = next(r for r in run["rows"] if r["composition"] == "eager")
    queue = control["parts"]["test"].get("queue_delay_p50_s")
    return "" if queue is None else (
        f" (an overloaded server: the control's queueing delay p50 there is {queue:.0f} s; the "
        "lookahead helps only where requests wait)")


def split_text(docs: dict) -> str:
    """Each workload's train/test split, with the parts' sizes from the control's rows."""
    lines = []
    for tag, doc in docs.items():
        if not doc.get("split"):
            lines.append(f"- {SETUP_LABELS[tag]}: written before the split; its figures are "
                         "over the whole run, and nothing is chosen from it.")
            continue
        control = next(r for r in doc["runs"][0]["rows"] if r["composition"] == "eager")
        sizes = ", ".join(f"{name} {p['requests']:,} requests ({p['prompt_tokens']:,} prompt "
                          "tokens)" for name, p in control["parts"].items())
        lines.append(f"- {SETUP_LABELS[tag]}: {doc['split_text']}: {sizes}.")
    return "\n".join(lines)


def hybrid_waste(v: dict) -> None:
    """The share of a CPU block a hybrid preset's smallest group's block uses (the layout's
    own byte counts)."""
    from kvtriton.specs import PRESETS, preset

    parts = []
    for name in sorted(PRESETS):
        layout = preset(name)
        per = layout.group_block_bytes
        if len(set(per)) > 1:
            parts.append(f"`{name}`'s smallest group block fills "
                         f"{min(per) / layout.cpu_block_bytes:.1%} of its CPU block")
    v["hybrid_waste"] = ("; ".join(parts) + "." if parts
                         else "no preset has groups of different block bytes.")


def setups_section(v: dict) -> None:
    docs = _setup_docs()
    if not docs:
        for k in ("setups_text", "ablation_table", "setups_tables", "fig_gap",
                  "targets_text", "bounds_text", "hints_text", "split_text"):
            v[k] = "*Pending: `python -m bench.tier_study.setups` has not been run.*"
        v["abstract_setups"] = "the setup benchmark has not been run"
        return
    labels = SETUP_LABELS
    first = next(iter(docs.values()))
    cond = first["runs"][0]["conditions"]
    cm = cond["cost_model"]
    v["setups_text"] = (
        f"Machine: {_machine(first)}. Model {cond['model']} on a modeled {cond['gpu']} "
        f"({cond['layout']}); token budget {cond['token_budget']:,} per step, at most "
        f"{cond['max_running']} running requests; cost model: MFU {cm['mfu']}, step overhead "
        f"{cm['step_overhead_s'] * 1e3:.1f} ms, host link {cm['h2d_bytes_per_s'] / 1e9:.0f} GB/s "
        "each way (`kvtriton/sim/cost.py`). TTFT is modeled. Workloads: "
        + "; ".join(f"{labels[t]}: `{d['workload']}`, {d['requests']:,} requests, GPU "
                    f"{d['gpu_tokens']:,} tokens" for t, d in docs.items()) + ".")
    # The ablation: gap closed per setup, workload and capacity.
    cols, keys = ["setup"], []
    for tag, doc in docs.items():
        for run in doc["runs"]:
            cols.append(f"{labels[tag]}, CPU {run['cpu_ratio']}x")
            keys.append((tag, run["cpu_ratio"]))
    by = {(tag, run["cpu_ratio"]): {r["setup"]: r for r in run["rows"]}
          for tag, doc in docs.items() for run in doc["runs"]}
    names = []
    for doc in docs.values():
        for run in doc["runs"]:
            names += [r["setup"] for r in run["rows"] if r["setup"] not in names]
    small = {(tag, t["cpu_ratio"]) for tag, doc in docs.items() for t in doc["targets"]
             if t.get("no_gap")}
    rows = []
    for n in names:
        cells = [f"`{n}`"]
        for k in keys:
            r = by[k].get(n)
            cells.append("-" if r is None else _pct(r["token_hit_rate"]) if k in small else
                         f"{_pct(r['token_hit_rate'])} ({_gap(r.get('gap_closed'))})")
        rows.append(cells)
    threshold = next((t["material_gap_points"] for doc in docs.values()
                      for t in doc["targets"] if "material_gap_points" in t), None)
    v["ablation_table"] = (
        "Token hit rate and, in parentheses, the share of the gap between the control "
        "(`eager`) and the in-loop Belady bound that each setup closes, at the same capacity. "
        "The rows `eager+nextuse`, `lazy+nextuse` and `eager+inf` are the bounds; the bound is "
        "the better next-use row (100%)."
        + ("" if threshold is None else
           f" Where the gap is under {threshold:g} points of hit rate a share of it would "
           "magnify noise, so those columns give the hit rate alone and no target is judged "
           "there.") + "\n\n" + _table(cols, rows))
    # Per capacity detail of the first workload's runs.
    tables = []
    detail = ["setup", "hit rate", "gap closed", "CPU hit tokens", "stored", "re-stored",
              "re-store thrash", "TTFT p50 / p90 / mean (s)"]
    for tag, doc in docs.items():
        for run in doc["runs"]:
            trs = [[f"`{r['setup']}`" + (" (bound)" if r["oracle"] else ""),
                    _pct(r["token_hit_rate"]), _gap(r.get("gap_closed")),
                    f"{r['cpu_hit_tokens']:,}", f"{r['stored_blocks']:,}",
                    f"{r['restored_blocks']:,}", f"{r['restore_thrash']:,}",
                    f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}"
                    + (f" / {r['ttft_mean_s']:.2f}" if "ttft_mean_s" in r else "")]
                   for r in run["rows"]]
            cob = run.get("cache_only_bound")
            tables.append(
                f"**{labels[tag]}, CPU {run['cpu_ratio']}x the GPU** ({run['cpu_tokens']:,} "
                "tokens)" + (f"; cache-only Belady over GPU + CPU: {_pct(cob['hit_rate'])}"
                             if cob else "") + ":\n\n" + _table(detail, trs))
    v["setups_tables"] = "\n\n".join(tables)
    figs = []
    for tag, doc in docs.items():
        runs = [{"label": f"CPU {run['cpu_ratio']}x", "rows": run["rows"]}
                for run in doc["runs"]]
        plot_gain_over_control(runs, FIGURES / f"gain_{tag}.png",
                               f"{labels[tag]}: `{doc['workload']}`")
        figs.append(f"![{labels[tag]}: hit rate over the control per setup]"
                    f"(figures/gain_{tag}.png)")
    v["fig_gap"] = "\n\n".join(figs)
    # Targets.
    def target_line(tag: str, t: dict) -> str:
        tol = t.get("ttft_tolerance_s")
        strict = "" if tol is None else (
            "; with no tolerance: " + (f"`{t['best_strict']}`, {_gap(t['gap_closed_strict'])}"
                                       if t.get("best_strict") else "none"))
        split = "gap_closed_train" in t
        share = t.get("judged_share", t["gap_closed"])
        chosen = (f"`{t['best']}`, chosen on the train part ({_gap(t['gap_closed_train'])} of "
                  f"its gap), closes {_gap(share)} of the test part's gap " if split else
                  f"`{t['best']}`, {_gap(share)} of the gap ")
        return (f"- {labels[tag]}, CPU {t['cpu_ratio']}x: best online setup with TTFT p50 and "
                "p90 no worse than the control's"
                + ("" if tol is None else f" (within {tol:.2f} s)") + ": "
                + (chosen if t["best"] and (t["gap_closed_train"] if split else share) > 0
                   else "none closes any of the gap ")
                + f"(control {_pct(t['control_hit_rate'])}, bound `{t['bound']}` "
                f"{_pct(t['bound_hit_rate'])}" + (" on the test part" if split else "")
                + f"); target {t['target']:.0%}: "
                + (f"not judged: the gap is {t['gap_points']:.1f} points"
                   if t.get("no_gap") and "gap_points" in t else
                   "no gap to close at this size: the control reaches the bound"
                   if t.get("no_gap") else "met" if t["met"] else "**missed**") + strict + ".")

    tol = next((t["ttft_tolerance_s"] for doc in docs.values() for t in doc["targets"]
                if t.get("ttft_tolerance_s") is not None), None)
    v["targets_text"] = ("" if tol is None else (
        f"No worse means no more than {tol:.2f} s above the control's p50 and p90: one "
        "scheduler step at the full token budget (step overhead plus a full-budget prefill, "
        "`bench.tier_study.setups.ttft_tolerance_s`). A prompt's prefill moves in whole steps, "
        "so a "
        "smaller change is below the cost model's resolution. Mean TTFT is in the detail "
        "tables. Rows given oracle closes are never the best setup.\n\n")) + "\n".join(
        target_line(tag, t) for tag, doc in docs.items() for t in doc["targets"])
    v["split_text"] = split_text(docs)
    # Bounds: the in-loop bounds against the cache-only one.
    blines = []
    for tag, doc in docs.items():
        for run in doc["runs"]:
            rb = {r["composition"]: r for r in run["rows"]}
            cob = run.get("cache_only_bound")
            parts = [f"{labels[tag]}, CPU {run['cpu_ratio']}x: control "
                     f"{_pct(rb['eager']['token_hit_rate'])}"]
            for comp, what in (("eager+nextuse", "next-use eviction, eager"),
                               ("lazy+nextuse", "next-use eviction, lazy"),
                               ("eager+inf", "unbounded tier")):
                if comp in rb:
                    parts.append(f"{what} {_pct(rb[comp]['token_hit_rate'])}")
            if cob:
                parts.append(f"cache-only Belady {_pct(cob['hit_rate'])}")
            blines.append("- " + ", ".join(parts) + ".")
    v["bounds_text"] = "\n".join(blines)
    v["bounds_intro"] = _bounds_intro(docs)
    # Hints and the other online signals, as gains over what they change.
    hl = []
    for tag, doc in docs.items():
        for run in doc["runs"]:
            rb = {r["setup"]: r for r in run["rows"]}
            pairs = [("lazy+hints", "lazy"), ("lazy+hinted", "lazy"),
                     ("lazy+hinted+hints", "lazy+hints"), ("eager+hints", "eager"),
                     ("eager+second", "eager"), ("eager+waiting", "eager"),
                     ("eager+refresh", "eager"), ("eager+arc", "eager"),
                     ("eager+s3fifo", "eager"), ("eager+refresh+arc", "eager+arc")]
            pairs += [(r["setup"], r["composition"]) for r in run["rows"]
                      if r.get("hint_source") == "oracle closes"]
            cells = [f"`{a}` {100 * (rb[a]['token_hit_rate'] - rb[b]['token_hit_rate']):+.1f} "
                     f"over `{b}`" for a, b in pairs if a in rb and b in rb]
            if cells:
                hl.append(f"- {labels[tag]}, CPU {run['cpu_ratio']}x (points of hit rate): "
                          + "; ".join(cells) + ".")
    v["hints_text"] = (
        "The hints a server has come from the model's stop reasons: a turn that ended in a tool "
        "call is hinted `continue`. No trace records a client closing its session; a row "
        "`[oracle closes]` gives the same setup each session's last turn as a close, which "
        "uses the future (no later turn exists), so it is an oracle and never the best "
        "setup." + "".join(
            f" The file of the {labels[tag]} was written before this split: its hinted rows "
            "are the oracle-close runs only (`python -m bench --only "
            + ("cc_agentic_whole" if tag.endswith("_full") else "setups")
            + "` adds the causal ones)." for tag, doc in docs.items() if doc.get("legacy_hints"))
        + "\n\n" + "\n".join(hl))
    # Abstract: the best online setup per workload at CPU = GPU.
    ab = []
    for tag, doc in docs.items():
        t = doc["targets"][0]
        if t["best"] and "gap_closed_test" in t:
            ab.append(f"`{t['best']}`, chosen on a train part, closes "
                      f"{_gap(t['gap_closed_test'])} of the gap to the in-loop bound on the "
                      f"{labels[tag]}'s test part at CPU {t['cpu_ratio']}x"
                      + _overload_note(doc, t))
        elif t["best"]:
            ab.append(f"`{t['best']}` closes {_gap(t['gap_closed'])} of the gap to the in-loop "
                      f"bound on the {labels[tag]} at CPU {t['cpu_ratio']}x")
    v["abstract_setups"] = "; ".join(ab) if ab else "no online setup beat the control"


def _map_cells(docs: dict) -> list[dict]:
    """One decision-map cell per (workload, CPU capacity) of a results file with a split and
    traits: the traits, the setup chosen on the train part and its figures on the test part."""
    cells = []
    for tag, doc in docs.items():
        traits = doc.get("traits")
        if not traits or not doc.get("split"):
            continue
        for run, t in zip(doc["runs"], doc["targets"], strict=True):
            ratio = run["cpu_ratio"]
            control = next(r for r in run["rows"] if r["composition"] == "eager")
            best = next((r for r in run["rows"] if r["setup"] == t["best"]), None)
            test = None if best is None else 100 * (
                best["parts"]["test"]["token_hit_rate"]
                - control["parts"]["test"]["token_hit_rate"])
            cells.append({
                "tag": tag, "label": f"{SHORT_LABELS.get(tag, tag)} {ratio}x", "ratio": ratio,
                "within_gpu": traits["reuse"]["within"]["gpu"],
                "within_tier": traits["reuse"]["within"][f"gpu+cpu {ratio}x"],
                "turns": traits["turns_per_session"], "continue": traits["continue_share"],
                "hinted": traits["continue_share"] > 0,
                "queue_p50_s": control["parts"]["test"].get(
                    "queue_delay_p50_s", control["ttft_p50_s"]),
                "queue_measured": "queue_delay_p50_s" in control["parts"]["test"],
                "gap_points": t["gap_points"], "no_gap": t["no_gap"], "winner": t["best"],
                "train_share": t.get("gap_closed_train"), "test_share": t.get("gap_closed_test"),
                "test_points": test})
    return cells


SHORT_LABELS = {"agent": "agent", "cc_agentic": "coding agent", "mooncake": "Mooncake",
                "glm5": "GLM-5"}


def shares_section(v: dict) -> None:
    """The protected shares tuned on the train part, judged on the test part
    (``bench/tier_study/tune_shares.py``; optional: a study run by name)."""
    doc = _load("tune_shares")
    if doc is None:
        v["shares_text"] = ("The protected share of `hints` and `waiting` is 0.5 throughout, fixed "
                            "before any result; tuning it on a train part is a study by name "
                            "(`python -m bench --only tune_shares`), not run for these results.")
        return
    lines = []
    for tag, w in doc["workloads"].items():
        for r in w["setups"]:
            grid = ", ".join(f"{g['share']:g}: {g['train_points']:+.2f}" for g in r["grid"])
            lines.append(
                f"- {SETUP_LABELS.get(tag, tag)}, `{r['setup']}`: train gains over the control "
                f"by share ({grid} points); chosen {r['chosen_share']:g}, which gains "
                f"{r['chosen_test_points']:+.2f} points on the test part against "
                f"{r['fixed_test_points']:+.2f} at the fixed {r['fixed_share']:g} "
                f"({r['tuning_gain_test_points']:+.2f} from tuning).")
    v["shares_text"] = (
        "The protected share of `hints` and `waiting` is 0.5 in every other figure, fixed before "
        "any result. Tuned on the train part (`bench/tier_study/tune_shares.py`, shares "
        + ", ".join(f"{x:g}" for x in doc["shares"]) + f"; rule: {doc['rule']}; "
        f"{_machine(doc)}):\n\n" + "\n".join(lines))


def conversational_gap_section(v: dict) -> None:
    """The conversational gap (``bench/tier_study/conversational_gap.py``; a study by name): what
    the gap on chat traffic consists of, each candidate chosen on Mooncake's train half and judged
    on its test half and the other workloads' test parts."""
    doc = _load("conversational_gap")
    if doc is None:
        v["gap_study_text"] = ("*The conversational-gap study has not been run "
                               "(`python -m bench --only conversational_gap`).*")
        return
    a = doc["anatomy"]
    rows = doc["mooncake_rows"]
    t = doc["target"]
    control, bound = rows["eager"]["parts"], rows["eager+nextuse"]["parts"]
    gaps = ", ".join(f"{k}: {g['reuses']:,} reuses, median {g['median_gap_requests']:.0f} "
                     "requests later" for k, g in a["reuse_gap_by_prior_uses"].items())
    after = ", ".join(f"{n}: {p:.2f}" for n, p in a["p_reuse_after_n_uses"].items())
    cm = a["cache_model"]["hit_share"]
    look = ", ".join(f"Q = {k.split('_')[1]}: {_pct(x[1])}" for k, x in cm.items()
                     if k.startswith("lookahead_"))
    lp, sessions = a["learned_predictor"], a["inferred_sessions"]
    anatomy = (
        f"**What the gap is** (the Mooncake trace alone): {a['block_uses']:,} block uses over "
        f"{a['distinct_blocks']:,} distinct blocks; a tier that never evicts could serve "
        f"{_pct(a['reuse_share_unbounded'])} of them. The chance that a block is used again "
        f"after n uses is {after}. Reuses by the uses before them: {gaps}; most are far beyond "
        "what a CPU tier the size of the GPU holds (Section {{sec_decision}} gives the reuse "
        "distances in tokens). One cache of "
        f"{a['cache_model']['capacity_blocks']:,} blocks on the test half: LRU "
        f"{_pct(cm['lru'][1])}, LFU {_pct(cm['lfu'][1])}, next use {_pct(cm['nextuse'][1])}; "
        f"next use only within the next Q requests (what a waiting queue of Q shows): {look}. "
        f"Sessions inferred from prefix extension cover {sessions['requests_extending']} "
        f"of {a['requests']:,} requests and {_pct(sessions['reusable_blocks_covered'])} "
        f"of the reusable blocks. A logistic next-use predictor trained on the train half "
        f"(features: {', '.join(lp['features'])}) reaches test AUC "
        f"{lp['all_features']['test_auc']:.3f}, the use count alone "
        f"{lp['count_only']['test_auc']:.3f}. The halves differ: the control's "
        f"modeled TTFT p50 is {control['train']['ttft_p50_s']:.1f} s on the train half and "
        f"{control['test']['ttft_p50_s']:.0f} s on the test half, where the server is "
        "overloaded.")
    trs = []
    for c in doc["candidates"]:
        row = rows.get(c["chosen"], {}).get("parts", {})
        ttft = row.get("test", {}).get("ttft_p50_s")
        trs.append([f"`{c['chosen']}`", c["hypothesis"].split(". ")[0].rstrip(".") + ".",
                    ", ".join(f"`{k}` {_gap(x)}" for k, x in c["train_gap_share_by_value"].items()),
                    f"{_gap(c['mooncake_train_gap_share'])} / {_gap(c['mooncake_test_gap_share'])}",
                    _pct(c["mooncake_test_hit_rate"]),
                    "-" if ttft is None else f"{ttft:.0f}",
                    f"{c['cc_agentic_test_points_vs_control']:+.2f}",
                    f"{c['agent_test_points_vs_control']:+.2f}",
                    "met" if c["target_met"] else "**missed**"])
    table = _table(["chosen on train", "hypothesis", "train gap share per value",
                    "Mooncake gap share train / test", "test hit rate", "test TTFT p50 (s)",
                    "coding agents, test (points)", "agent, test (points)", "target"], trs)
    figures = {"anatomy.inferred_sessions.requests_extending":
               f"{sessions['requests_extending']} of {a['requests']:,}",
               "reusable_blocks_covered": _pct(sessions["reusable_blocks_covered"]),
               " (anatomy.learned_predictor)": "", "(see idea 2)": "(idea 2)"}

    def why(text: str) -> str:
        for k, x in figures.items():
            text = text.replace(k, x)
        return text.rstrip(".")

    nb = "\n".join(f"- Idea {k}: not built. {why(x['why_not'])}."
                   for k, x in doc["not_built"].items())
    met = doc["target_met_by"]
    v["gap_study_text"] = (
        f"**The conversational gap** (`bench/tier_study/conversational_gap.py`; "
        f"{_machine(doc)}). On the "
        "Mooncake trace at CPU = GPU the in-loop bound is "
        f"{bound['test']['token_hit_rate'] / control['test']['token_hit_rate']:.1f} times the "
        "control on the test half. Target: "
        f"at least {t['mooncake_test_gap_share']:.0%} of the gap on the test half, with no loss "
        f"beyond {t['other_test_points_at_least']:+.1f} points on the coding-agent and agent "
        f"test parts. Control {_pct(control['train']['token_hit_rate'])} / "
        f"{_pct(control['test']['token_hit_rate'])} (train / test), bound "
        f"{_pct(bound['train']['token_hit_rate'])} / {_pct(bound['test']['token_hit_rate'])}.\n\n"
        + anatomy + "\n\n" + table + "\n\n" + nb + "\n\n"
        + ("Met by: " + ", ".join(f"`{m}`" for m in met) + ". Both rely on the waiting-queue "
           "lookahead, and the lookahead has a future to show only because the test half is "
           "overloaded (its TTFT above): the claim holds for an overloaded server, not for one "
           "that keeps up. Frequency alone (`lfu`) closes part of the gap at no TTFT cost but "
           "loses on the agent generator's test part." if met else
           "No candidate meets the target.")
        + " Two choices were not blind: the sketch's row width was widened after a first full "
        "run's test figures were seen (with the first width, `eager+lfu:4+waiting` was chosen and "
        "met the target too), and the lookahead share tied on the train half (it has almost no "
        "queue), so the grid's first value was taken.")


def lfu_recency_section(v: dict) -> None:
    """Where frequency-first eviction loses (``bench/tier_study/lfu_recency.py``; a study by name):
    the sequential-chat shape on held-out seeds, and the sketch's two changes on the tier study's
    workloads by part."""
    doc = _load("lfu_recency")
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
    table = _table(["setup", "CPU-hit tokens over `eager`'s", "running requests' CPU blocks "
                    "evicted"], [[ "`eager`", "1.00", f"{ev['eager']:,}"], *rows])
    parts = []
    for tag, by in doc["study_workloads"].items():
        cells = ", ".join(
            f"`{p}` {_pct(r['parts']['train']['token_hit_rate'])} / "
            f"{_pct(r['parts']['test']['token_hit_rate'])}" for p, r in by.items())
        parts.append(f"{dict(WORKLOADS).get(tag, tag)}: {cells}")
    verdict = ("frequency loses here" if sm["lfu_loses"] else
               "frequency does not lose on the held-out seeds")
    v["lfu_recency_text"] = (
        f"**Where frequency loses** (`bench/tier_study/lfu_recency.py`; {_machine(doc)}). A "
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
    for c in doc["verdicts"]:
        pts = c["points_vs_lfu64"]
        worst = {part: min(pts[part].items(), key=lambda kv: kv[1]) for part in pts if pts[part]}
        where = ", ".join(f"{part} {pt:+.2f} points ({dict(WORKLOADS).get(tag, tag)})"
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


def decision_map_section(v: dict) -> None:
    """Which setup wins where: the study's cells against the workload traits, each winner
    chosen on the train part with its test-part figures, and the rules they support."""
    cells = _map_cells(_setup_docs())
    if not cells:
        v["decision_map_text"] = ("*Pending: no setup results with a train/test split "
                                  "(`python -m bench --only setups`).*")
        v["fig_decision_map"] = ""
        return
    from kvtriton.plots import plot_decision_map

    plot_decision_map(cells, FIGURES / "decision_map.png")
    queue = ("queueing delay p50 (s)" if all(c["queue_measured"] for c in cells)
             else "TTFT p50 (s)") + ", test part"
    rows = [[c["label"], _pct(c["within_gpu"]), _pct(c["within_tier"]),
             "-" if c["turns"] is None else f"{c['turns']:.1f}", _pct(c["continue"]),
             f"{c['queue_p50_s']:.2f}", f"{c['gap_points']:.1f}",
             f"`{c['winner']}`" if c["winner"] else "none gains",
             _gap(c["train_share"]), "-" if c["no_gap"] else _gap(c["test_share"]),
             "-" if c["test_points"] is None else f"{c['test_points']:+.2f}"]
            for c in cells]
    table = _table(["cell (workload, CPU/GPU)", "reuses within GPU", "within GPU + CPU",
                    "turns per session", "requests hinted continue", f"control's {queue}",
                    "test gap (points)", "chosen on train", "train share", "test share",
                    "test gain (points)"], rows)
    claims = []
    by_winner: dict[str, list[dict]] = {}
    for c in cells:
        by_winner.setdefault(c["winner"] or "", []).append(c)
    for w, cs in sorted(by_winner.items(), key=lambda kv: -len(kv[1])):
        where = ", ".join(c["label"] for c in cs)
        hinted = sorted({c["hinted"] for c in cs})
        within = [c["within_tier"] for c in cs]
        tier = (_pct(within[0]) if len(set(within)) == 1 else
                f"{_pct(min(within))}-{_pct(max(within))}")
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


def restore_map_section(v: dict) -> None:
    labels = dict(WORKLOADS)
    docs = {tag: doc for tag in MAP_TAGS if (doc := _load(f"restore_map_{tag}"))}
    if not docs:
        v["restore_map_text"] = "*Pending: `python -m bench.tier_study.setups --only map`.*"
        v["fig_restore_map"] = ""
        v["abstract_restore"] = "the re-store map has not been run"
        return
    lines, figs, summary = [], [], []
    for tag, doc in docs.items():
        ratios, running = doc["ratios"], doc["max_running"]
        lines.append(f"**{labels[tag]}**: `{doc['workload']}` ({doc['requests']:,} requests), "
                     f"GPU {doc['gpu_tokens']:,} tokens; {_machine(doc)}. Each cell: the token "
                     "hit rate of the re-store form minus that of `eager` at the same capacity "
                     "and concurrency.")
        for form, grid in doc["gain"].items():
            cells = [(grid[i][j], running[i], ratios[j]) for i in range(len(running))
                     for j in range(len(ratios))]
            best, worst = max(cells), min(cells)
            pays = [c for c in cells if c[0] > 0.001]
            hurts = [c for c in cells if c[0] < -0.001]
            thrash = doc["restore_thrash"][form]
            most = max((thrash[i][j], running[i], ratios[j]) for i in range(len(running))
                       for j in range(len(ratios)))
            lines.append(
                f"- `{form}`: gains more than 0.1 point in {len(pays)} of {len(cells)} cells and "
                f"loses more than 0.1 point in {len(hurts)}; best {100 * best[0]:+.1f} points "
                f"(max_running {best[1]}, CPU {best[2]:g}x), worst {100 * worst[0]:+.1f} "
                f"points (max_running {worst[1]}, CPU {worst[2]:g}x); most re-store thrash "
                f"{most[0]:,} (max_running {most[1]}, CPU {most[2]:g}x).")
            summary.append((tag, form, len(pays), len(hurts), len(cells), best[0], worst[0]))
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
        doc = _load(f"replay_{tag}")
        if doc is None:
            continue
        s = doc["sweep"]
        setups = list(s["hit_rate"])
        header = ["capacity (tokens)", *setups]
        rows = [[f"{c:,}"] + [_pct(s["hit_rate"][p][i]) for p in setups]
                for i, c in enumerate(s["capacities_tokens"])]
        rows.append(["infinite"] + [_pct(s["max_hit_rate"])] * len(setups))
        tables.append(f"**{label}** ({s['requests']:,} requests, {s['hash_block_size']}-token "
                      f"blocks; {_machine(doc)}):\n\n" + _table(header, rows))
        plot_sweep(s, FIGURES / f"replay_{tag}.png")
        parts.append(f"![{label}: hit rate vs capacity](figures/replay_{tag}.png)")
        if tag == "mooncake":
            caps = s["capacities_tokens"]
            if 3_000_000 in caps:
                i = caps.index(3_000_000)
                lru = s["hit_rate"]["lru"][i]
                v["mooncake_claim"] = (
                    f"On the shipped Mooncake trace the infinite-cache maximum is "
                    f"{_pct(s['max_hit_rate'])} (the paper reports a 66% cache ratio for its "
                    f"synthetic trace), and a 3M-token LRU cache reaches {_pct(lru)}, "
                    f"{lru / s['max_hit_rate']:.2f} of the maximum, where the paper reports "
                    "under half; Belady's MIN reaches "
                    f"{_pct(s['hit_rate']['belady'][i])} at the same size.")
    v["replay_tables"] = "\n\n".join(tables) or "*Pending: no replay results.*"
    v["fig_replay"] = "\n\n".join(parts)
    v.setdefault("mooncake_claim", "")


def kernel_section(v: dict) -> None:
    chk = _load("kernel_check")
    if chk is None:
        v["kernel_check_table"] = "*Pending: `python -m bench.kernels.check` has not been run.*"
    else:
        rows = [[r["preset"], r["layout"], str(r["pairs"]),
                 "yes" if r["store_bit_exact"] else "**no**",
                 "yes" if r["load_bit_exact"] else "**no**"] for r in chk["rows"]]
        v["kernel_check_table"] = (f"Mode: {chk['mode']}; {_machine(chk)}.\n\n"
                                   + _table(["preset", "layout", "pairs", "store bit-exact",
                                             "load bit-exact"], rows))
    bw = _load("bench_kernels")
    if bw is None or bw.get("mode") == "cpu-dry-run":
        v["kernel_bw_text"] = ("**Pending.** No GPU was available to any run behind this "
                               "paper, so the kernel's bandwidth, its ratio to the link's "
                               "ceiling and the comparison with per-block and batched copies "
                               "are not reported. `python -m bench.kernels.bandwidth` measures "
                               "them "
                               "on a CUDA machine, and this section fills in from its JSON.")
        v["fig_kernels"] = ""
        return
    plot_kernels(bw, FIGURES / "kernels.png")
    targets = [f"- {t['target']}: {t['value']:.3g}, {'met' if t['met'] else '**missed**'}"
               if t.get("value") is not None else f"- {t['target']}: not measured"
               for t in bw["targets"].values()]
    v["kernel_bw_text"] = f"Machine: {_machine(bw)}.\n\n" + "\n".join(targets)
    v["fig_kernels"] = "![kernel bandwidth](figures/kernels.png)"


def default_section(v: dict) -> None:
    """The connector's default and the rule that picks it; the build stops if the results no
    longer pick ``kvtriton.setups.DEFAULT_SETUP``."""
    from bench.tier_study.default_setup import CONTROL, choose_on_train
    from kvtriton.setups import DEFAULT_SETUP

    try:
        got = choose_on_train(RESULTS)
    except ValueError as e:
        v["default_text"] = f"*Pending: {e}.*"
        return
    if got["setup"] != DEFAULT_SETUP:
        raise SystemExit(f"paper/build.py: the results choose {got['setup']!r} as the "
                         f"connector's default, kvtriton.setups.DEFAULT_SETUP is "
                         f"{DEFAULT_SETUP!r}: the evidence moved (python -m "
                         f"bench.tier_study.default_setup)")
    def pts(x: float | None) -> str:
        return "-" if x is None else f"{x:+.2f}"

    rows = [[f"`{r['setup']}`" + (" **(default)**" if r["setup"] == DEFAULT_SETUP else ""),
             str(r["cells"]), ", ".join(r["workloads"]), pts(r["worst_points"]),
             pts(r["mean_points"]), "yes" if r["eligible"] else "no", pts(t["worst_points"]),
             pts(t["mean_points"])]
            for r, t in zip(got["table"], got["test"], strict=True)]
    best = got["table"][0]
    verdict = (
        "No candidate gains on one workload without losing on another, so the default is the "
        "control itself, vLLM's own connector's behaviour; a user who knows the workload turns "
        "on the setup the study found for it (hints on coding agents, Section {{sec_what}})."
        if DEFAULT_SETUP == CONTROL else
        f"`{best['setup']}` loses nothing in any cell it ran in (worst "
        f"{best['worst_points']:+.2f} points, mean {best['mean_points']:+.2f}).")
    v["default_text"] = (
        f"A connector started without a `setup` runs `{DEFAULT_SETUP}`. The candidates are the "
        "setups it runs with nothing from the client or the scheduler (no hints, no waiting-"
        f"queue lookahead, no oracle); the rule: {got['rule']}, over the {got['cells']} cells "
        "(workload x CPU capacity) of the setup study (`bench/tier_study/default_setup.py`). "
        + verdict
        + " A first form of the rule, asking for two workloads, chose `eager+arc` from four "
        "cells; measured on the other workloads it lost points, and the rule asks for every "
        "workload since. The rule reads the train part of each run (Section {{sec_which}}); "
        "the last two columns are the same setups on the test part."
        + ("" if not got["skipped"] else
           " Left out of the choice, written before the split: "
           + ", ".join(f"`{n}`" for n in got["skipped"]) + ".") + "\n\n"
        + _table(["setup", "train cells", "workloads", "train worst (points)",
                  "train mean (points)", "eligible", "test worst (points)",
                  "test mean (points)"], rows))


def _range(row: dict, key: str, fmt) -> str:
    """`` (lo-hi)`` over a row's repeated engine runs, or nothing for one run."""
    r = row.get(f"{key}_range")
    return "" if not r else f" ({fmt(r[0])}-{fmt(r[1])})"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def engine_section(v: dict) -> None:
    """The real-engine benchmark: measured rows, the simulator's prediction, the targets."""
    doc = _load("vllm_engine")
    if doc is None:
        v["engine_text"] = f"*Pending: `vllm_engine.json` is {_not_run('vllm_engine.json')}.*"
        return
    c = doc["conditions"]
    model = c["model"]
    model_txt = (f"a random-weight Llama made at run time ({model['random_llama']['num_layers']} "
                 f"layers of width {model['random_llama']['hidden_size']}, fp32)"
                 if isinstance(model, dict) else f"`{model}`")
    parts = [
        f"vLLM {c['vllm']} on its {c['backend'].upper()} backend, {_machine(doc)}, serving "
        f"{model_txt}; {c['block_tokens']}-token blocks, a KV cache of {c['gpu_blocks']} "
        f"blocks, a CPU tier {c['cpu_ratio']:g} times that, at most "
        f"{c['max_num_batched_tokens']:,} tokens and {c['max_num_seqs']} requests per step. "
        "Each workload is replayed by time stamp (arrivals and think times x"
        f"{c['time_scale']:g}), once per system, each turn's trace hint in "
        "`kv_transfer_params`; outputs are cut to "
        f"{c['max_output_tokens']} tokens (`python -m bench.vllm.engine`, "
        "`bench/vllm/engine.py` says how the traces are shrunk). The simulator then replays the "
        "same workload at the same sizes on a clock fitted to this engine's own steps "
        "(`MeasuredCost`, least squares over every step of every system). The connector's "
        f"default setup, `{c.get('default_setup', 'default')}`, is the row of that name"
        + (" (`default`)" if any(m["system"] == "default" for r in doc["runs"].values()
                                 for m in r["measured"]) else "") + "."
        + (f" Each system ran {c['repeats']} times: the tables give the mean, and the range "
           "over runs in brackets." if c.get("repeats", 1) > 1 else
           " Each system ran once; repeated runs (`--repeats`) give the engine's own spread.")]
    targets = doc["targets"]
    for w, run in doc["runs"].items():
        fit = run["cost_fit"]
        parts.append(
            f"**{w}** ({run['requests']} requests, {run['prompt_tokens']:,} prompt tokens). "
            f"Step-time fit: {fit['prefill_ms_per_1k_tokens']:.0f} ms per 1,000 prefill tokens, "
            f"{fit['decode_step_ms']:.1f} ms for a decode step of one 256-token sequence, "
            f"R\u00b2 {fit['r2']:.2f} over {fit['samples']:,} steps.")
        parts.append(_table(
            ["system", "token hit rate", "CPU hit tokens", "TTFT p50 (s)", "TTFT p90 (s)",
             "output tok/s", "stored blocks", "loaded blocks"],
            [[f"`{m['system']}`", _pct(m["token_hit_rate"]) + _range(m, "token_hit_rate", _pct),
              f"{m['cpu_hit_tokens']:,.0f}",
              f"{m['ttft_p50_s']:.3f}" + _range(m, "ttft_p50_s", lambda x: f"{x:.3f}"),
              f"{m['ttft_p90_s']:.3f}", f"{m['output_tokens_per_s']:.1f}",
              f"{m['stored_blocks']:,.0f}", f"{m['loaded_blocks']:,.0f}"]
             for m in run["measured"]]))
        parts.append(_table(
            ["system", "hit rate: engine", "simulator", "off (points)", "TTFT p50: engine (s)",
             "simulator (s)", "off"],
            [[f"`{r['system']}`", _pct(r["hit_rate_engine"]), _pct(r["hit_rate_sim"]),
              f"{r['hit_points_off']:+.1f}", f"{r['ttft_p50_engine_s']:.3f}",
              f"{r['ttft_p50_sim_s']:.3f}",
              "-" if r["ttft_p50_rel_off"] is None else f"{r['ttft_p50_rel_off']:+.0%}"]
             for r in run["rows"]]))
        t = run["targets"]
        worst = max(abs(r["hit_points_off"]) for r in run["rows"])
        rel = [abs(r["ttft_p50_rel_off"]) for r in run["rows"]
               if r["ttft_p50_rel_off"] is not None]
        parts.append(
            f"Targets: hit rate within {targets['hit_rate_points']:g} point for every system "
            f"{_verdict(t['hit_rate_within_1_point'])} (worst {worst:.1f}); TTFT p50 in the same "
            f"order {_verdict(t['ttft_p50_same_order'])} over the "
            f"{run.get('ttft_pairs_compared', 0)} pairs of systems whose measured p50s differ "
            f"by more than {targets['ttft_p50_rel']:.0%}"
            + "".join(f", misordered `{a}`/`{b}`" for a, b in run.get("ttft_pairs_misordered", []))
            + " (engine, fastest first: "
            + ", ".join(f"`{s}`" for s in run["ttft_order_engine"]) + "; simulator: "
            + ", ".join(f"`{s}`" for s in run["ttft_order_sim"]) + "); modeled TTFT p50 within "
            f"{targets['ttft_p50_rel']:.0%} {_verdict(t['ttft_p50_within_20pct'])} (worst "
            f"{max(rel, default=0):.0%}).")
    v["engine_text"] = "\n\n".join(parts)


def _not_run(file: str) -> str:
    """Why input ``file`` is absent, from the studies that write it."""
    options = writers(file)
    if not options:
        return "no study writes it"
    # The quick run's study if one writes it, else a longer run by name, else a full-size run.
    study, quick = max(options, key=lambda o: (o[1] and "quick" in o[0].run_in,
                                               not o[0].run_in, o[1]))
    run = f"`python -m bench{'' if quick else ' --full'} --only {study.name}`"
    if study.needs == "cuda":
        return f"not run: needs a CUDA device ({run} on a GPU box)"
    if study.needs == "vllm":
        return f"not run: needs vLLM ({run})"
    if quick and "quick" in study.run_in:
        return f"missing ({run} writes it)"
    if not study.run_in:
        return f"not run: a longer run ({run})"
    return f"not run: full size only ({run})"


def _provenance(name: str, doc: dict, manifest: dict) -> tuple[str, str, bool | None, str]:
    """(writer, commit, clean tracked code, UTC date) of input ``name``: its manifest entry
    where that agrees with the file's own machine block on the commit, else the machine block
    (files written before the manifest existed)."""
    machine = doc.get("machine") or {}
    sha = machine.get("git_sha", "unknown")
    commit, _, dirty = sha.partition("+")
    entry = manifest.get(f"{name}.json")
    if entry is not None and entry["commit"] == commit:
        return entry["writer"]["command"], entry["commit"], entry["clean"], entry["date_utc"]
    return (doc.get("command", "not recorded"), commit,
            None if commit == "unknown" else not dirty, machine.get("date_utc", "unknown"))


def inputs_section(v: dict) -> None:
    """The paper's inputs: where each came from, or why it is absent."""
    path = RESULTS / "MANIFEST.json"
    manifest = json.loads(path.read_text())["files"] if path.exists() else {}
    rows, commits, dirty = [], {}, 0
    for name in INPUTS:
        doc = _load(name)
        file = f"{name}.json"
        if doc is None:
            rows.append([f"`{file}`", _not_run(file), "-", "-", "-"])
            continue
        writer, commit, clean, date = _provenance(name, doc, manifest)
        commits[commit] = commits.get(commit, 0) + 1
        dirty += clean is False
        rows.append([f"`{file}`", f"`{writer}`" if writer != "not recorded" else writer,
                     f"`{commit}`", {True: "yes", False: "**no**", None: "unknown"}[clean],
                     date])
    n = sum(commits.values())
    summary = "No results file behind this paper has been written." if not n else (
        f"The {n} results files behind this paper come from {len(commits)} "
        f"commit{'s' if len(commits) != 1 else ''} ("
        + ", ".join(f"`{c}`: {k}" for c, k in commits.items()) + "); "
        + (f"{dirty} of them {'was' if dirty == 1 else 'were'} written with uncommitted "
           "changes to tracked code." if dirty else "every one with the tracked code clean."))
    v["inputs_text"] = (summary + " Per file: the command that wrote it (from "
                        "`bench/results/MANIFEST.json`; *not recorded* for a file older than "
                        "the manifest), its commit, whether the tracked code was clean, and "
                        "when.\n\n" + _table(["results file", "written by", "commit",
                                              "tracked code clean", "date (UTC)"], rows))


def section_numbers(template: str) -> dict[str, str]:
    """``sec_<first word of the title>`` for every numbered heading (``### 3.7 Kernels`` gives
    ``sec_kernels`` = ``3.7``): a cross-reference follows its section when sections move."""
    out = {}
    for num, title in re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? (\w+)", template, flags=re.M):
        out[f"sec_{title.lower()}"] = num
    return out


def build() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    v: dict[str, str] = {}
    inputs_section(v)
    hole_section(v)
    planner_section(v)
    vs_vllm_section(v)
    setups_section(v)
    decision_map_section(v)
    shares_section(v)
    conversational_gap_section(v)
    lfu_recency_section(v)
    restore_map_section(v)
    replay_section(v)
    glm5_section(v)
    kernel_section(v)
    hybrid_waste(v)
    default_section(v)
    engine_section(v)
    template = (PAPER / "template.md").read_text()
    v.update(section_numbers(template))
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", template)) - set(v))
    if missing:
        raise SystemExit(f"paper/template.md uses values build.py does not make: {missing}")
    text = re.sub(r"\{\{(\w+)\}\}", lambda m: v[m.group(1)], template)
    # A generated value may cite a section ({{sec_...}}): one more pass fills those.
    text = re.sub(r"\{\{(sec_\w+)\}\}", lambda m: v[m.group(1)], text)
    (PAPER / "paper.md").write_text(text)
    results_page = ROOT / "docs" / "results.md"
    summary = "\n\n".join(x for x in (
        f"Abstract figures: {v['abstract_planner']}{v['abstract_vs_vllm']}; "
        f"{v['abstract_setups']}.",
        v.get("planner_table", ""), v.get("targets_text", ""),
        v.get("mooncake_claim", ""),
        "**The connector's default.** " + v.get("default_text", ""),
        "Full write-up with figures and conditions: [paper/paper.md](../paper/paper.md).") if x)
    summary = re.sub(r"\{\{(sec_\w+)\}\}", lambda m: v[m.group(1)], summary)
    body = results_page.read_text()
    new = re.sub(r"(<!-- results:begin[^>]*-->\n).*?(<!-- results:end -->)",
                 lambda m: m.group(1) + summary + "\n" + m.group(2), body, flags=re.S)
    results_page.write_text(new)
    print(f"wrote {PAPER / 'paper.md'}, figures in {FIGURES}, {results_page}")


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="paper/build.py", description=__doc__.splitlines()[0])
    ap.add_argument("--allow-missing", action="store_true",
                    help="build even without a results file the quick run writes (its section "
                         "says pending)")
    args = ap.parse_args(argv)
    missing = missing_inputs()
    if missing and not args.allow_missing:
        files = ", ".join(_shown(RESULTS / f"{n}.json") for n in missing)
        raise SystemExit(f"paper/build.py: missing {files} (`make bench` writes "
                         f"{'it' if len(missing) == 1 else 'them'}; --allow-missing builds "
                         "without)")
    build()
    return 0


if __name__ == "__main__":
    sys.exit(main())
