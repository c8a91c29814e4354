"""Which setup wins: the ablation, the targets, the references and the hints
(``setups_<tag>.json``)."""

from __future__ import annotations

from bench.plots import plot_gain_over_control
from kvtriton.setups import NATIVE_SETUPS, UPPER_BOUND_SETUPS
from paper.format import machine_line, md_table, pct, points, share_pct
from paper.results import FIGURES, setup_docs


def _kind(row: dict) -> str:
    """What a reference row is, in the paper's words (nothing for an online setup)."""
    if row["composition"] in UPPER_BOUND_SETUPS:
        return " (upper bound)"
    return " (oracle reference)" if row["oracle"] else ""


def _bounds_intro(docs: dict) -> str:
    """How far the best online setup of each run stays from the cache-only Belady figure, as
    the study found it per run (``findings.runs[].best_online_below_cache_only``)."""
    gaps = [(b["points"], doc["findings"]["label"], run["cpu_ratio"], b["setup"])
            for doc in docs.values() for run in doc["findings"]["runs"]
            if (b := run["best_online_below_cache_only"]) is not None]
    if not gaps:
        return "No run recorded the cache-only Belady figure."
    far, near = max(gaps), min(gaps)

    def where(g: tuple) -> str:
        return f"{g[1]}, CPU {g[2]}x, `{g[3]}`"

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
    for doc in docs.values():
        label = doc["findings"]["label"]
        if not doc.get("split"):
            lines.append(f"- {label}: written before the split; its figures are "
                         "over the whole run, and nothing is chosen from it.")
            continue
        control = next(r for r in doc["runs"][0]["rows"] if r["composition"] == "eager")
        sizes = ", ".join(f"{name} {p['requests']:,} requests ({p['prompt_tokens']:,} prompt "
                          "tokens)" for name, p in control["parts"].items())
        lines.append(f"- {label}: {doc['split_text']}: {sizes}.")
    return "\n".join(lines)


def setups_section(v: dict) -> None:
    docs = setup_docs()
    if not docs:
        for k in ("setups_text", "ablation_table", "setups_tables", "fig_gap",
                  "targets_text", "bounds_text", "hints_text", "split_text", "provenance_text",
                  "native_text", "sessions_text"):
            v[k] = "*Pending: `python -m bench.tier_study.setups` has not been run.*"
        v["abstract_setups"] = "the setup benchmark has not been run"
        return
    labels = {tag: doc["findings"]["label"] for tag, doc in docs.items()}
    _conditions(v, docs, labels)
    _ablation(v, docs, labels)
    _detail(v, docs, labels)
    _figures(v, docs, labels)
    _targets(v, docs, labels)
    v["split_text"] = split_text(docs)
    v["provenance_text"] = _provenance_text(docs, labels)
    _bounds(v, docs, labels)
    _signals(v, docs, labels)
    _native(v, docs, labels)
    _sessions(v, docs, labels)
    _abstract(v, docs, labels)


def _conditions(v: dict, docs: dict, labels: dict) -> None:
    """The machine, model, cost model and workloads the study ran."""
    first = next(iter(docs.values()))
    cond = first["runs"][0]["conditions"]
    cm = cond["cost_model"]
    v["setups_text"] = (
        f"Machine: {machine_line(first)}. Model {cond['model']} on a modeled {cond['gpu']} "
        f"({cond['layout']}); token budget {cond['token_budget']:,} per step, at most "
        f"{cond['max_running']} running requests; cost model: MFU {cm['mfu']}, step overhead "
        f"{cm['step_overhead_s'] * 1e3:.1f} ms, host link {cm['h2d_bytes_per_s'] / 1e9:.0f} GB/s "
        "each way (`kvtriton/sim/cost.py`). TTFT is modeled. Workloads: "
        + "; ".join(f"{labels[t]}: `{d['workload']}`, {d['requests']:,} requests, GPU "
                    f"{d['gpu_tokens']:,} tokens" for t, d in docs.items()) + ".")


def _ablation(v: dict, docs: dict, labels: dict) -> None:
    """The ablation: hit rate and gain over the control per setup, workload and capacity."""
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
            cells.append("-" if r is None else pct(r["token_hit_rate"]) if k in small else
                         f"{pct(r['token_hit_rate'])} ({points(r.get('gain_points'))})")
        rows.append(cells)
    threshold = next((t["material_gap_points"] for doc in docs.values()
                      for t in doc["targets"] if "material_gap_points" in t), None)
    v["ablation_table"] = (
        "Token hit rate and, in parentheses, its gain over the control (`eager`) in points, at "
        "the same capacity. `eager+nextuse` and `lazy+nextuse` are oracle references: next-use "
        "eviction knows the future, yet it is not the best a tier of that memory can do, and "
        "online setups pass it. `eager+inf`, a tier that never evicts, is an upper bound: no "
        "setup of that memory hits a block it does not."
        + ("" if threshold is None else
           f" Where next-use eviction gains under {threshold:g} points the columns give the "
           "hit rate alone and no target is judged there.") + "\n\n" + md_table(cols, rows))


