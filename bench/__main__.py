"""The benchmark harness: ``python -m bench`` (``make bench``).

Runs, on whatever this machine has: the kernel correctness check (Triton interpreter without
CUDA), the kernel bandwidth benchmark (CUDA only), the planner scaling benchmark, the cache-only
replays of the shipped traces (plus, with ``--full``, hit rate / TTFT versus CPU capacity per
preset), and the tier-design study: the policy ablation against the in-loop bounds on the agent
generator and the shipped traces, and the re-store map (``bench.bench_policies``). Every part
writes JSON with the machine's description to ``bench/results/``; figures go to
``bench/results/*.png``. ``--quick`` (the default without CUDA) stays under 10 minutes on 2
cores; ``--full`` is the size for a GPU box: the whole traces through every setup, the preset
sweeps, the whole-trace Mooncake simulation and the 100,000-step soak.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from bench import bench_planner, bench_sim, kernel_check
from bench.common import RESULTS_DIR


def _figures() -> list[str]:
    import json

    from kvtriton.plots import plot_simulation, plot_sweep

    out = []
    sim = RESULTS_DIR / "sim_agent.json"
    if sim.exists():
        doc = json.loads(sim.read_text())
        run = doc["runs"][-1]
        out.append(str(plot_simulation(run, RESULTS_DIR / "sim_agent.png")))
    for tag in ("mooncake", "agent", "cc_agentic"):
        p = RESULTS_DIR / f"replay_{tag}.json"
        if p.exists():
            sweep = json.loads(p.read_text())["sweep"]
            out.append(str(plot_sweep(sweep, RESULTS_DIR / f"replay_{tag}.png")))
    return out


def _micro() -> None:
    import pytest

    out = RESULTS_DIR / "micro.json"
    rc = pytest.main([str(Path(__file__).with_name("micro.py")), "-q",
                      "-p", "no:cacheprovider", f"--benchmark-json={out}",
                      "--benchmark-columns=min,median,max,rounds"])
    if rc != 0:
        raise SystemExit(f"micro-benchmarks failed (pytest exit code {rc})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CPU-sized (default without CUDA)")
    size.add_argument("--full", action="store_true", help="GPU-box size (default with CUDA)")
    ap.add_argument("--only", choices=("kernels", "planner", "sim", "policies", "soak"),
                    default=None)
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    quick = args.quick or (not args.full and not cuda)
    t0 = time.perf_counter()
    print(f"kvtriton benchmark harness ({'quick' if quick else 'full'} size, "
          f"{'CUDA: ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA device'})")
    if args.only in (None, "kernels"):
        print("\n== kernel correctness ==")
        kernel_check.main()
        print("\n== kernel bandwidth ==")
        if cuda:
            from bench import bench_kernels

            bench_kernels.main(["--quick"] if quick else [])
        else:
            print("  skipped: no CUDA device on this machine (GB/s needs a GPU)")
    if args.only in (None, "planner"):
        print("\n== planner scaling ==")
        bench_planner.main(["--quick"] if quick else [])
        print("\n== micro-benchmarks (pytest-benchmark) ==")
        _micro()
    if args.only in (None, "sim"):
        print("\n== simulation: hit rate, recompute, TTFT vs CPU capacity ==")
        bench_sim.main((["--quick"] if quick else ["--mooncake"])
                       + (["--quiet"] if args.quiet else []))
    if args.only in (None, "policies"):
        print("\n== tier designs: the policy ablation, in-loop bounds, the re-store map ==")
        from bench import bench_policies

        bench_policies.main((["--full"] if not quick else []) + (["--quiet"] if args.quiet
                                                                  else []))
    if args.only == "soak" or (args.only is None and not quick):
        print("\n== soak: 100,000 steps, memory and pool counts ==")
        from bench import bench_soak

        bench_soak.main([])
    figs = _figures()
    print(f"\nresults (JSON) in {RESULTS_DIR}/")
    for f in figs:
        print(f"figure: {f}")
    print(f"harness finished in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
