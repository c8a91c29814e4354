"""Across a fleet: replicas, routers and a shared store in the simulator
(``bench/results/fleet.json``)."""

from __future__ import annotations

from paper.format import machine_line, md_table
from paper.results import FIGURES, load, not_run

#: Points by which another combination must beat the train choice on test to be named.
HELD_POINTS = 0.5


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _memory(test: dict, name: str) -> float:
    pooled = test["pooled"].get("memory_blocks") or 0
    return test[name].get("memory_blocks", 0) / pooled if pooled else float("nan")


def fleet_section(v: dict) -> None:
    doc = load("fleet")
    if doc is None:
        v["fleet_text"] = f"*Pending: `fleet.json` is {not_run('fleet.json')}.*"
        v["fig_fleet"] = ""
        return
    from bench.plots import plot_fleet

    plot_fleet(doc, FIGURES / "fleet.png")
    f, cond = doc["findings"], doc["conditions"]
    rows = []
    for w, by_n in f["table"].items():
        for n, t in sorted(by_n.items(), key=lambda kv: int(kv[0])):
            test = t["test"]
            rows.append([w, n, t["chosen"], _pct(test["control"]["hit_rate"]),
                         _pct(test["chosen"]["hit_rate"]), _pct(test["pooled"]["hit_rate"]),
                         _pct(test["unbounded"]["hit_rate"]),
                         f"{test['control']['ttft_p90_s']:.2f}",
                         f"{test['chosen']['ttft_p90_s']:.2f}",
                         _pct(t["recovered_share"]),
                         f"{test['chosen']['busiest_queue_delay_ratio'] or 0:.2f}",
                         _pct(t.get("control_prefix_left_elsewhere")),
                         f"{_memory(test, 'chosen'):.2f}"])
    missed = [f"{w} N = {n}: {t['best_on_test']} ({t['best_on_test_points']:.1f} points more)"
              for w, by_n in f["table"].items() for n, t in by_n.items()
              if (t.get("best_on_test_points") or 0) > HELD_POINTS]
    held = (f"On the test part no combination beat the train choice by more than "
            f"{HELD_POINTS} points in any cell." if not missed else
            f"On the test part another combination beat the train choice by more than "
            f"{HELD_POINTS} points in {len(missed)} of {len(rows)} cells: "
            + "; ".join(missed) + ".")
    target = f.get("recovered_share")
    verdict = "not run at the target's cell" if target is None else (
        f"at N = {target['replicas']} on {target['workload']}'s test part the choice "
        f"({target['chosen']}) recovers {_pct(target['value'])} of the hit rate that "
        f"splitting loses against the pooled replica, against a target of "
        f"{_pct(target['target'])}, with its TTFT p90 "
        f"{'no worse than' if target['ttft_p90_no_worse'] else 'worse than'} round-robin's: "
        f"**{'met' if target['met'] else 'missed'}**")
    v["fig_fleet"] = ("![Test hit rate and TTFT p90 against the number of replicas, per "
                      "combination of tier, store and router](figures/fleet.png)")
    v["fleet_text"] = (
        "N replicas, each its own GPU prefix cache, CPU tier and scheduler, run on one "
        "modeled clock behind a router (`kvtriton.sim.fleet`); with `shared` they share one "
        "store, whose two links every replica's write-through and fetches queue on. The "
        "routers read only what a router in front of vLLM replicas can read when a request "
        "arrives: nothing (round-robin), queue lengths (least-loaded), the session id "
        "(sticky), or the block hashes each replica reports cached plus queue lengths "
        "(prefix-aware, with a load cap: a replica more than 1.5 times the mean load is "
        "passed over). The per-replica load is held fixed by serving each trace N times "
        "faster on N replicas. Per workload and N, the combination of per-replica tier "
        f"({', '.join(cond['tiers'])}), store and router is chosen on the train part "
        "(highest hit rate with a TTFT p90 no worse than the control's) and reported on the "
        "test part beside the control (`eager`, round-robin, no store) and three references: "
        "`pooled` (one replica with N times the memory, batch and compute), `unbounded` (one "
        "fleet-wide tier of every block, free to reach) and `nextuse` (per-replica next-use "
        "eviction, an oracle). None is claimed to bound what a fleet can reach. Modeled on "
        + machine_line(doc)
        + f" (`python -m bench --only fleet`, {cond['size']} size, {len(doc['cells'])} "
        "simulations).\n\n"
        + md_table(["workload", "N", "chosen on train", "control hit", "chosen hit",
                    "pooled hit", "unbounded hit", "control TTFT p90 (s)",
                    "chosen TTFT p90 (s)", "loss recovered", "busiest/mean queue",
                    "left elsewhere (RR)", "chosen memory / pooled"], rows)
        + "\n\nThe target: " + verdict + ". " + held
        + " \"Loss recovered\" is the chosen combination's hit-rate gain over the control "
        "as a share of the pooled replica's; \"busiest/mean queue\" is the busiest "
        "replica's mean queueing delay over the fleet's, what routing costs in balance. "
        "\"Left elsewhere (RR)\" is what an operator can measure before choosing: under "
        "round-robin, the share of prompt blocks another replica held a longer cached "
        "prefix of than the one the request went to (from the replicas' KV events); where "
        "it is small, neither a prefix-aware router nor a shared store has much to "
        "recover, and the table says which one does where it is large. \"Chosen memory / "
        "pooled\" is the chosen combination's GPU, CPU and store blocks over the pooled "
        "replica's: a shared store (as large as the fleet's CPU tiers together) is memory "
        "on top of the replicas' own, so a combination with it can pass the pooled replica. "
        "The store is one pair of links (puts in, gets out) at the loopback figure of Section "
        "3.11 for the whole fleet: where many replicas fetch at once the gets queue, and a "
        "request whose fetch is not back within `fetch_timeout_s` (5 s) runs without it. A "
        "distributed store whose bandwidth grows with its hosts is not modeled.")
