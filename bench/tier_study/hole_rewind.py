"""Whether to close the allocation hole: the simulator's hit rates with and without a fix.

The hole: a step's scan passes positions whose blocks the CPU tier holds (cached), then the same
step's allocation of CPU blocks evicts some of them; the cursor is past them, so without
re-store they are never stored again for that request (vLLM's manager, which allocates per
request inside its scan, lags instead and stores some of them later). The fix tried here keeps
the cursor at the first position the step passed as cached whose block the step's own
allocation evicted, so the next steps store it.

Each workload runs through the simulator's serving loop with the setups below, once as shipped
and once with the fix applied (patched into the fused selector's pass); a row gives both hit
rates, recomputed tokens and the chain holes lookups met.

Run: ``python -m bench.tier_study.hole_rewind [--limit N] [--json out.json]``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

#: Setups without re-store (with it, an evicted block of a running request is stored again).
SETUPS = ("eager", "eager+arc", "eager+tail")
WORKLOADS = ("agent", "cc_agentic", "mooncake")


@contextlib.contextmanager
def rewind() -> Iterator[None]:
    """The fix, applied to the fused selector while open."""
    from kvtriton.planner.scan import FusedSelector
    from kvtriton.planner.stores import Stores

    select = Stores.select

    def select_and_rewind(self, step, job, requests):
        sel = self._selector
        if not isinstance(sel, FusedSelector):
            return select(self, step, job, requests)
        rows = [st.row for st in self._states.values() if st.admitted and not st.finished]
        before_cursor = sel._cursor[:, rows].copy()
        in_cpu = sel._in_cpu.copy()
        select(self, step, job, requests)  # the scan, then the step's CPU allocation
        now = sel._in_cpu
        evicted = in_cpu & ~now[:len(in_cpu)]
        if not evicted.any():
            return
        for g in range(sel._num_groups):
            for i, row in enumerate(rows):
                lo, hi = int(before_cursor[g, i]), int(sel._cursor[g, row])
                if hi <= lo:
                    continue
                keys = sel._table_keys[g, row, lo:hi]
                hit = np.flatnonzero((keys >= 0) & (keys < len(evicted))
                                     & evicted[np.clip(keys, 0, len(evicted) - 1)])
                if len(hit):
                    sel._cursor[g, row] = lo + int(hit[0])

    Stores.select = select_and_rewind
    try:
        yield
    finally:
        Stores.select = select


def compare(workload: str, limit: int | None) -> list[dict]:
    from kvtriton.sim import simulate
    from kvtriton.sim.workloads import limit_workload, serving_workload

    wl, caps = serving_workload(workload)
    if limit is not None:
        wl = limit_workload(wl, limit)
    rows = []
    runs = {}
    for fixed in (False, True):
        with rewind() if fixed else contextlib.nullcontext():
            res = simulate(wl, setups=SETUPS, bound=False, references=(), **caps)
        runs[fixed] = {r["setup"]: r for r in res.rows}
    for setup in SETUPS:
        a, b = runs[False][setup], runs[True][setup]
        rows.append({
            "workload": wl.name, "setup": setup,
            "hit_rate": a["token_hit_rate"], "hit_rate_fixed": b["token_hit_rate"],
            "hit_rate_points": round(100 * (b["token_hit_rate"] - a["token_hit_rate"]), 3),
            "recomputed": a["recomputed_tokens"], "recomputed_fixed": b["recomputed_tokens"],
            "stored_blocks": a["stored_blocks"], "stored_blocks_fixed": b["stored_blocks"],
            "chain_holes": a.get("chain_holes"), "chain_holes_fixed": b.get("chain_holes"),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    from bench.common import OneLineParser, write_result

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N requests per workload")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--json", default="bench/results/hole_rewind.json")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for w in args.workloads:
        for r in compare(w, args.limit):
            rows.append(r)
            print(f"{r['workload']:24s} {r['setup']:12s} hit {r['hit_rate']:.4f} -> "
                  f"{r['hit_rate_fixed']:.4f} ({r['hit_rate_points']:+.3f} points), recomputed "
                  f"{r['recomputed']} -> {r['recomputed_fixed']}", flush=True)
    path = Path(args.json)
    write_result(path.stem, {"setups": list(SETUPS), "limit": args.limit, "rows": rows,
                             "elapsed_s": round(time.perf_counter() - t0, 1)}, path.parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
