"""Soak through the vLLM connector: memory stays flat while distinct blocks grow without bound.

vLLM's real ``Scheduler`` with ``KVTritonConnector`` serves a stream of requests that are almost
all new content (``bench.conformance.connector_soak_run``; no model runs, transfers report one step
later), first with key-id recycling (the connector's default), then with it off as the control.
Every ``--sample`` finished requests it records the key ids bound and their capacity, the planner's
per-key slots and the process RSS. The run sees ``--requests`` requests, over ten times more
distinct blocks than the GPU and CPU pools hold together at the default sizes. Writes
``bench/results/vllm_soak.json`` and ``vllm_soak.png``.

Run: ``python -m bench.conformance.connector_soak [--requests 6000] [--sample 250] [--quick]``
(needs vLLM: ``make test`` installs it into ``.venv``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from bench.common import RESULTS_DIR, OneLineParser, record_output, write_result

GPU_BLOCKS, CPU_BLOCKS = 256, 512


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.conformance.connector_soak",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=_positive, default=6000)
    ap.add_argument("--sample", type=_positive, default=250, help="requests between samples")
    ap.add_argument("--quick", action="store_true", help="1,500 requests")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from bench.conformance.connector_soak_run import ConnectorSoak
        from kvtriton.sim.vllm_scheduler import tiny_model_dir
    except ImportError as e:
        print(f"bench_connector_soak: needs vLLM ({e}); `make test` installs it", file=sys.stderr)
        return 2
    n = 1500 if args.quick else args.requests
    model_dir = tiny_model_dir(tempfile.mkdtemp(prefix="kvtriton-soak-"), 8192)
    runs = []
    for recycle in (True, False):
        soak = ConnectorSoak(model_dir, gpu_blocks=GPU_BLOCKS, cpu_blocks=CPU_BLOCKS,
                             concurrency=16, recycle=recycle)
        t0 = time.perf_counter()

        def show(s, tag="recycling" if recycle else "control"):
            print(f"  {tag:>9}: {s.requests_done:6d} requests, {s.distinct_blocks:7d} distinct "
                  f"blocks, {s.key_ids_bound:6d} ids bound (capacity {s.key_id_capacity}), "
                  f"planner slots {s.planner_key_slots}, RSS {s.rss_mib:.1f} MiB", flush=True)

        samples = soak.run(n, args.sample, on_sample=show)
        wall = time.perf_counter() - t0
        soak.side.planner.check_invariants(idle=True)
        runs.append({"recycle": recycle, "wall_s": round(wall, 2), "steps": soak.driver.step_no,
                     "samples": [s.as_dict() for s in samples]})
    on = runs[0]["samples"]
    warm = on[len(on) // 4]
    last = on[-1]
    summary = {
        "distinct_blocks": last["distinct_blocks"],
        "pool_blocks": GPU_BLOCKS + CPU_BLOCKS,
        "distinct_over_pools": round(last["distinct_blocks"] / (GPU_BLOCKS + CPU_BLOCKS), 1),
        "recycling": {k: (warm[k], last[k]) for k in
                      ("key_ids_bound", "key_id_capacity", "planner_key_slots", "rss_mib")},
        "control": {k: (runs[1]["samples"][len(on) // 4][k], runs[1]["samples"][-1][k])
                    for k in ("key_ids_bound", "key_id_capacity", "planner_key_slots",
                              "rss_mib")},
    }
    doc = {"conditions": {"gpu_blocks": GPU_BLOCKS, "cpu_blocks": CPU_BLOCKS,
                          "block_size": 16, "concurrency": 16, "requests": n,
                          "prompt_blocks": 8, "shared_blocks": 2, "output_blocks": 2,
                          "repeat_every": 5, "restore": True,
                          "note": "vLLM's real Scheduler, no model; reports one step late; "
                                  "recycling run first, then the control, in one process"},
           "summary": summary, "runs": runs}
    path = write_result("vllm_soak", doc)
    from bench.plots import plot_connector_soak

    fig = record_output(plot_connector_soak(doc, RESULTS_DIR / "vllm_soak.png"))
    print(f"quarter-way -> end, recycling: {summary['recycling']}")
    print(f"quarter-way -> end, control:   {summary['control']}")
    print(f"wrote {path} and {fig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
