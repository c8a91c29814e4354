"""vLLM with kvtriton's CPU tier, against vLLM without one and with vLLM's own CPU offload.

A trace is replayed by time stamp through vLLM's engine (``LLMEngine.add_request`` at each
request's arrival, scaled by ``--time-scale``; a closed-loop turn arrives its think time after
the turn it follows finished), with greedy sampling of each request's output length. Token ids
come from the trace's block hashes, so requests that share a prefix in the trace share it here.
Per system it reports TTFT p50/p90/p99 (arrival to first token, seconds), output tokens per
second, the connector's CPU hit tokens, stores, re-stores and loads, and the worker's transfer
GB/s (bytes over copy time: device time under CUDA), with the machine.

Systems: ``none`` (GPU prefix cache only), ``kvtriton`` (``KVTritonConnector``), ``simple``
(vLLM's ``SimpleCPUOffloadConnector``, CUDA only: it uses CUDA streams). All run one after the
other in this process, each engine shut down before the next starts.

On a GPU box: ``python -m bench.bench_vllm --model /models/llama3-8b --trace mooncake
--cpu-gib 32`` (any local model folder; nothing is downloaded). Without ``--model`` it serves a
tiny random Llama on whatever the machine has, as a smoke test of the harness: on CPU the
timings mean nothing (vLLM's CPU backend, a model of 1 MB), only that every system ran and the
tier was used. Writes ``bench/results/vllm_<trace>.json``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import OneLineParser, write_result

SYSTEMS = ("none", "kvtriton", "simple")
TRACES = ("agent", "mooncake", "cc_agentic")


def _workload(name: str, limit: int | None, quick: bool):
    from kvtriton.sim import CC_AGENTIC_SAMPLE, MOONCAKE_SYNTHETIC, agent_workload, data_path
    from kvtriton.sim.traces import load_trace
    from kvtriton.sim.workloads import limit_workload

    if name == "agent":
        kw = dict(num_conversations=4, min_turns=2, max_turns=3, system_prompt_tokens=256,
                  first_user_tokens=128, user_tokens=64, output_tokens=16,
                  think_s_mean=0.2, start_window_s=0.5) if quick else {}
        wl = agent_workload(**kw)
    else:
        wl = load_trace(data_path(MOONCAKE_SYNTHETIC if name == "mooncake"
                                  else CC_AGENTIC_SAMPLE))
    return limit_workload(wl, limit) if limit else wl


def _tokens(wl, vocab: int, max_len: int) -> dict[str, tuple[list[int], int]]:
    """Per request: prompt token ids (from its block hashes, so shared prefixes stay shared)
    and output tokens, cut to fit ``max_len``."""
    b = wl.hash_block_size
    cache: dict[int, list[int]] = {}
    out = {}
    for r in wl:
        ids: list[int] = []
        for h in r.hashes[:r.prompt_len // b].tolist():
            blk = cache.get(h)
            if blk is None:
                blk = cache[h] = (np.random.default_rng(h).integers(1, vocab, b)).tolist()
            ids += blk
        tail = r.prompt_len - len(ids)
        if tail > 0:
            seed = zlib.crc32(r.request_id.encode())  # not hash(): salted per process
            ids += np.random.default_rng(seed).integers(1, vocab, tail).tolist()
        n_out = max(1, min(r.output_len, 64))
        ids = ids[:max(1, max_len - n_out - 1)]
        out[r.request_id] = (ids, n_out)
    return out


def _percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"p50": None, "p90": None, "p99": None}
    a = np.asarray(xs)
    return {f"p{q}": float(np.percentile(a, q)) for q in (50, 90, 99)}


def replay(llm: Any, wl: Any, tokens: dict, time_scale: float) -> dict[str, Any]:
    """Serve ``wl`` on ``llm``'s engine by time stamp; TTFT and throughput."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    reqs = sorted(wl, key=lambda r: r.arrival_s)
    done: dict[str, float] = {}
    start: dict[str, float] = {}
    first: dict[str, float] = {}
    out_tokens = 0
    t0 = time.perf_counter()
    waiting = list(reqs)
    while waiting or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        still = []
        for r in waiting:
            due = r.arrival_s * time_scale
            if r.after is not None:
                due = None if r.after not in done else max(due, done[r.after]
                                                           + r.think_s * time_scale)
            if due is not None and due <= now:
                ids, n_out = tokens[r.request_id]
                engine.add_request(r.request_id, TokensPrompt(prompt_token_ids=ids),
                                   SamplingParams(temperature=0, max_tokens=n_out,
                                                  ignore_eos=True, detokenize=False))
                start[r.request_id] = due
            else:
                still.append(r)
        waiting = still
        if not engine.has_unfinished_requests():
            time.sleep(0.001)
            continue
        for o in engine.step():
            t = time.perf_counter() - t0
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = t
            if o.finished:
                done[o.request_id] = t
                out_tokens += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    ttft = [first[r] - start[r] for r in first]
    return {"requests": len(done), "wall_s": wall, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall if wall else None,
            "ttft_s": _percentiles(ttft)}


