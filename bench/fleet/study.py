"""``python -m bench --only fleet``: which combination of per-replica CPU tier, shared store and
router wins across a fleet of 1, 2, 4 and 8 replicas, on the coding-agent traces, the Mooncake
trace and the agent generator (``bench.fleet.cells`` says what a cell runs and holds fixed).

Per workload and fleet size the combination is chosen on the *train* part (the highest hit rate
among those whose TTFT p90 is no worse than the control's on train; the control if none;
``bench.choice.choose_on_train``) and
reported on the *test* part, beside the control (``eager``, round-robin, no store) and the
references. The target of issue 39: at N = 4, on the coding-agent traces' test part, the chosen
combination recovers at least half of the hit rate that splitting one replica's traffic over
four loses against one replica with four times the memory (``pooled``), with a TTFT p90 no
worse than round-robin's (the control's).

Cells run on local processes, or on a Ray cluster with ``--ray ADDRESS`` (``--ray local``
starts one here). Writes ``bench/results/fleet.json``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.choice import choose_on_train, figures
from bench.common import RESULTS_DIR, OneLineParser, write_result
from bench.fleet.cells import Cell
from bench.fleet.executors import run_cells
from kvtriton.sim.splits import TEST, TRAIN

WORKLOADS = ("cc_agentic", "mooncake", "agent")
FLEET_SIZES = (1, 2, 4, 8)
#: Per-replica CPU tiers tried (the connector's default; --tiers adds others).
TIERS = ("eager",)
ROUTERS = ("round_robin", "least_loaded", "session", "prefix")
CONTROL = ("eager", "round_robin")
#: The quick size's requests per workload (None: all); the full size runs every request.
QUICK_LIMITS: dict[str, int | None] = {"cc_agentic": None, "mooncake": 1500, "agent": None}
TARGET_SHARE = 0.5
TARGET_WORKLOAD, TARGET_N = "cc_agentic", 4


def combinations(n: int, tiers: Sequence[str] = TIERS) -> list[tuple[str, str]]:
    """(setup, router) of every combination at fleet size ``n`` (one router at N = 1)."""
    routers = ROUTERS if n > 1 else ("round_robin",)
    return [(tier + ("+shared" if store else ""), router)
            for tier in tiers for store in (False, True) for router in routers]


def cells(workloads: Sequence[str], sizes: Sequence[int], limits: dict[str, int | None],
          tiers: Sequence[str] = TIERS) -> list[Cell]:
    out = []
    for w in workloads:
        for n in sizes:
            lim = limits.get(w)
            out += [Cell(w, n, s, r, limit=lim) for s, r in combinations(n, tiers)]
            out += [Cell(w, n, "eager", "round_robin", "pooled", lim),
                    Cell(w, n, "eager", "round_robin", "unbounded", lim),
                    Cell(w, n, "eager+nextuse", "round_robin", "nextuse", lim)]
    return out


def choose(rows: list[dict]) -> dict:
    """The combination chosen on train among ``rows`` (one workload, one fleet size, kind
    ``fleet``): the highest train hit rate whose train TTFT p90 is at most the control's."""
    control = next(r for r in rows if (r["cell"]["setup"], r["cell"]["router"]) == CONTROL)
    limit = figures(control, TRAIN)["ttft_p90_s"]
    return choose_on_train(rows, lambda f: (f["token_hit_rate"], -f["ttft_p90_s"]),
                           lambda f: f["ttft_p90_s"] <= limit) or control


def _label(r: dict) -> str:
    c = r["cell"]
    return c["kind"] if c["kind"] != "fleet" else f"{c['setup']} / {c['router']}"


