"""The second tier on Mooncake Store: its transfers beside memcpy, the step cost it adds, and two
replicas sharing it (``bench/results/second_tier.json``)."""

from __future__ import annotations

from paper.format import machine_line, md_table
from paper.results import FIGURES, load, not_run


def _verdict(f: dict, what: str, unit: str = "") -> str:
    return (f"{what}: {f['value']:.3g}{unit} against a target of {f['target']:g}{unit}, "
            f"**{'met' if f['met'] else 'missed'}**")


def _ahead(cost: dict) -> str:
    on = cost["runs"]["on"]
    if not on or "query_waits" not in on[0]:
        return "not recorded in this run"
    ahead, asked = sum(r["queries_ahead"] for r in on), sum(r["queries"] for r in on)
    waits = sum(r["query_waits"] for r in on)
    return (f"{ahead} of the {asked} answers its lookups read were asked on arrival; "
            f"{waits} requests waited a step for theirs")


def second_tier_section(v: dict) -> None:
    doc = load("second_tier")
    if doc is None:
        v["second_tier_text"] = (f"*Pending: `second_tier.json` is "
                                 f"{not_run('second_tier.json')}.*")
        v["fig_second_tier"] = ""
        return
    from bench.plots import plot_second_tier

    plot_second_tier(doc, FIGURES / "second_tier.png")
    f, tier, rep = doc["findings"], doc["tier"], doc["replicas"]
    raw_rows = [[f"{r['object_bytes'] // 1024} KiB", f"{r['put_batched_gb_s']:.2f}",
                 f"{r['get_batched_gb_s']:.2f}", f"{r['put_single_gb_s']:.3f}",
                 f"{r['get_single_gb_s']:.3f}", f"{r['memcpy_gb_s']:.1f}"]
                for r in doc["raw"]]
    ways = [w for w in ("one_replica", "shared_store", "one_replica_cpu", "no_store")
            if w in rep]
    words = {"one_replica": "one replica serves both halves, with the store",
             "shared_store": "A, then a fresh B, sharing the store",
             "one_replica_cpu": "one replica, CPU tier alone",
             "no_store": "A, then a fresh B, CPU tier alone"}
    way_rows = [[words[w], f"{100 * rep[w]['b']['hit_rate']:.1f}%",
                 f"{rep[w]['b']['seconds']:.2f}",
                 str(rep[w].get("b_second_tier_blocks_fetched", 0))] for w in ways]
    cost = rep["step_cost"]
    v["fig_second_tier"] = ("![The store's GB/s by object size beside memcpy; replica B's hit "
                            "rate and time by way of serving](figures/second_tier.png)")
    v["second_tier_text"] = (
        "Under the CPU tier, `second_tier` puts Mooncake Store, shared by every replica that "
        "names its master. Every block the CPU tier stores is written through; a lookup whose "
        "CPU hit ends short asks the store, in one batched existence query, for the rest of "
        "the prefix, and the request waits while the workers read those blocks into the CPU "
        "tier's pool and verify each (a header with the name's digest, the length and an XXH3 "
        "checksum); the CPU tier's load path then brings them to the GPU. Objects are named by "
        "content (vLLM's chained block hash and a fingerprint of the model, layout, rank and "
        "platform), so replicas of one model share them (`docs/vllm.md` has the settings). "
        "Measured on " + machine_line(doc) + ", with one master and one store host "
        "on loopback TCP in the benchmark's process (`python -m bench --only second_tier`; "
        "every figure below is from that run).\n\n"
        "**The store beside memcpy.** Batched calls move 64 MiB per measurement (best of "
        f"{doc['conditions']['repeats']}); memcpy is a copy of the same bytes in the same run. "
        "Loopback TCP on two cores is a copy through the kernel on both ends: it is what this "
        "machine measures, not what RDMA gives; no RDMA figure is claimed here.\n\n"
        + md_table(["object", "put batched GB/s", "get batched GB/s", "put one per call GB/s",
                    "get one per call GB/s", "memcpy GB/s"], raw_rows) + "\n\n"
        f"The tier's own write-through and fetch of {tier['blocks']} blocks of "
        f"{tier['block_bytes'] >> 20} MiB (existence check, header, checksum and verification "
        f"included) reach {tier['tier_put_gb_s']:.2f} and {tier['tier_fetch_gb_s']:.2f} GB/s, "
        f"beside the raw client's {tier['raw_put_gb_s']:.2f} and {tier['raw_get_gb_s']:.2f} "
        "GB/s for the same blocks timed alternately: "
        + _verdict(f["transfer_share"], "the lower share") + ". The difference is the tier's "
        "own work per block: the existence check before a put, the header and its XXH3 "
        "checksum on both sides (a batch's checksums split over two threads). Each share is "
        "the median over the timed pairs of the raw call's seconds over the tier's.\n\n"
        "**Step cost.** vLLM's scheduler seconds (its `add_request`, `schedule` and "
        "`update_from_output`, the connector inside them) for the same work with the tier on "
        "and off, the store empty so that the tier fetches nothing. The ratio is of the "
        "seconds for the whole work, not per step: a request that waits for the store's "
        "answer adds steps, and cheap extra steps would make the mean step look cheaper. "
        + _verdict(f["step_cost_ratio"], f"The median of {len(cost['pair_ratios'])} paired "
                   "ratios", "x")
        + f" (the pairs ranged {min(cost['pair_ratios']):.2f}x to "
        f"{max(cost['pair_ratios']):.2f}x; per step the median ratio is "
        f"{cost.get('per_step_ratio', float('nan')):.2f}x). The existence query is asked on "
        "a helper thread when the request arrives, the queries of requests arriving together "
        "in one round trip; a lookup whose answer is not back waits for it at most 2 ms in "
        "the step, then answers vLLM \"not yet\" and is asked again next step, without "
        "looking the CPU tier up again meanwhile (" + _ahead(cost) + "). What is left is the "
        "tier's own bookkeeping per request and per step (planning the run, naming the "
        "stored blocks for the workers) and those waits: on this CPU engine a request's "
        "lookup comes within a millisecond of its arrival, so the round trip to the master "
        "is partly waited for in the step (a GPU server, where a request arrives during a "
        "model step, was not measured here).\n\n"
        "**Two replicas.** The cc_agentic sample at the engine benchmark's quick size, each "
        "session's first half of turns routed to replica A and the rest to B, so B's prompts "
        "extend prefixes only A computed; B's hit rate is vLLM's own count of prompt tokens "
        "served from a cache, and its time is the wall time of its batches with one output "
        "token each.\n\n"
        + md_table(["B's half served by", "B hit rate", "B seconds", "blocks fetched by B"],
                   way_rows) + "\n\n"
        + _verdict(f["hit_rate_gap_points"], "B's hit rate with a shared store, points from "
                   "one replica with the same tiers")
        + f". Against a fresh B without the store, the shared store serves B's half "
        f"{f['b_speedup_vs_no_store']:.2f}x faster. Getting there took three fixes the first "
        "runs showed: a request's fetched blocks stay pinned until its next lookup (another "
        "request's fetch evicted them), a run longer than the CPU tier's free blocks is fetched "
        "in rounds and waits for room, and a run is asked again from earlier when the "
        "request's GPU prefix was evicted while it waited.")
