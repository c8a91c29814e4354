"""Regenerate ``paper/paper.md``, its figures and the README's results from ``bench/results/``.

Every number in the paper comes from a results file written by ``python -m bench``; the prose
lives in ``paper/template.md`` with ``{{name}}`` placeholders that this script fills. A missing
results file leaves its section marked as pending rather than failing, so the paper always
states what was and was not run.

Run: ``python paper/build.py`` (after ``make bench``).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PAPER = ROOT / "paper"
FIGURES = PAPER / "figures"

sys.path.insert(0, str(ROOT))

from kvtriton.plots import (  # noqa: E402 - the repo root goes on the path first
    PLANNER_VARIANTS,
    plot_capacity,
    plot_hole,
    plot_kernels,
    plot_planner,
    plot_sweep,
)


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


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
        v["hole_text"] = "*Pending: `python -m bench.hole_demo` has not been run.*"
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


def planner_section(v: dict) -> None:
    doc = _load("planner")
    if doc is None:
        v["planner_text"] = "*Pending: `python -m bench.bench_planner` has not been run.*"
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
    anchor = doc.get("vllm_anchor_ms", {}).get("by_requests", {})
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
    if "128" in anchor:
        a = anchor["128"]
        lines.append(f"For scale, vLLM 0.33.0's scheduler, measured on the same machine class, "
                     f"takes {a['control']} ms per step at 128 requests with its cursor-only "
                     f"control and {a['restore_loop']} ms with the re-scan re-store design "
                     f"(source: {doc['vllm_anchor_ms']['source']}).")
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
    plot_planner(doc, FIGURES / "planner.png")
    v["fig_planner"] = "![planner cost per step](figures/planner.png)"


POLICY_ORDER = ["no_cpu", "control", "restore", "restore_tail", "restore_tail_bounded",
                "restore_tail_bounded_arc", "restore_tail_bounded_s3fifo"]


def sim_section(v: dict) -> None:
    doc = _load("sim_agent")
    if doc is None:
        v["sim_text"] = "*Pending: `python -m bench.bench_sim` has not been run.*"
        v["sim_table"] = v["fig_sim"] = ""
        v["abstract_sim"] = "the simulation has not been run"
        return
    runs = doc["runs"]
    cond = runs[0]["conditions"]
    policies = [p for p in POLICY_ORDER if any(r["policy"] == p for r in runs[0]["rows"])]
    header = ["CPU tokens", *policies, "Belady bound"]
    rows = []
    for run in runs:
        by = {r["policy"]: r for r in run["rows"]}
        rows.append([f"{run['cpu_tokens']:,}"]
                    + [f"{_pct(by[p]['token_hit_rate'])} / {by[p]['ttft_p90_s']:.2f}s"
                       for p in policies]
                    + [_pct(run["bound"]["hit_rate"]) if run.get("bound") else "-"])
    v["sim_table"] = (f"Agent workload (`{doc['workload']}`, {doc['requests']:,} requests), GPU "
                      f"{doc['gpu_tokens']:,} tokens, {runs[0]['conditions']['model']} on a "
                      f"modeled {runs[0]['conditions']['gpu']}. Each cell: token hit rate / "
                      "modeled TTFT p90.\n\n" + _table(header, rows))
    mid = runs[len(runs) // 2]
    by = {r["policy"]: r for r in mid["rows"]}
    detail_cols = ["policy", "hit rate", "CPU hit tokens", "recomputed tokens", "stored",
                   "re-stored", "re-store thrash", "running evictions", "chain holes",
                   "TTFT p50 / p99 (s)", "planner ms/step"]
    detail = [[p, _pct(by[p]["token_hit_rate"]), f"{by[p]['cpu_hit_tokens']:,}",
               f"{by[p]['recomputed_tokens']:,}", f"{by[p]['stored_blocks']:,}",
               f"{by[p]['restored_blocks']:,}", f"{by[p]['restore_thrash']:,}",
               f"{by[p]['running_evictions']:,}", f"{by[p]['chain_holes']:,}",
               f"{by[p]['ttft_p50_s']:.2f} / {by[p]['ttft_p99_s']:.2f}",
               f"{by[p]['planner_ms_per_step']:.3f}"] for p in policies]
    v["sim_detail_table"] = (f"At {mid['cpu_tokens']:,} CPU tokens:\n\n"
                             + _table(detail_cols, detail))
    cm = cond["cost_model"]
    v["sim_text"] = (
        f"Machine: {_machine(doc)}. Workload: `{doc['workload']}`, {doc['requests']:,} requests "
        f"(the agent generator, closed loop). Model {cond['model']} on a modeled {cond['gpu']} "
        f"({cond['layout']}); GPU {doc['gpu_tokens']:,} tokens; token budget "
        f"{cond['token_budget']:,} per step; cost model: MFU {cm['mfu']}, step overhead "
        f"{cm['step_overhead_s'] * 1e3:.1f} ms, host link {cm['h2d_bytes_per_s'] / 1e9:.0f} GB/s "
        "each way (constants and sources in `kvtriton/sim/cost.py`). TTFT is modeled; planner "
        "time is measured.")
    best = max(policies, key=lambda p: by[p]["token_hit_rate"])
    ctrl = by.get("control")
    v["abstract_sim"] = (f"on a multi-turn agent workload at {mid['cpu_tokens']:,} CPU tokens "
                         f"the best policy is `{best}` at {_pct(by[best]['token_hit_rate'])} "
                         "token hit rate"
                         + (f" against {_pct(ctrl['token_hit_rate'])} for the control"
                            if ctrl else ""))
    v["sim_best"] = best
    plot_capacity(doc, policies, FIGURES / "sim_capacity.png")
    v["fig_sim"] = "![hit rate and TTFT vs CPU capacity](figures/sim_capacity.png)"


def mooncake_sim_section(v: dict) -> None:
    doc = _load("sim_mooncake")
    if doc is None:
        v["mooncake_sim"] = ("*Pending: the whole-trace Mooncake simulation "
                             "(`python -m bench.bench_sim --mooncake`) has not been run.*")
        return
    st = doc["settings"]
    c = doc["conditions"]
    by = {r["policy"]: r for r in doc["rows"]}
    policies = [p for p in POLICY_ORDER if p in by]
    cols = ["policy", "hit rate", "CPU hit tokens", "recomputed tokens", "re-stored",
            "preemptions", "TTFT p50 / p90 (s)", "planner ms/step", "wall (s)"]
    rows = [[p, _pct(by[p]["token_hit_rate"]), f"{by[p]['cpu_hit_tokens']:,}",
             f"{by[p]['recomputed_tokens']:,}", f"{by[p]['restored_blocks']:,}",
             f"{by[p]['preemptions']:,}",
             f"{by[p]['ttft_p50_s']:.1f} / {by[p]['ttft_p90_s']:.1f}",
             f"{by[p]['planner_ms_per_step']:.3f}", f"{by[p]['wall_s']:.0f}"] for p in policies]
    bound = doc.get("bound")
    v["mooncake_sim"] = (
        f"The whole shipped Mooncake trace ({doc['requests']:,} requests) through the serving "
        f"loop with every policy took {doc['wall_s']:.0f} s of wall time on {_machine(doc)}. "
        f"Settings: {st['block_size']}-token blocks, arrivals spread {st['time_scale']:g}x "
        "(the trace was recorded on a cluster and saturates one modeled GPU), GPU "
        f"{c['gpu_gib']:.0f} GiB and CPU {c['cpu_gib']:.0f} GiB of {c['model']} KV on a modeled "
        f"{c['gpu']}."
        + (f" Belady's MIN at the same total capacity (cache-only): {_pct(bound['hit_rate'])}."
           if bound else "")
        + "\n\n" + _table(cols, rows))


def replay_section(v: dict) -> None:
    parts, tables = [], []
    for tag, label in (("mooncake", "Mooncake synthetic trace"), ("agent", "agent generator"),
                       ("cc_agentic", "coding-agent traces")):
        doc = _load(f"replay_{tag}")
        if doc is None:
            continue
        s = doc["sweep"]
        policies = list(s["hit_rate"])
        header = ["capacity (tokens)", *policies]
        rows = [[f"{c:,}"] + [_pct(s["hit_rate"][p][i]) for p in policies]
                for i, c in enumerate(s["capacities_tokens"])]
        rows.append(["infinite"] + [_pct(s["max_hit_rate"])] * len(policies))
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
        v["kernel_check_table"] = "*Pending: `python -m bench.kernel_check` has not been run.*"
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
                               "are not reported. `python -m bench.bench_kernels` measures them "
                               "on a CUDA machine, and this section fills in from its JSON.")
        v["fig_kernels"] = ""
        return
    plot_kernels(bw, FIGURES / "kernels.png")
    targets = [f"- {t['target']}: {t['value']:.3g}, {'met' if t['met'] else '**missed**'}"
               if t.get("value") is not None else f"- {t['target']}: not measured"
               for t in bw["targets"].values()]
    v["kernel_bw_text"] = f"Machine: {_machine(bw)}.\n\n" + "\n".join(targets)
    v["fig_kernels"] = "![kernel bandwidth](figures/kernels.png)"


def build() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    v: dict[str, str] = {}
    hole_section(v)
    planner_section(v)
    sim_section(v)
    mooncake_sim_section(v)
    replay_section(v)
    kernel_section(v)
    template = (PAPER / "template.md").read_text()
    missing = sorted(set(re.findall(r"\{\{(\w+)\}\}", template)) - set(v))
    if missing:
        raise SystemExit(f"paper/template.md uses values build.py does not make: {missing}")
    text = re.sub(r"\{\{(\w+)\}\}", lambda m: v[m.group(1)], template)
    (PAPER / "paper.md").write_text(text)
    readme = ROOT / "README.md"
    summary = "\n\n".join(x for x in (
        f"Abstract figures: {v['abstract_planner']}; {v['abstract_sim']}.",
        v.get("planner_table", ""), v.get("sim_table", ""),
        v.get("mooncake_claim", ""),
        "Full write-up with figures and conditions: [paper/paper.md](paper/paper.md).") if x)
    body = readme.read_text()
    new = re.sub(r"(<!-- results:begin[^>]*-->\n).*?(<!-- results:end -->)",
                 lambda m: m.group(1) + summary + "\n" + m.group(2), body, flags=re.S)
    readme.write_text(new)
    print(f"wrote {PAPER / 'paper.md'}, figures in {FIGURES}, results section of {readme}")


if __name__ == "__main__":
    build()
