"""``python -m bench --only second_tier``: the second tier's figures in one run on one machine
(``bench.second_tier.throughput`` and ``bench.second_tier.replicas`` say what each measures),
written to ``bench/results/second_tier.json`` with the targets of issue 38, met or missed:

- the tier's own transfers reach at least 80% of the raw client's batched GB/s for the same
  blocks (put and fetch each);
- the connector's scheduler-side seconds per step with the tier on are at most 1.1x those
  with it off;
- replica B's hit rate on prefixes only A computed is within 1 point of one replica serving
  both.

A ``mooncake_master`` and a store host (a client of this process contributing 1 GiB) run on
loopback for the run and stop with it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.common import RESULTS_DIR, OneLineParser, write_result

TARGETS = {"transfer_share": 0.8, "step_cost_ratio": 1.1, "hit_rate_gap_points": 1.0}


def findings(name: str, doc: dict) -> dict:
    """Each target's figure and verdict, and the B-phase time gain of the store."""
    tier, rep = doc["tier"], doc["replicas"]
    share = min(tier["put_share"], tier["fetch_share"])
    gap = abs(rep["hit_rate_gap_points"])
    ratio = rep["step_cost"]["ratio"]
    b = {k: rep[k]["b"] for k in ("one_replica", "shared_store", "no_store")}
    return {
        "transfer_share": {"value": share, "target": TARGETS["transfer_share"],
                           "met": share >= TARGETS["transfer_share"]},
        "step_cost_ratio": {"value": ratio, "target": TARGETS["step_cost_ratio"],
                            "met": ratio <= TARGETS["step_cost_ratio"]},
        "hit_rate_gap_points": {"value": gap, "target": TARGETS["hit_rate_gap_points"],
                                "met": gap <= TARGETS["hit_rate_gap_points"]},
        "b_hit_rate": {k: v["hit_rate"] for k, v in b.items()},
        "b_seconds": {k: v["seconds"] for k, v in b.items()},
        "b_speedup_vs_no_store": b["no_store"]["seconds"] / b["shared_store"]["seconds"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m bench.second_tier.study", description=__doc__)
    p.add_argument("--results", type=Path, default=RESULTS_DIR)
    p.add_argument("--repeats", type=int, default=9, help="timed repeats, the best kept")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from bench.second_tier import replicas, throughput
    from bench.vllm.engine_workloads import bench_model
    from kvtriton.second_tier.local_master import join, mooncake_master

    with mooncake_master() as master:
        host = join(master, segment_bytes=1 << 30, buffer_bytes=16 << 20)
        try:
            print("second_tier: raw put/get beside memcpy", file=sys.stderr)
            raw = throughput.raw_rows(master, 64 << 20, args.repeats)
            print("second_tier: the tier's transfers beside the raw client", file=sys.stderr)
            tier = throughput.tier_rows(master, 32, 2 << 20, args.repeats)
            print("second_tier: two replicas and a shared store in vLLM", file=sys.stderr)
            model, vocab, per_block, dtype = bench_model()
            reps = replicas.run(model, vocab, per_block, dtype, master)
        finally:
            host.close()
    payload = {"conditions": {
        "store": "mooncake_master and one store host (1 GiB), loopback TCP, this machine",
        "throughput": "best of --repeats timed calls; memcpy is torch copy_ of the same bytes",
        "engine": "vLLM CPU engine in this process; the cc_agentic sample at the engine "
                  "benchmark's quick size, one output token per request",
        "repeats": args.repeats},
        "targets": TARGETS, "raw": raw, "tier": tier, "replicas": reps}
    path = write_result("second_tier", payload, args.results, findings)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