def _detail(v: dict, docs: dict, labels: dict) -> None:
    """Per run (workload, capacity), every row's figures."""
    tables = []
    detail = ["setup", "hit rate", "gain (points)", "share of headroom", "CPU hit tokens",
              "stored", "re-stored", "re-store thrash", "TTFT p50 / p90 / mean (s)"]
    for tag, doc in docs.items():
        for run in doc["runs"]:
            trs = [[f"`{r['setup']}`" + _kind(r),
                    pct(r["token_hit_rate"]), points(r.get("gain_points")),
                    share_pct(r.get("headroom_share")),
                    f"{r['cpu_hit_tokens']:,}", f"{r['stored_blocks']:,}",
                    f"{r['restored_blocks']:,}", f"{r['restore_thrash']:,}",
                    f"{r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f}"
                    + (f" / {r['ttft_mean_s']:.2f}" if "ttft_mean_s" in r else "")]
                   for r in run["rows"]]
            cob = run.get("cache_only_bound")
            upper = (run.get("references") or {}).get("upper_bound")
            tables.append(
                f"**{labels[tag]}, CPU {run['cpu_ratio']}x the GPU** ({run['cpu_tokens']:,} "
                "tokens)" + (f"; cache-only Belady over GPU + CPU: {pct(cob['hit_rate'])}"
                             if cob else "")
                + (f"; the headroom is to the tighter upper bound, {upper['setup']} "
                   f"({pct(upper['token_hit_rate'])})" if upper else "")
                + ":\n\n" + md_table(detail, trs))
    v["setups_tables"] = "\n\n".join(tables)


def _figures(v: dict, docs: dict, labels: dict) -> None:
    """Per workload, the figure of each setup's gain over the control."""
    figs = []
    for tag, doc in docs.items():
        runs = [{"label": f"CPU {run['cpu_ratio']}x", "rows": run["rows"]}
                for run in doc["runs"]]
        plot_gain_over_control(runs, FIGURES / f"gain_{tag}.png",
                               f"{labels[tag]}: `{doc['workload']}`")
        figs.append(f"![{labels[tag]}: hit rate over the control per setup]"
                    f"(figures/gain_{tag}.png)")
    v["fig_gap"] = "\n\n".join(figs)