def run_system(system: str, model: str, wl: Any, tokens: dict, args: Any) -> dict[str, Any]:
    import torch
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from bench.engine_run import _shutdown

    cpu_bytes = int(args.cpu_gib * 2**30)
    kv = None
    if system == "kvtriton":
        kv = KVTransferConfig(kv_connector="KVTritonConnector",
                              kv_connector_module_path="kvtriton.vllm", kv_role="kv_both",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config={"cpu_bytes_per_rank": cpu_bytes})
    elif system == "simple":
        kv = KVTransferConfig(kv_connector="SimpleCPUOffloadConnector", kv_role="kv_both",
                              kv_connector_extra_config={"cpu_bytes_to_use": cpu_bytes})
    kw: dict[str, Any] = dict(model=model, enable_prefix_caching=True,
                              max_model_len=args.max_model_len, seed=0, kv_transfer_config=kv)
    if args.tiny:
        kw.update(skip_tokenizer_init=True, enforce_eager=True, block_size=32, dtype="float32",
                  kv_cache_memory_bytes=args.kv_cache_mib << 20, max_num_batched_tokens=256)
    elif args.kv_cache_mib:
        kw["kv_cache_memory_bytes"] = args.kv_cache_mib << 20
    else:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    try:
        res = replay(llm, wl, tokens, args.time_scale)
        res["startup_s"] = startup
        conn = None
        if not int(os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1")):
            conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        if system == "kvtriton" and conn is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            st = conn.scheduler_side.planner.stats.as_dict()
            res["connector"] = {k: st[k] for k in ("cpu_hit_tokens", "blocks_stored",
                                                   "scan_restored", "blocks_loaded",
                                                   "running_evictions", "failed_transfers")}
            res["transfers"] = get_kv_transfer_group().worker_side.transfer_totals()
    finally:
        _shutdown(llm)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.bench_vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a local model folder (default: a tiny "
                    "random Llama, a smoke test)")
    ap.add_argument("--trace", choices=TRACES, default="agent")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated, from {', '.join(SYSTEMS)}")
    ap.add_argument("--cpu-gib", type=float, default=None,
                    help="CPU tier per rank, GiB (default 32 on a GPU box, 0.03 for the tiny "
                         "model)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="multiply arrival and think times by this")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--kv-cache-mib", type=int, default=None,
                    help="KV cache size, MiB (default: vLLM's gpu_memory_utilization)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--quick", action="store_true", help="a few small requests")
    ap.add_argument("--out", type=Path, default=None, help="results folder")
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        ap.error(f"--systems: unknown {bad[0]!r}; choose from {', '.join(SYSTEMS)}")
    for name in ("limit", "max_model_len", "kv_cache_mib"):
        v = getattr(args, name)
        if v is not None and v <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.time_scale <= 0 or (args.cpu_gib is not None and args.cpu_gib <= 0):
        ap.error("--time-scale and --cpu-gib must be positive")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import torch
        import vllm
    except ImportError as e:
        print(f"bench_vllm: needs vLLM ({e}); `make test` installs it", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    args.tiny = args.model is None
    if args.model is not None and not Path(args.model).is_dir():
        ap.error(f"--model {args.model!r}: not a folder (no download is attempted)")
    if args.tiny:
        from bench.engine_run import tiny_llama

        args.model = str(tiny_llama(Path(tempfile.gettempdir()) / "kvtriton-tiny-llama"))
        # 1 MiB of fp32 KV holds 992 tokens: the quick agent turns do not all fit, so later
        # turns find their prefix in the CPU tier.
        args.max_model_len = args.max_model_len or 960
        args.kv_cache_mib = args.kv_cache_mib or 1
        args.cpu_gib = args.cpu_gib or 0.03
        vocab = 1000
    else:
        args.max_model_len = args.max_model_len or 32768
        args.cpu_gib = args.cpu_gib or 32.0
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
    wl = _workload(args.trace, args.limit or (12 if args.quick else None), args.quick)
    tokens = _tokens(wl, vocab, args.max_model_len)
    note = None if cuda else ("CPU only: vLLM's CPU backend and a tiny random model; the "
                              "timings mean nothing, the run shows every system works")
    print(f"bench_vllm: {args.trace} ({len(wl)} requests), model {args.model}, "
          f"{'CUDA ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA'}, vLLM "
          f"{vllm.__version__}" + (f"; {note}" if note else ""), flush=True)
    rows = []
    for system in systems:
        if system == "simple" and not cuda:
            rows.append({"system": system, "skipped": "SimpleCPUOffloadConnector needs CUDA "
                                                      "(it uses CUDA streams)"})
            print(f"  {system:9s} skipped: needs CUDA", flush=True)
            continue
        res = run_system(system, args.model, wl, tokens, args)
        res["system"] = system
        rows.append(res)
        t = res["ttft_s"]
        extra = ""
        if "connector" in res:
            c, tr = res["connector"], res["transfers"]
            gbs = {k: v["gb_per_s"] for k, v in tr.items()}
            extra = (f", CPU hit {c['cpu_hit_tokens']:,} tok, stored {c['blocks_stored']:,}, "
                     f"re-stored {c['scan_restored']:,}, loaded {c['blocks_loaded']:,} blocks, "
                     f"GB/s {gbs}")
        print(f"  {system:9s} TTFT p50/p90/p99 {t['p50']:.3f}/{t['p90']:.3f}/{t['p99']:.3f} s, "
              f"{res['output_tokens_per_s']:.1f} tok/s, {res['requests']} requests{extra}",
              flush=True)
    doc = {"conditions": {"trace": args.trace, "requests": len(wl), "model": args.model,
                          "tiny_model": args.tiny, "cpu_gib": args.cpu_gib,
                          "time_scale": args.time_scale, "max_model_len": args.max_model_len,
                          "kv_cache_mib": args.kv_cache_mib, "vllm": vllm.__version__,
                          "note": note},
           "rows": rows}
    path = write_result(f"vllm_{args.trace}", doc, args.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
