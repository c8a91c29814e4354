"""Hit rate, recompute and modeled TTFT versus CPU capacity, per setup.

Two parts, each written to ``bench/results/``:

- ``sim_<workload>.json``: the serving-loop simulation (``kvtriton.simulate``) at several CPU
  capacities, every setup at each, plus the Belady cache-only bound at the same total capacity;
  its figure (``.png``) is the largest capacity's hit rates and TTFT distribution;
- ``replay_<workload>.json``: the cache-only capacity sweep (LRU, ARC, S3-FIFO, Belady), the
  setting of the Mooncake paper's capacity curve, with its figure (``.png``);
- ``sim_mooncake.json`` (``--mooncake``, and in the full harness): the whole shipped Mooncake
  trace through the serving loop with every setup.

Run: ``python -m bench.tier_study.capacity [--quick] [--mooncake]``.
"""

from __future__ import annotations

import argparse
import time

from bench.common import record_output, write_result
from kvtriton.setups import DEFAULT_SETUPS
from kvtriton.sim import (
    CC_AGENTIC_SAMPLE,
    MOONCAKE_SYNTHETIC,
    agent_workload,
    capacity_sweep,
    data_path,
    load_trace,
    simulate,
)
from kvtriton.sim.progress import Progress
from kvtriton.sim.workloads import WORKLOADS, load_workload, serving_workload


def agent(quick: bool):
    if quick:
        return load_workload("agent")  # the registry's default agent setting
    return agent_workload(num_conversations=64, min_turns=10, max_turns=50, seed=0)


def sim_sweep(workload, cpu_tokens: list[int], gpu_tokens: int, setups, tag: str,
              progress: bool = True, **kw) -> dict:
    """``simulate`` at each CPU capacity; rows carry their capacity."""
    runs = []
    t0 = time.perf_counter()
    for cap in cpu_tokens:
        res = simulate(workload, gpu_tokens=gpu_tokens, cpu_tokens=cap, setups=setups,
                       progress=progress, **kw)
        for row in res.rows:
            row["cpu_tokens"] = cap
        runs.append({"cpu_tokens": cap, "conditions": res.conditions, "rows": res.rows,
                     "bound": res.bound})
        print(f"\n{tag}: CPU {cap:,} tokens, GPU {gpu_tokens:,} tokens")
        print(res.table())
        if res.bound:
            print(f"bound: {res.bound['setup']}: {res.bound['hit_rate']:.1%}")
    payload = {"workload": workload.name, "requests": len(workload),
               "gpu_tokens": gpu_tokens, "cpu_tokens": cpu_tokens, "setups": list(setups),
               "runs": runs, "wall_s": time.perf_counter() - t0}
    path = write_result(f"sim_{tag}", payload)
    from kvtriton.plots import plot_simulation

    fig = record_output(plot_simulation(runs[-1], path.with_suffix(".png")))
    print(f"wrote {path} and {fig}")
    return payload


# The replays' workloads in the paper's words, and the capacity its Mooncake comparison reads
# (the Mooncake paper's 3M-token LRU figure).
REPLAY_LABELS = {"mooncake": "Mooncake synthetic trace", "agent": "agent generator",
                 "cc_agentic": "coding-agent traces"}
COMPARED_TOKENS = 3_000_000


def findings(name: str, doc: dict) -> dict | None:
    """A replay's label and, where it ran at ``COMPARED_TOKENS``, LRU's and Belady's hit rate
    there and LRU's share of the infinite cache's."""
    if not name.startswith("replay_"):
        return None
    tag = name.removeprefix("replay_")
    s = doc["sweep"]
    out = {"label": REPLAY_LABELS.get(tag, tag), "compared": None}
    if COMPARED_TOKENS in s["capacities_tokens"]:
        i = s["capacities_tokens"].index(COMPARED_TOKENS)
        lru = s["hit_rate"]["lru"][i]
        out["compared"] = {"tokens": COMPARED_TOKENS, "lru": lru,
                           "belady": s["hit_rate"]["belady"][i],
                           "lru_share_of_max": lru / s["max_hit_rate"]}
    return out


def replay_sweep(workload, tag: str, capacities=None, progress: bool = True) -> dict:
    bar = Progress(f"replay {tag}", enabled=progress)
    n = [0]

    def tick(_r):
        n[0] += 1
        bar(n[0], 4 * (len(capacities) if capacities else 6))

    t0 = time.perf_counter()
    res = capacity_sweep(workload, capacities, progress=tick)
    print(f"\n{tag}: cache-only replay, {res.requests} requests, {res.hash_block_size}-token "
          "blocks")
    print(res.table())
    payload = {"sweep": res.to_dict(), "wall_s": time.perf_counter() - t0}
    path = write_result(f"replay_{tag}", payload, findings=findings)
    from kvtriton.plots import plot_sweep

    fig = record_output(plot_sweep(payload["sweep"], path.with_suffix(".png")))
    print(f"wrote {path} and {fig}")
    return payload


def mooncake_sim(progress: bool = True) -> dict:
    """Every setup over the whole Mooncake synthetic trace; writes ``sim_mooncake.json``."""
    wl, capacities = serving_workload("mooncake")
    t0 = time.perf_counter()
    res = simulate(wl, setups=DEFAULT_SETUPS, progress=progress, **capacities)
    wall = time.perf_counter() - t0
    print(f"\nmooncake: {len(wl)} requests, every setup, {wall:.0f}s wall")
    print(res.table())
    if res.bound:
        print(f"bound: {res.bound['setup']}: {res.bound['hit_rate']:.1%}")
    payload = {"workload": wl.name, "requests": len(wl),
               "settings": dict(WORKLOADS["mooncake"].serving), **res.to_dict(),
               "wall_s": wall}
    print(f"wrote {write_result('sim_mooncake', payload)}")
    return payload


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small agent workload, fewer sizes")
    ap.add_argument("--mooncake", action="store_true",
                    help="also simulate the whole Mooncake trace with every setup (minutes)")
    ap.add_argument("--sweep", action="store_true",
                    help="also the preset sweep versus CPU capacity when --quick")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    progress = not args.quiet
    out = {}
    if args.mooncake:
        out["sim_mooncake"] = mooncake_sim(progress)
    wl = agent(args.quick)
    if args.sweep or not args.quick:
        # The default setups versus CPU capacity; the quick harness runs bench_setups instead.
        gpu = 32_768 if args.quick else 131_072
        cpu = [gpu, 2 * gpu, 4 * gpu] if args.quick else [gpu, 2 * gpu, 4 * gpu, 8 * gpu]
        out["sim_agent"] = sim_sweep(wl, cpu, gpu, DEFAULT_SETUPS, "agent", progress)
    mooncake = load_trace(data_path(MOONCAKE_SYNTHETIC))
    out["replay_mooncake"] = replay_sweep(
        mooncake, "mooncake", [1_000_000, 2_000_000, 3_000_000, 6_000_000, 12_000_000,
                               24_000_000], progress)
    out["replay_agent"] = replay_sweep(wl, "agent", None, progress)
    if not args.quick:
        cc = load_trace(data_path(CC_AGENTIC_SAMPLE))
        out["replay_cc_agentic"] = replay_sweep(cc, "cc_agentic", None, progress)
    return out


if __name__ == "__main__":
    main()