def _targets(v: dict, docs: dict, labels: dict) -> None:
    """Per run, the best online setup against its target."""
    def target_line(tag: str, t: dict) -> str:
        tol = t.get("ttft_tolerance_s")
        strict = "" if tol is None else (
            "; with no tolerance: " + (f"`{t['best_strict']}`, "
                                       f"{points(t['gain_points_strict'])} points"
                                       if t.get("best_strict") else "none"))
        split = "gain_points_train" in t
        where = " on the test part" if split else ""
        upper = ("" if t.get("upper_bound") is None else
                 f", upper bound `{t['upper_bound']}` {pct(t['upper_bound_hit_rate'])}")
        chosen = (f"`{t['best']}`"
                  + (f", chosen on the train part ({points(t['gain_points_train'])} points "
                     "there)," if split else "")
                  + f" gains {points(t['judged_gain_points'])} points{where} "
                  f"({share_pct(t['judged_headroom_share'])} of the headroom to the upper "
                  "bound) ")
        return (f"- {labels[tag]}, CPU {t['cpu_ratio']}x: best online setup with TTFT p50 and "
                "p90 no worse than the control's"
                + ("" if tol is None else f" (within {tol:.2f} s)") + ": "
                + (chosen if t["best"] else "none gains ")
                + f"(control {pct(t['control_hit_rate'])}, oracle reference "
                f"`{t['oracle_reference']}` {pct(t['oracle_hit_rate'])}{upper}{where}); target "
                f"{t['target']:.0%} of the oracle reference's {points(t['oracle_gain_points'])} "
                f"points, {points(t['target_points'])}: "
                + (f"not judged: next-use eviction gains {t['oracle_gain_points']:.1f} points"
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


def _provenance_text(docs: dict, labels: dict) -> str:
    """When the splits and the candidates came, against the results already seen, and each
    target judged again without the candidates that joined late (``findings.without_late``)."""
    late = []
    for tag, doc in docs.items():
        for w in doc["findings"].get("without_late", []):
            if w is None:
                continue
            verdict = ("not judged" if w["met"] is None else "met" if w["met"]
                       else "**missed**")
            late.append(f"{labels[tag]}, CPU {w['cpu_ratio']}x: "
                        + (f"`{w['best']}`, {points(w['judged_gain_points'])} points on the "
                           "test part" if w["best"] else "no setup gains on the train part")
                        + f" (target {points(w['target_points'])}: {verdict})")
    return (
        "These splits were made on 2026-12-02 (commit `2106845`), after whole-run results of "
        "every setup on the same workloads existed (commits `e4b3821` and `59d05cc`, "
        "2026-12-01): no part's figure informed them, but they were not fixed before any "
        "result was seen. Two candidates joined after test figures had been seen: "
        "`eager+lfu:64` and `eager+lfu:64+waiting` entered the ablation (`c97a823`) 37 minutes "
        "after the conversational-gap study recorded their gains on Mooncake's test half "
        "(`41f4b4d`; Section {{sec_what}}). Judged without them, each target they won: "
        + ("; ".join(late) if late else "none (no target chose them)") + ". The `sessions` "
        "setups and vLLM 0.33's own connector (`eager+reqlru`, `eager+reqarc`) joined on "
        "2026-12-07 (`7378d7f`), before any figure of theirs existed, on the same splits.")


def _bounds(v: dict, docs: dict, labels: dict) -> None:
    """The references of every run: the oracle references and the upper bounds."""
    blines = []
    for tag, doc in docs.items():
        for run in doc["runs"]:
            rb = {r["composition"]: r for r in run["rows"]}
            cob = run.get("cache_only_bound")
            parts = [f"{labels[tag]}, CPU {run['cpu_ratio']}x: control "
                     f"{pct(rb['eager']['token_hit_rate'])}"]
            for comp, what in (("eager+nextuse", "next-use eviction, eager (oracle reference)"),
                               ("lazy+nextuse", "next-use eviction, lazy (oracle reference)"),
                               ("eager+inf", "unbounded tier (upper bound)")):
                if comp in rb:
                    parts.append(f"{what} {pct(rb[comp]['token_hit_rate'])}")
            if cob:
                parts.append(f"cache-only Belady (upper bound) {pct(cob['hit_rate'])}")
            blines.append("- " + ", ".join(parts) + ".")
    v["bounds_text"] = "\n".join(blines)
    v["bounds_intro"] = _bounds_intro(docs)


def _signals(v: dict, docs: dict, labels: dict) -> None:
    """Hints and the other online signals, as gains over what they change (the study's findings)."""
    hl = []
    for tag, doc in docs.items():
        for run in doc["findings"]["runs"]:
            cells = [f"`{g['setup']}` {g['points']:+.1f} over `{g['over']}`"
                     for g in run["signal_gains"]]
            if cells:
                hl.append(f"- {labels[tag]}, CPU {run['cpu_ratio']}x (points of hit rate): "
                          + "; ".join(cells) + ".")
    v["hints_text"] = (
        "The hints a server has come from the model's stop reasons: a turn that ended in a tool "
        "call is hinted `continue`. No trace records a client closing its session; a row "
        "`[oracle closes]` gives the same setup each session's last turn as a close, which "
        "uses the future (no later turn exists), so it is an oracle and never the best "
        "setup.\n\n" + "\n".join(hl))


def _abstract(v: dict, docs: dict, labels: dict) -> None:
    """The abstract's clause: the best online setup per workload at CPU = GPU."""
    ab = []
    for tag, doc in docs.items():
        t = doc["targets"][0]
        if not t["best"]:
            continue
        split = "gain_points_train" in t
        ab.append(f"`{t['best']}`" + (", chosen on a train part," if split else "")
                  + f" gains {points(t['judged_gain_points'])} points over the control ("
                  + ("" if t["judged_headroom_share"] is None else
                     f"{share_pct(t['judged_headroom_share'])} of the headroom to the upper "
                     "bound; ")
                  + f"next-use eviction, an oracle, {points(t['oracle_gain_points'])}) on "
                  f"the {labels[tag]}" + ("'s test part" if split else "")
                  + f" at CPU {t['cpu_ratio']}x" + _overload_note(doc, t))
    v["abstract_setups"] = "; ".join(ab) if ab else "no online setup beat the control"


def _test_points(row: dict | None) -> float | None:
    """A row's gain over the control on the test part (None: not run, or no parts)."""
    if row is None or "parts" not in row:
        return None
    return row["parts"]["test"].get("gain_points")


def _native(v: dict, docs: dict, labels: dict) -> None:
    """kvtriton's choice against vLLM 0.33's own offloading connector (``NATIVE_SETUPS``), per
    run on the test part: where kvtriton's train choice beats the better native policy."""
    lines, wins, runs = [], 0, 0
    for tag, doc in docs.items():
        for run, t in zip(doc["runs"], doc["targets"], strict=True):
            rows = {r["composition"]: r for r in run["rows"]}
            native = {c: _test_points(rows.get(c)) for c in NATIVE_SETUPS}
            native = {c: g for c, g in native.items() if g is not None}
            if not native or not doc.get("split"):
                continue
            runs += 1
            best_native = max(native.values())
            cells = "; ".join(f"{NATIVE_SETUPS[c]} (`{c}`) {points(g)}"
                              for c, g in native.items())
            if t["best"] is None:
                verdict = ("kvtriton chose nothing on the train part (the control), "
                           f"{points(-best_native)} against the better native policy")
                delta = -best_native
            else:
                chosen = t["judged_gain_points"]
                delta = chosen - best_native
                verdict = (f"kvtriton's train choice `{t['best']}`"
                           + (" (a native policy itself)" if t["best"] in NATIVE_SETUPS
                              else "") + f" {points(chosen)}, "
                           + (f"{points(delta)} over the better native policy" if delta > 0
                              else f"{points(delta)} against the better native policy"))
            wins += delta > 0
            lines.append(f"- {labels[tag]}, CPU {run['cpu_ratio']}x: {cells}; {verdict}.")
    v["native_text"] = (
        "vLLM 0.33's `OffloadingConnector` is what a user would turn on instead. Its two "
        "eviction policies run as setups in the same loop (eager stores of every computed block, "
        "as it stores them, and its policy's order: `kvtriton/eviction/request_lru.py` and "
        "`request_arc.py`, whose eviction order matched vLLM's own policy classes on every "
        "random sequence of `python -m bench --only native_policies`). Its ARC is also "
        "kvtriton's default (Section {{sec_default}}). Gains in points over the control on "
        "each run's test part:\n\n" + "\n".join(lines)
        + f"\n\nkvtriton's train choice beats the better native policy on the test part in "
        f"{wins} of {runs} runs." if lines else
        "*Pending: no setup study ran the native connector's setups.*")


#: The sessions rows and what each is compared with in ``sessions_text``.
SESSION_ROWS = ("eager+sessions", "eager+sessions:60", "eager+lfu:64+sessions")
SESSION_PEERS = ("eager+hints", "eager+lfu:64")


def _sessions(v: dict, docs: dict, labels: dict) -> None:
    """The ``sessions`` axis beside ``hints`` (which needs the client) and ``lfu``, train and
    test points per run, with whether its TTFT passed the rule."""
    lines = []
    for tag, doc in docs.items():
        if not doc.get("split"):
            continue
        for run in doc["runs"]:
            rows = {r["composition"]: r for r in run["rows"]}
            cells = []
            for c in SESSION_ROWS + SESSION_PEERS:
                r = rows.get(c)
                if r is None or "parts" not in r:
                    continue
                ok = "" if r.get("ttft_no_worse", True) else ", TTFT worse"
                cells.append(f"`{c}` {points(r['parts']['train'].get('gain_points'))} / "
                             f"{points(r['parts']['test'].get('gain_points'))}{ok}")
            if any(c.startswith("`eager+sessions") or "+sessions" in c for c in cells):
                lines.append(f"- {labels[tag]}, CPU {run['cpu_ratio']}x (train / test points): "
                             + "; ".join(cells) + ".")
    v["sessions_text"] = (
        "**Sessions.** A server that knows each request's session (the request's "
        "`session_id`, or `kv_transfer_params`) can keep a finished turn's blocks for the "
        "session's next turn without any hint from the client: `sessions` protects them in up "
        "to half the tier, lets the session silent longest go first, and drops a session "
        "silent for 300 s (`sessions:60`: 60 s). Traces without sessions (Mooncake, GLM-5) "
        "get them inferred "
        "as a server could on arrival: a prompt that extends an earlier request's whole prompt "
        "joins its session (`kvtriton.sim.workload.causal_sessions`). Train and test gains "
        "over the control, beside `hints` (which needs the client) and `lfu`:\n\n"
        + "\n".join(lines)) if lines else (
        "**Sessions.** *Pending: no setup study ran the `sessions` setups.*")