def findings(name: str, doc: dict) -> dict[str, Any]:
    """The choice per workload and fleet size, the target's verdict and each combination's
    figures by N, from the cells ``doc`` holds (``summarize``)."""
    return summarize(doc["cells"])


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per workload and fleet size (``table``): the choice on train and its test figures beside
    the control and the references; the target's verdict (``recovered_share``); each
    combination's test figures by N (``scaling``)."""
    table: dict[str, dict[str, Any]] = {}
    scaling: dict[str, dict[str, dict[str, list]]] = {}
    for w in dict.fromkeys(r["cell"]["workload"] for r in rows):
        table[w] = {}
        scaling[w] = {}
        for n in sorted({r["cell"]["replicas"] for r in rows if r["cell"]["workload"] == w}):
            here = [r for r in rows if r["cell"]["workload"] == w and r["cell"]["replicas"] == n]
            fleet = [r for r in here if r["cell"]["kind"] == "fleet"]
            refs = {r["cell"]["kind"]: r for r in here if r["cell"]["kind"] != "fleet"}
            control = next(r for r in fleet if (r["cell"]["setup"], r["cell"]["router"])
                           == CONTROL)
            best = choose(fleet)
            test = {name: _reported(figures(r, TEST), r)
                    for name, r in (("chosen", best), ("control", control), *refs.items())}
            loss = test["pooled"]["hit_rate"] - test["control"]["hit_rate"]
            gained = test["chosen"]["hit_rate"] - test["control"]["hit_rate"]
            on_test = max(fleet, key=lambda r: figures(r, TEST)["token_hit_rate"])
            table[w][str(n)] = {
                "chosen": _label(best), "test": test,
                # What did not hold on test: the combination best there, and by how much.
                "best_on_test": _label(on_test),
                "best_on_test_points": 100 * (figures(on_test, TEST)["token_hit_rate"]
                                              - test["chosen"]["hit_rate"]),
                "control_prefix_left_elsewhere": control.get("prefix_left_elsewhere"),
                "train_hit_rate": figures(best, TRAIN)["token_hit_rate"],
                "split_loss_points": 100 * loss, "recovered_points": 100 * gained,
                "recovered_share": gained / loss if loss > 0 else None,
                "ttft_p90_no_worse": test["chosen"]["ttft_p90_s"]
                <= test["control"]["ttft_p90_s"]}
            for r in here:
                s = scaling[w].setdefault(_label(r), {"replicas": [], "hit_rate": [],
                                                      "ttft_p90_s": []})
                s["replicas"].append(n)
                s["hit_rate"].append(figures(r, TEST)["token_hit_rate"])
                s["ttft_p90_s"].append(figures(r, TEST)["ttft_p90_s"])
    target = table.get(TARGET_WORKLOAD, {}).get(str(TARGET_N))
    out: dict[str, Any] = {"table": table, "scaling": scaling}
    if target is not None:
        share = target["recovered_share"]
        out["recovered_share"] = {
            "value": share, "target": TARGET_SHARE, "workload": TARGET_WORKLOAD,
            "replicas": TARGET_N, "chosen": target["chosen"],
            "ttft_p90_no_worse": target["ttft_p90_no_worse"],
            "met": share is not None and share >= TARGET_SHARE
            and target["ttft_p90_no_worse"]}
    return out


def _reported(part: dict, row: dict) -> dict[str, Any]:
    mem = row.get("memory_blocks", {})
    return {"hit_rate": part["token_hit_rate"],
            "memory_blocks": sum(mem.values()), "ttft_p50_s": part["ttft_p50_s"],
            "ttft_p90_s": part["ttft_p90_s"], "queue_delay_p50_s": part["queue_delay_p50_s"],
            "busiest_queue_delay_ratio": row.get("busiest_queue_delay_ratio"),
            "bytes_host": sum(row.get("replica_bytes_host", [])),
            "bytes_store": sum((row.get("store") or {}).get(k, 0)
                               for k in ("bytes_put", "bytes_fetched"))}


def main(argv: Sequence[str] | None = None) -> int:
    p = OneLineParser(prog="python -m bench.fleet.study", description=__doc__)
    p.add_argument("--full", action="store_true", help="every request of every workload")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--replicas", nargs="+", type=int, default=list(FLEET_SIZES))
    p.add_argument("--tiers", nargs="+", default=list(TIERS),
                   help="per-replica CPU tier setups to combine (compositions, no 'shared')")
    p.add_argument("--limit", type=int, default=None,
                   help="the first requests of every workload (overrides the size's)")
    p.add_argument("--ray", default=None, metavar="ADDRESS",
                   help="run the cells on this Ray cluster ('local': one started here)")
    p.add_argument("--jobs", type=int, default=None, help="local processes (default: CPUs)")
    p.add_argument("--json", type=Path, default=RESULTS_DIR / "fleet.json")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.replicas):
        p.error(f"--replicas must be positive, got {args.replicas}")
    limits = {w: args.limit for w in WORKLOADS} if args.limit is not None else \
        ({w: None for w in WORKLOADS} if args.full else dict(QUICK_LIMITS))
    from kvtriton.setups import tier_setup

    for t in args.tiers:
        try:
            if tier_setup(t).second_tier:
                p.error(f"--tiers {t!r}: the shared store is a combination axis of its own")
        except ValueError as e:
            p.error(f"--tiers: {e}")
    todo = cells(args.workloads, sorted(set(args.replicas)), limits, args.tiers)
    print(f"fleet: {len(todo)} simulations", file=sys.stderr)
    rows = run_cells(todo, ray_address=args.ray, jobs=args.jobs, quiet=args.quiet)
    wall = {r["cell"]["workload"] + "/" + _label(r) + f"/N={r['cell']['replicas']}":
            r.pop("wall_s") for r in rows}
    doc = {"conditions": {
        "size": "full" if args.full else "quick", "limits": limits,
        "workloads": args.workloads, "replicas": sorted(set(args.replicas)),
        "tiers": list(args.tiers), "routers": list(ROUTERS), "control": list(CONTROL),
        "load": "per replica fixed: the trace N times faster on N replicas",
        "choice": "on train: highest hit rate with TTFT p90 no worse than the control's",
        "executor": "ray" if args.ray else "local processes"},
        "cells": rows, "wall_s": wall, "wall_s_total": float(np.sum(list(wall.values())))}
    path = write_result(args.json.stem, doc, args.json.parent, findings)
    print(f"fleet: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
