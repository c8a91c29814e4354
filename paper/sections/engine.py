"""The setups in vLLM's real engine and the simulator's prediction (``vllm_engine.json``)."""

from __future__ import annotations

from kvtriton.setups import DEFAULT_SETUP
from paper.format import machine_line, md_table, pct, run_range, verdict_word
from paper.results import load, not_run


def engine_section(v: dict) -> None:
    """The real-engine benchmark: measured rows, the simulator's prediction, the targets."""
    doc = load("vllm_engine")
    if doc is None:
        v["engine_text"] = f"*Pending: `vllm_engine.json` is {not_run('vllm_engine.json')}.*"
        v["prediction_text"] = prediction_text()
        return
    c = doc["conditions"]
    model = c["model"]
    model_txt = (f"a random-weight Llama made at run time ({model['random_llama']['num_layers']} "
                 f"layers of width {model['random_llama']['hidden_size']}, fp32)"
                 if isinstance(model, dict) else f"`{model}`")
    parts = [
        f"vLLM {c['vllm']} on its {c['backend'].upper()} backend, {machine_line(doc)}, serving "
        f"{model_txt}; {c['block_tokens']}-token blocks, a KV cache of {c['gpu_blocks']} "
        f"blocks, a CPU tier {c['cpu_ratio']:g} times that, at most "
        f"{c['max_num_batched_tokens']:,} tokens and {c['max_num_seqs']} requests per step. "
        "Each workload is replayed by time stamp (arrivals and think times x"
        f"{c['time_scale']:g}), once per system, the engine stepping while its scheduler has "
        "work, pending stores included, as `vllm serve` does, each turn's trace hint in "
        "`kv_transfer_params`; outputs are cut to "
        f"{c['max_output_tokens']} tokens (`python -m bench.vllm.engine`, "
        "`bench/vllm/engine.py` says how the traces are shrunk). The simulator then replays the "
        "same workload at the same sizes on a clock fitted to this engine's own steps "
        "(`MeasuredCost`, least squares over every step of every system). The connector's "
        f"default setup when this ran, `{c.get('default_setup', 'default')}`, is the row of "
        "that name"
        + (" (`default`)" if any(m["system"] == "default" for r in doc["runs"].values()
                                 for m in r["measured"]) else "")
        + ("" if c.get("default_setup") in (None, DEFAULT_SETUP) else
           f"; the default is now `{DEFAULT_SETUP}` (Section {{{{sec_default}}}}), which this "
           "run did not include") + "."
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
        parts.append(md_table(
            ["system", "token hit rate", "CPU hit tokens", "TTFT p50 (s)", "TTFT p90 (s)",
             "output tok/s", "stored blocks", "loaded blocks"],
            [[f"`{m['system']}`", pct(m["token_hit_rate"]) + run_range(m, "token_hit_rate", pct),
              f"{m['cpu_hit_tokens']:,.0f}",
              f"{m['ttft_p50_s']:.3f}" + run_range(m, "ttft_p50_s", lambda x: f"{x:.3f}"),
              f"{m['ttft_p90_s']:.3f}", f"{m['output_tokens_per_s']:.1f}",
              f"{m['stored_blocks']:,.0f}", f"{m['loaded_blocks']:,.0f}"]
             for m in run["measured"]]))
        parts.append(md_table(
            ["system", "hit rate: engine", "simulator", "off (points)", "TTFT p50: engine (s)",
             "simulator (s)", "off"],
            [[f"`{r['system']}`", pct(r["hit_rate_engine"]), pct(r["hit_rate_sim"]),
              f"{r['hit_points_off']:+.1f}", f"{r['ttft_p50_engine_s']:.3f}",
              f"{r['ttft_p50_sim_s']:.3f}",
              "-" if r["ttft_p50_rel_off"] is None else f"{r['ttft_p50_rel_off']:+.0%}"]
             for r in run["rows"]]))
        t = run["targets"]
        worst = doc["findings"]["runs"][w]
        parts.append(
            f"Targets: hit rate within {targets['hit_rate_points']:g} point for every system "
            f"{verdict_word(t['hit_rate_within_1_point'])} (worst "
            f"{worst['worst_hit_points_off']:.1f}); TTFT p50 in the "
            f"same order {verdict_word(t['ttft_p50_same_order'])} over the "
            f"{run.get('ttft_pairs_compared', 0)} pairs of systems whose measured p50s differ "
            f"by more than {targets['ttft_p50_rel']:.0%}"
            + "".join(f", misordered `{a}`/`{b}`" for a, b in run.get("ttft_pairs_misordered", []))
            + " (engine, fastest first: "
            + ", ".join(f"`{s}`" for s in run["ttft_order_engine"]) + "; simulator: "
            + ", ".join(f"`{s}`" for s in run["ttft_order_sim"]) + "); modeled TTFT p50 within "
            f"{targets['ttft_p50_rel']:.0%} {verdict_word(t['ttft_p50_within_20pct'])} (worst "
            f"{worst['worst_ttft_p50_rel_off']:.0%}).")
    v["engine_text"] = "\n\n".join(parts)
    v["prediction_text"] = prediction_text()


def _off(rows: list[dict], system: str) -> str:
    r = next((r for r in rows if r["system"] == system), None)
    if r is None:
        return "-"
    rel = "-" if r["ttft_p50_rel_off"] is None else f"{r['ttft_p50_rel_off']:+.0%}"
    return f"{r['ttft_p50_sim_s']:.3f} ({rel})"


def prediction_text() -> str:
    """The out-of-sample prediction (``vllm_predict.json``, a study by name): per workload and
    system, the engine's TTFT p50 with its range over repeats beside the simulator's on a clock
    fitted in sample and on two out-of-sample clocks."""
    doc = load("vllm_predict")
    if doc is None:
        return ("*The out-of-sample prediction has not been run: `vllm_predict.json` is "
                f"{not_run('vllm_predict.json')} (`python -m bench --only vllm_predict`).*")
    c = doc["conditions"]
    parts = [
        f"**Out of sample** (`python -m bench --only vllm_predict`; {machine_line(doc)}; vLLM "
        f"{c['vllm']}, the same model and capacities, {c['repeats']} runs per system). The "
        "clock is fitted three ways and each prediction is judged on runs it was not fitted "
        "to, except the first: *in sample*, on every run of the workload (what the tables above "
        "do); *fit on none*, on the `none` runs alone (no tier), predicting the tiers; *fit on "
        "the other workload*, on every run of the other workload. TTFT p50 in seconds, the "
        "simulator's relative miss in brackets; the engine's range over its runs is its own "
        "spread, a floor under any miss."]
    found = doc["findings"]["runs"]
    for w, run in doc["runs"].items():
        oos = {k: o for k, o in run.get("out_of_sample", {}).items() if "rows" in o}
        labels = list(oos)
        head = (["system", "hit rate: engine (range)", "simulator",
                 "TTFT p50: engine (range)", "in sample"]
                + [("fit on none" if k == "fit_on_none" else
                    f"fit on {k.removeprefix('fit_on_')}") for k in labels])
        rows = []
        for m in run["measured"]:
            s = m["system"]
            sim = next(r for r in run["rows"] if r["system"] == s)
            rows.append([f"`{s}`", pct(m["token_hit_rate"]) + run_range(m, "token_hit_rate", pct),
                         f"{pct(sim['hit_rate_sim'])} ({sim['hit_points_off']:+.1f})",
                         f"{m['ttft_p50_s']:.3f}"
                         + run_range(m, "ttft_p50_s", lambda x: f"{x:.3f}"),
                         _off(run["rows"], s)] + [_off(oos[k]["rows"], s) for k in labels])
        f = found[w]
        spread = f["engine_spread"]
        ins = f["in_sample_tiers"]
        summary = [f"in sample (tiers) {ins['worst_ttft_p50_rel_off']:.0%}"] if ins else []
        summary += [f"{k.replace('_', ' ')} {o['worst_ttft_p50_rel_off']:.0%}"
                    for k, o in f["out_of_sample"].items()]
        parts.append(
            f"**{w}** ({run['requests']} requests; in-sample fit R\u00b2 "
            f"{run['cost_fit']['r2']:.2f}). Worst TTFT p50 miss: " + ", ".join(summary)
            + ("" if spread is None else
               f"; the engine's own widest range is {spread['ttft_p50_rel']:.0%} of its mean "
               f"TTFT p50 and {spread['hit_points']:.1f} points of hit rate") + ".\n\n"
            + md_table(head, rows))
    return "\n\n".join(parts)
