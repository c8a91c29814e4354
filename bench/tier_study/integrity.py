"""What integrity mode costs: each case simulated plain and with ``integrity=True`` (real bytes
through the ``TransferEngine``, every block checked), one after the other, same arguments.

Cases: the README's ``--integrity`` example, the Mooncake trace's first 200 requests at its
serving setting, the coding-agent traces' first 3 requests on a sliding-window model
(gemma3-12b, three setups), and a hybrid Mamba model (nemotron-h-8b) on the agent generator.
Times are wall seconds of the ``simulate`` call (imports and start-up excluded); the target is
at most 3x the plain run. Writes ``bench/results/integrity.json``.

Run: ``python -m bench.tier_study.integrity [--cases NAME,...]``.
"""

from __future__ import annotations

import sys
import time

from bench.common import OneLineParser, write_result
from kvtriton.sim import simulate
from kvtriton.sim.workload import AgentConfig
from kvtriton.sim.workloads import load_workload, serving_workload

TARGET_RATIO = 3.0

#: name -> (workload loader, simulate keyword arguments).
CASES = {
    # kvtriton simulate --workload mooncake --block-size 64 --limit 100 --integrity
    "readme": (lambda: load_workload("mooncake", block_size=64, limit=100), {}),
    "mooncake_200": (lambda: serving_workload("mooncake", limit=200)[0],
                     {"gpu_gib": 32.0, "cpu_gib": 256.0,
                      "setups": ["eager", "eager+restore:0.5+tail", "lazy"]}),
    # kvtriton simulate --workload cc_agentic --limit 3 --model gemma3-12b --integrity
    #     --setups eager,eager+restore:0.5+tail,lazy  (16-token blocks, default sizes, bounds)
    "cc_agentic_3_gemma": (lambda: load_workload("cc_agentic", block_size=16, limit=3),
                           {"model": "gemma3-12b",
                            "setups": ["eager", "eager+restore:0.5+tail", "lazy"]}),
    "agent_nemotron_h": (lambda: load_workload("agent", agent=AgentConfig(
        num_conversations=8, min_turns=3, max_turns=6, seed=0)),
                         {"model": "nemotron-h-8b", "gpu_tokens": 16_384, "cpu_tokens": 65_536,
                          "setups": ["eager", "eager+restore:0.5+tail", "lazy"],
                          "bound": False}),
}


def measure(name: str) -> dict:
    """One case plain, then with integrity: wall seconds of each and their ratio."""
    make, kw = CASES[name]
    wl = make()
    t0 = time.perf_counter()
    plain = simulate(wl, **kw)
    t1 = time.perf_counter()
    checked = simulate(wl, integrity=True, **kw)
    t2 = time.perf_counter()
    plain_s, checked_s = t1 - t0, t2 - t1
    return {"case": name, "workload": wl.name, "requests": len(wl), "simulate_kwargs": kw,
            "plain_s": plain_s, "integrity_s": checked_s, "ratio": checked_s / plain_s,
            "met": checked_s / plain_s <= TARGET_RATIO,
            "blocks_checked": sum(r["integrity_blocks_checked"] for r in checked.rows),
            "registrations_checked": sum(r["integrity_registrations_checked"]
                                         for r in checked.rows),
            "same_hit_rates": [r["token_hit_rate"] for r in plain.rows]
            == [r["token_hit_rate"] for r in checked.rows]}


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.tier_study.integrity",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, from: {', '.join(CASES)}")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    bad = [c for c in names if c not in CASES]
    if bad or not names:
        ap.error(f"--cases {args.cases!r}: unknown {bad[0] if bad else 'empty list'}; "
                 f"known: {', '.join(CASES)}")
    rows = []
    for name in names:
        r = measure(name)
        rows.append(r)
        print(f"  {name:20s} plain {r['plain_s']:7.1f} s  integrity {r['integrity_s']:7.1f} s  "
              f"{r['ratio']:5.2f}x  (target <= {TARGET_RATIO:g}x: "
              f"{'met' if r['met'] else 'missed'})", flush=True)
    path = write_result("integrity", {"target_ratio": TARGET_RATIO, "rows": rows})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
