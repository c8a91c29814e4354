"""The study's setups in vLLM's real engine, and the simulator's prediction of the same runs.

A workload is replayed by time stamp through vLLM's ``LLMEngine`` (``add_request`` at each
request's arrival; a closed-loop turn arrives its think time after the turn it follows
finished), once per system, each engine shut down before the next starts. Systems are setup
names of ``kvtriton.setups`` turned on by name through ``kv_connector_extra_config["setup"]``,
plus ``none`` (the GPU prefix cache alone), ``default`` (the connector with no setup given) and,
on CUDA, ``simple`` (vLLM's own ``SimpleCPUOffloadConnector``). ``eager`` is the connector
with vLLM's connector's rules (eager, head-first, LRU, no re-store), holding a finished
request's GPU table until its stores land, which vLLM's does not (``PlannerConfig
.hold_finished``; the prediction of ``simple`` runs ``eager`` and so misses that). Turns carry the
trace's hints in ``kv_transfer_params`` (``kvtriton_hint``); setups without the ``hints`` axis
ignore them.

Per system the JSON has token hit rate, CPU hit tokens, TTFT p50/p90 (arrival to first token,
seconds), output tokens/s, stored and loaded blocks. Every engine step is timed with what it
computed; ``kvtriton.sim.cost.MeasuredCost`` is fitted to all of them (per workload, across
systems) and ``kvtriton.sim.simulate`` replays the same workload, sizes and setups on that
clock: prediction and measurement side by side, with the targets (hit rate within 1 point of the
engine's for every system, the systems' TTFT p50 in the same order, modeled TTFT p50 within 20%).

Without CUDA the engine is vLLM's CPU backend serving a random-weight Llama made at run time
(``MODEL``), large enough that prefill dominates a step (the JSON records ms per 1,000 prefill
tokens); the workloads are shrunk to fit it: the agent generator at small sizes, and the shipped
coding-agent traces' first turns with every ``CC_STRIDE``-th block (``coarsen``) and capped
think times. Outputs are cut to ``MAX_OUTPUT`` tokens with fresh hashes (``fresh_outputs``): the
engine samples its own tokens, which a later prompt built from the trace never matches.

Run: ``python -m bench.vllm.engine [--full] [--workloads agent,cc_agentic] [--systems ...]``;
``--model DIR`` serves a local model folder instead (a GPU box; nothing is downloaded). Writes
``bench/results/vllm_engine.json`` (``vllm_engine_full.json`` with ``--full``).

The sizes and workloads are in ``bench.vllm.engine_workloads``, one engine run in
``bench.vllm.engine_replay``, the fit, the prediction and the targets in
``bench.vllm.engine_prediction``.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import OneLineParser, machine_info, write_result
from bench.vllm.engine_findings import findings
from bench.vllm.engine_prediction import (
    TARGET_HIT_POINTS,
    TARGET_TTFT_REL,
    combine_repeats,
    compare,
    fit_cost,
    predict,
    prefill_ms_per_1k,
)
from bench.vllm.engine_replay import run_system
from bench.vllm.engine_workloads import (
    BLOCK_TOKENS,
    CC_STRIDE,
    FULL,
    MAX_OUTPUT,
    MODEL,
    PREDICT,
    QUICK,
    SMOKE,
    THINK_CAP_S,
    WORKLOADS,
    Size,
    bench_model,
    engine_workload,
    prompt_tokens,
)

SYSTEMS = ("none", "eager", "lazy+hints", "eager+s3fifo", "default")
# A clock fitted to fewer steps than this fits its five terms to noise: no prediction from it.
MIN_FIT_STEPS = 30


def _model_dir(args: Any) -> tuple[str, int, int, str]:
    """The model folder, its vocabulary, its KV bytes per block and dtype."""
    if args.model is not None:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(args.model)
        kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_block = 2 * cfg.num_hidden_layers * kv_heads * head * 2 * BLOCK_TOKENS  # bf16
        return args.model, cfg.vocab_size, per_block, "bfloat16"
    return bench_model()


def _default_setup() -> str:
    from kvtriton.setups import DEFAULT_SETUP

    return DEFAULT_SETUP


def measure_workload(name: str, systems: list[str], args: Any, size: Size) -> dict[str, Any]:
    """Every system of ``systems`` served ``args.repeats`` times on workload ``name``: the
    workload, its sizes and one combined row per system (with every run's timed steps)."""
    model, vocab, kv_block_bytes, dtype = args.resolved_model
    wl = engine_workload(name, size)
    tokens = prompt_tokens(wl, vocab)
    longest = max(r.prompt_len + r.output_len for r in wl)
    max_model_len = -(-longest // BLOCK_TOKENS) * BLOCK_TOKENS
    if longest > size.gpu_blocks * BLOCK_TOKENS:
        raise ValueError(f"workload {name!r}: a request of {longest} tokens does not fit the "
                         f"{size.gpu_blocks}-block KV cache")
    cpu_bytes = int(size.cpu_ratio * size.gpu_blocks * kv_block_bytes)
    print(f"{name}: {len(wl)} requests, {sum(r.prompt_len for r in wl):,} prompt tokens, "
          f"GPU {size.gpu_blocks} blocks, CPU {size.cpu_ratio:g}x", flush=True)
    measured = []
    for system in systems:
        if system == "simple" and not args.cuda:
            print(f"  {system:14s} skipped: SimpleCPUOffloadConnector needs CUDA", flush=True)
            continue
        reps = [run_system(system, model, wl, tokens, gpu_blocks=size.gpu_blocks,
                           cpu_bytes=cpu_bytes, kv_bytes_per_block=kv_block_bytes, size=size,
                           max_model_len=max_model_len, dtype=dtype)
                for _ in range(args.repeats)]
        row = combine_repeats(reps)
        row["_block_bytes"] = kv_block_bytes
        measured.append(row)
        print(f"  {system:14s} hit {row['token_hit_rate']:6.1%} (CPU {row['cpu_hit_tokens']:,.0f} "
              f"tok)  TTFT p50/p90 {row['ttft_p50_s']:.3f}/{row['ttft_p90_s']:.3f} s  "
              f"{row['output_tokens_per_s']:.1f} tok/s  stored {row['stored_blocks']:,.0f} "
              f"loaded {row['loaded_blocks']:,.0f}", flush=True)
    cpu_blocks = next((r["cpu_blocks"] for r in measured if r["cpu_blocks"]),
                      int(size.cpu_ratio * size.gpu_blocks))
    return {"name": name, "wl": wl, "measured": measured, "max_model_len": max_model_len,
            "sizes": dict(gpu_blocks=measured[0]["engine_gpu_blocks"], cpu_blocks=cpu_blocks,
                          size=size)}


def _fit(rows: list[dict[str, Any]], args: Any):
    from kvtriton.specs import preset

    layout = preset("llama3-8b", block_size=BLOCK_TOKENS)
    return fit_cost(rows, layout.cpu_block_bytes, synchronous=not args.cuda)


def out_of_sample(m: dict[str, Any], others: list[dict[str, Any]], args: Any
                  ) -> dict[str, Any]:
    """The prediction of ``m``'s systems on clocks fitted to other runs than the ones it
    predicts: on the ``none`` runs of the same workload alone (the tiers predicted from an
    engine without one), and on every run of each other workload in ``others``."""
    fits: dict[str, tuple[str, list[dict[str, Any]], list[dict[str, Any]]]] = {}
    tiers = [r for r in m["measured"] if r["system"] != "none"]
    none = [r for r in m["measured"] if r["system"] == "none"]
    if none and tiers:
        fits["fit_on_none"] = (m["name"], none, tiers)
    for o in others:
        fits[f"fit_on_{o['name']}"] = (o["name"], o["measured"], m["measured"])
    out = {}
    for label, (fitted_workload, fit_rows, judged) in fits.items():
        steps = sum(len(r["_steps"]) for r in fit_rows)
        if steps < MIN_FIT_STEPS:
            out[label] = {"skipped": f"{steps} timed steps to fit, under {MIN_FIT_STEPS}"}
            continue
        cost = _fit(fit_rows, args)
        systems = [r["system"] for r in judged]
        cmp = compare(judged, predict(m["wl"], systems, cost, **m["sizes"]))
        out[label] = {"fitted_on": sorted({r["system"] for r in fit_rows}),
                      "fitted_workload": fitted_workload,
                      "cost_fit": {**cost.conditions(),
                                   "prefill_ms_per_1k_tokens": prefill_ms_per_1k(cost)},
                      **cmp}
        worst = max((abs(r["ttft_p50_rel_off"]) for r in cmp["rows"]
                     if r["ttft_p50_rel_off"] is not None), default=0.0)
        print(f"  out of sample, {label}: worst TTFT p50 {worst:.0%} off; hit rate worst "
              f"{max(abs(r['hit_points_off']) for r in cmp['rows']):.1f} pt", flush=True)
    return out


def judge_workload(m: dict[str, Any], others: list[dict[str, Any]], args: Any
                   ) -> dict[str, Any]:
    """``m``'s prediction on a clock fitted to all of its own runs (in sample), on vLLM's own
    scheduler too, and out of sample (``out_of_sample``)."""
    wl, measured, sizes, size = m["wl"], m["measured"], m["sizes"], m["sizes"]["size"]
    cost = _fit(measured, args)
    cpu_blocks = sizes["cpu_blocks"]
    systems = [r["system"] for r in measured]
    predicted = predict(wl, systems, cost, **sizes)
    cmp = compare(measured, predicted)
    # The same clock around vLLM's own scheduler: where the two predictions differ, the study's
    # loop schedules differently from vLLM; where both miss, the clock or the engine's timing.
    predicted_vllm = predict(wl, systems, cost, engine="vllm", **sizes)
    cmp_vllm = compare(measured, predicted_vllm)
    for r, rv in zip(cmp["rows"], cmp_vllm["rows"], strict=True):
        print(f"  {r['system']:14s} sim hit {r['hit_rate_sim']:6.1%} "
              f"({r['hit_points_off']:+.1f} pt)  TTFT p50 {r['ttft_p50_sim_s']:.3f} s "
              f"({r['ttft_p50_rel_off']:+.0%});  on vLLM's scheduler {rv['hit_rate_sim']:6.1%} "
              f"({rv['hit_points_off']:+.1f} pt), {rv['ttft_p50_sim_s']:.3f} s "
              f"({rv['ttft_p50_rel_off']:+.0%})", flush=True)
    print(f"  targets: {cmp['targets']}; on vLLM's scheduler {cmp_vllm['targets']}; step fit "
          f"r2 {cost.r2:.3f} over {cost.samples} steps, {prefill_ms_per_1k(cost):.0f} ms per "
          "1,000 prefill tokens", flush=True)
    oos = out_of_sample(m, others, args)
    return {"workload": wl.name, "requests": len(wl),
            "prompt_tokens": sum(r.prompt_len for r in wl), "gpu_blocks": size.gpu_blocks,
            "cpu_blocks": cpu_blocks, "cpu_ratio": size.cpu_ratio,
            "max_model_len": m["max_model_len"],
            "cost_fit": {**cost.conditions(), "prefill_ms_per_1k_tokens": prefill_ms_per_1k(cost),
                         "decode_step_ms": 1e3 * (cost.step_overhead_s
                                                  + cost.decode_step_s([256]))},
            "measured": measured,
            "predicted": _brief(predicted), "predicted_vllm_scheduler": _brief(predicted_vllm),
            **cmp, "vllm_scheduler": cmp_vllm, **({"out_of_sample": oos} if oos else {})}


def _brief(predicted: dict[str, dict]) -> dict[str, dict]:
    keys = ("token_hit_rate", "cpu_hit_tokens", "ttft_p50_s", "ttft_p90_s", "stored_blocks",
            "loaded_blocks", "ttft_all_s")
    return {s: {k: p[k] for k in keys} for s, p in predicted.items()}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.vllm.engine", description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="larger workloads (several minutes)")
    ap.add_argument("--predict", action="store_true",
                    help="the out-of-sample prediction's size: at least 200 requests per "
                         "workload, 3 repeats (about half an hour on 2 cores); writes "
                         "vllm_predict.json")
    ap.add_argument("--quick", action="store_true", help="the make bench size (the default)")
    ap.add_argument("--smoke", action="store_true", help="the tests' size: seconds per engine")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, from {', '.join(WORKLOADS)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help="comma-separated: setup names (kvtriton.setups), none, default, "
                         "simple (CUDA only)")
    ap.add_argument("--model", default=None, help="a local model folder (default: a random "
                    "Llama made at run time, for vLLM's CPU backend)")
    ap.add_argument("--time-scale", type=float, default=None,
                    help="multiply arrivals and think times by this (default: the size's)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="engine runs per system, their mean compared (default 1; 3 with "
                         "--full): the range shows the engine's own run-to-run spread")
    ap.add_argument("--cpu-ratio", type=float, default=None,
                    help="CPU tier / GPU KV cache (default: the size's)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU backend: the engine's compute threads (default 1: with one thread "
                         "per core, any other process on the machine stalls every step at "
                         "OpenMP's barriers, and the step-time fit then fits noise)")
    ap.add_argument("--out", type=Path, default=None, help="results folder")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.repeats is None:
        args.repeats = 3 if args.full or args.predict else 1
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    for name in ("time_scale", "cpu_ratio"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            ap.error(f"--workloads: unknown {w!r}; choose from {', '.join(WORKLOADS)}")
    systems = list(dict.fromkeys(s for s in args.systems.split(",") if s))
    from kvtriton.setups import parse_setup

    for s in systems:
        if s in ("none", "default", "simple"):
            continue
        try:
            parse_setup(s)
        except ValueError as e:
            ap.error(f"--systems: {e}")
    if "default" in systems and _default_setup() in systems:
        # The connector's default is a setup already listed: its run is that one.
        systems.remove("default")
    if args.model is not None and not Path(args.model).is_dir():
        ap.error(f"--model {args.model!r}: not a folder (no download is attempted)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the step recorder needs the core here
    try:
        import torch
        import vllm
    except ImportError as e:
        print(f"bench_vllm: needs vLLM ({e}); `make test` installs it", file=sys.stderr)
        return 2
    args.cuda = torch.cuda.is_available()
    if not args.cuda:
        # Before the first engine: vLLM's CPU worker then forbids changing it.
        torch.set_num_threads(args.threads)
    args.resolved_model = _model_dir(args)
    if sum((args.full, args.predict, args.smoke, args.quick)) > 1:
        ap.error("give at most one of --full, --predict, --smoke, --quick")
    size = (FULL if args.full else PREDICT if args.predict else SMOKE if args.smoke
            else QUICK)
    label = ("full" if args.full else "predict" if args.predict else "smoke" if args.smoke
             else "quick")
    for name in ("time_scale", "cpu_ratio"):
        if getattr(args, name) is not None:
            size = replace(size, **{name: getattr(args, name)})
    print(f"bench_vllm: vLLM {vllm.__version__} on "
          f"{'CUDA ' + torch.cuda.get_device_name(0) if args.cuda else 'CPU'}, model "
          f"{args.resolved_model[0]}; systems {', '.join(systems)}", flush=True)
    t0 = time.perf_counter()
    measured = [measure_workload(w, systems, args, size) for w in workloads]
    runs = {m["name"]: judge_workload(m, [o for o in measured if o is not m], args)
            for m in measured}
    for m in measured:
        for r in m["measured"]:
            del r["_steps"], r["_block_bytes"]
    name = {"full": "vllm_engine_full", "predict": "vllm_predict"}.get(label, "vllm_engine")
    doc = {"benchmark": name, "machine": machine_info(),
           "conditions": {"size": label, **size.__dict__,
                          "block_tokens": BLOCK_TOKENS, "max_output_tokens": MAX_OUTPUT,
                          "cc_stride": CC_STRIDE, "think_cap_s": THINK_CAP_S,
                          "model": args.model or {"random_llama": MODEL},
                          "backend": "cuda" if args.cuda else "cpu", "vllm": vllm.__version__,
                          "cpu_threads": None if args.cuda else args.threads,
                          "repeats": args.repeats,
                          "default_setup": _default_setup(),
                          "simulator_layout": "llama3-8b preset (blocks given in blocks; "
                                              "transfer rates scaled per block)"},
           "targets": {"hit_rate_points": TARGET_HIT_POINTS, "ttft_p50_rel": TARGET_TTFT_REL},
           "runs": runs, "wall_s": time.perf_counter() - t0}
    path = write_result(name, doc, args.out, findings)
    print(f"wrote {path} ({doc['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
