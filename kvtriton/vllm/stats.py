"""The connector's statistics in vLLM's stats path (``get_kv_connector_stats``), and what each
one counts: ``STATS`` is the one place that says it, with its unit.

A counter is what accrued since the previous report (vLLM sums counters over reports and ranks);
a gauge is the tier's state at the report (the latest one is kept). The scheduler role reports
the planner's counters, the hints', the key ids' and the tier's gauges; each worker reports its
own copies under ``worker_*`` names, so that the two never add up under one name.

The tier's fill is ``cpu_cached_blocks``: the blocks holding cached data, which a lookup can hit.
It is not ``cpu_blocks_pinned_by_transfers``, the blocks a transfer holds a reference to, which
is 0 between transfers whatever the tier holds. (The gauge this connector once reported as
``cpu_used_blocks`` was the latter, read as the former: the misreading vLLM's users report of
vLLM's own cache-usage gauge, which also counts referenced blocks, not cached ones.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvtriton.second_tier.faults import FAULT_KINDS

__all__ = ["GAUGES", "STATS", "KVTritonStats", "Stat", "counter_deltas"]


@dataclass(frozen=True, slots=True)
class Stat:
    """``kind``: ``"counter"`` (since the last report) or ``"gauge"`` (at the report)."""

    kind: str
    unit: str
    meaning: str


def _counter(unit: str, meaning: str) -> Stat:
    return Stat("counter", unit, meaning)


def _gauge(unit: str, meaning: str) -> Stat:
    return Stat("gauge", unit, meaning)


_SCAN = "candidate positions the store scan"

#: Every statistic either role reports: name -> kind, unit, meaning. "CPU blocks" are blocks of
#: this rank's CPU tier; a "position" is a block position of a request's table in one group.
STATS: dict[str, Stat] = {
    # ---- the tier now (scheduler role) ----
    "cpu_cached_blocks": _gauge(
        "CPU blocks", "the tier's fill: blocks holding cached data a lookup can hit, free or "
        "referenced (the null block excluded)"),
    "cpu_blocks_pinned_by_transfers": _gauge(
        "CPU blocks", "blocks with a reference: destinations of stores in flight, sources of "
        "loads in flight and of lookup hits held for their load; 0 between transfers"),
    "pending_store_blocks": _gauge(
        "GPU blocks", "blocks of stores issued or queued (the finish flush) and not yet "
        "completed, abandoned ones (after a reset) included"),
    "key_ids_bound": _gauge(
        "key ids", "vLLM block hashes interned as key ids now (recycled ones excluded)"),
    "live_sessions": _gauge(
        "sessions", "sessions heard from within the setup's idle time, their last turn's "
        "blocks protected (sessions; 0 otherwise)"),
    # ---- stores (scheduler role) ----
    "blocks_stored": _counter("CPU blocks", "blocks of stores every worker completed"),
    "stores_completed": _counter("store events", "stores every worker completed"),
    "flush_stored": _counter(
        "CPU blocks", "blocks stored by a finished request's flush (issued)"),
    "lazy_stored": _counter(
        "CPU blocks", "blocks stored by lazy mode as the GPU was about to evict them (issued)"),
    "handoff_stored": _counter(
        "CPU blocks", "Mamba states saved at a boundary and stored (issued)"),
    "handoff_dropped": _counter(
        "CPU blocks", "Mamba states saved at a boundary and not stored: the request was gone, "
        "the block unhashed, or the tier had no free block"),
    "admission_skipped": _counter(
        "CPU blocks", "blocks the admission rule held back (second sight, or hinted: a closed "
        "session's keys)"),
    "running_evictions": _counter(
        "CPU blocks", "evictions of a block whose key a running request holds (what re-store "
        "stores again)"),
    "restore_thrash": _counter(
        "CPU blocks", "re-stores of a key that had been re-stored before"),
    "abandoned_stores": _counter("store events", "stores in flight abandoned by a reset"),
    "select_calls": _counter("passes", "passes of the store scan (one per step with stores)"),
    "select_s": _counter("seconds", "time in the store scan (measured; varies run to run)"),
    "tables_s": _counter("seconds", "time joining a step's new blocks to the tables (measured)"),
    "alloc_s": _counter("seconds", "time allocating CPU blocks, evictions included (measured)"),
    "listen_s": _counter(
        "seconds", "time in the listeners those evictions called (measured)"),
    "pin_s": _counter(
        "seconds", "time pinning GPU sources and flagging them in flight (measured)"),
    **{f"scan_{outcome}": _counter("positions", f"{_SCAN} {what}") for outcome, what in (
        ("null", "passed over: the null block (out of a sliding window)"),
        ("not_hashed", "passed over: not hashed yet"),
        ("in_flight", "passed over: a store of its block or key is in flight"),
        ("already_cached", "passed over: the tier holds its key"),
        ("duplicate", "passed over: its key met earlier in the same pass"),
        ("restore_capped", "did not re-store: the per-key or per-step re-store bound"),
        ("deferred", "left for a later step: no free CPU block"),
        ("stored", "stored past the cursor"),
        ("restored", "stored again below the cursor (the tier had evicted it)"),
    )},
    # ---- loads and lookups (scheduler role) ----
    "lookups": _counter("lookups", "CPU lookups of waiting requests"),
    "lookups_unaligned": _counter(
        "lookups", "lookups from a start not aligned to the scheduler's block (no hit)"),
    "cpu_hit_tokens": _counter("tokens", "tokens of CPU hits the scheduler accepted"),
    "chain_holes": _counter(
        "CPU blocks", "blocks the tier holds past a lookup's first miss (unusable for a hit)"),
    "lookups_with_holes": _counter("lookups", "lookups with at least one such block"),
    "loads_issued": _counter("load events", "loads issued to the workers"),
    "blocks_loaded": _counter("GPU blocks", "blocks of loads the workers completed"),
    "sync_loads": _counter(
        "requests", "CPU hits loaded in the step that scheduled them, before its forward pass "
        "(within sync_load_budget_bytes; issued)"),
    "sync_load_bytes": _counter("bytes", "bytes of those same-step loads, per rank (issued)"),
    "gpu_hit_refreshed": _counter(
        "CPU blocks", "free CPU copies of a request's GPU prefix hit moved to the far end of "
        "the tier's eviction order, used again (refresh_on_gpu_hit)"),
    # ---- reports (scheduler role) ----
    "stale_reports": _counter(
        "reports", "worker reports of a store already completed or of a load no longer in "
        "flight (late or repeated; ignored)"),
    "failed_transfers": _counter(
        "transfers", "stores and loads a worker reported failed (released, nothing cached)"),
    # ---- hints and key ids (scheduler role) ----
    "hints_continue": _counter("requests", "finished requests hinted continue, applied"),
    "hints_close": _counter("requests", "finished requests hinted close, applied"),
    "hints_ignored": _counter(
        "requests", "finished requests with a hint, under a setup that uses none (neither "
        "hints nor hinted admission)"),
    "malformed_hints": _counter(
        "requests", "finished requests whose hint was neither continue nor close (served "
        "without one)"),
    "protect_overflow": _counter(
        "CPU blocks", "blocks let go of the protected segment (hints, waiting, sessions) "
        "because it was full"),
    "session_turns": _counter(
        "requests", "finished requests with a session id whose blocks were protected for the "
        "session's next turn (sessions)"),
    "sessions_expired": _counter(
        "sessions", "sessions silent past the setup's idle time, their protection let go"),
    "claims_proven": _counter(
        "requests", "finished turns or continue hints whose claim on the protected segment was "
        "proven: their context came back (sessions, hints)"),
    "claims_unproven_let_go": _counter(
        "claims", "claims let go unproven: the probation share of the protected segment was "
        "full (sessions, hints)"),
    "claims_over_share_let_go": _counter(
        "claims", "claims let go because their tenant (cache_salt) held the most of a full "
        "protected segment (sessions, hints)"),
    "malformed_sessions": _counter(
        "requests", "finished requests whose session id was not a string of 1 to 256 "
        "characters (served without one)"),
    "key_collisions": _counter(
        "positions", "positions whose hash another request interned first while this one ran "
        "(never stored for it)"),
    "key_ids_recycled": _counter("key ids", "key ids recycled by the sweep"),
    # ---- each worker (worker role) ----
    "worker_stores_issued": _counter("store events", "stores this rank started"),
    "worker_loads_issued": _counter("load events", "loads this rank started"),
    "worker_blocks_stored": _counter("GPU blocks", "blocks of the stores this rank started"),
    "worker_blocks_loaded": _counter("GPU blocks", "blocks of the loads this rank started"),
    "worker_failed_stores": _counter("store events", "stores that failed on this rank"),
    "worker_failed_loads": _counter("load events", "loads that failed on this rank"),
    "worker_sync_loads_issued": _counter(
        "load events", "same-step loads this rank started and waited for before the forward "
        "pass (counted in worker_loads_issued too)"),
    "worker_store_bytes": _counter("bytes", "bytes this rank's completed stores copied"),
    "worker_load_bytes": _counter("bytes", "bytes this rank's completed loads copied"),
    "worker_store_s": _counter(
        "seconds", "copy time of this rank's completed stores (device time on a GPU; measured)"),
    "worker_load_s": _counter(
        "seconds", "copy time of this rank's completed loads (device time on a GPU; measured)"),
    # ---- the second tier (scheduler role; second_tier set) ----
    "second_tier_queries": _counter("queries", "batched existence queries (one per request whose "
                              "CPU hit ended short)"),
    "second_tier_query_blocks": _counter("blocks", "blocks past a CPU hit asked of the store"),
    "second_tier_queries_ahead": _counter(
        "queries", "existence queries answered from the one asked when the request arrived "
        "(off the scheduler's step)"),
    "second_tier_query_waits": _counter(
        "requests", "requests whose lookup found their existence query not back yet (each "
        "waited a step or more)"),
    "second_tier_found_blocks": _counter("blocks", "blocks the store held for a run and a fetch "
                                   "read (every rank's object present)"),
    "second_tier_fetches": _counter("fetch events", "fetches from the store issued to the workers"),
    "second_tier_blocks_fetched": _counter(
        "CPU blocks", "blocks every worker read and verified, cached in the CPU tier"),
    "second_tier_blocks_failed": _counter(
        "CPU blocks", "blocks a worker failed to read or verify (recomputed, never cached)"),
    **{f"second_tier_faults_{kind}": _counter("faults", f"scheduler: {what}")
       for kind, what in FAULT_KINDS.items()},
    # ---- the second tier (worker role) ----
    "worker_second_tier_puts": _counter("puts", "batched write-through puts this rank sent"),
    "worker_second_tier_put_blocks": _counter("blocks", "blocks this rank put in the store"),
    "worker_second_tier_put_bytes": _counter("bytes", "payload bytes this rank put"),
    "worker_second_tier_put_s": _counter(
        "seconds", "time in write-through puts, existence check included (background thread; "
        "measured)"),
    "worker_second_tier_put_skipped": _counter(
        "blocks", "blocks not put: the store held them already (another replica's, say)"),
    "worker_second_tier_put_already_present": _counter(
        "blocks", "blocks not put: absent at the existence check, then another writer (another "
        "replica) wrote or began to write them first, whose object Mooncake keeps"),
    "worker_second_tier_fetches": _counter("fetch events", "fetches this rank ran"),
    "worker_second_tier_fetch_blocks": _counter("blocks", "blocks this rank read and verified"),
    "worker_second_tier_fetch_failed": _counter(
        "blocks", "blocks this rank failed to read or verify"),
    "worker_second_tier_fetch_bytes": _counter("bytes", "payload bytes this rank fetched"),
    "worker_second_tier_fetch_s": _counter(
        "seconds", "time in fetches, verification included (background thread; measured)"),
    **{f"worker_second_tier_faults_{kind}": _counter("faults", f"this rank: {what}")
       for kind, what in FAULT_KINDS.items()},
}

GAUGES = tuple(name for name, stat in STATS.items() if stat.kind == "gauge")


@dataclass
class KVTritonStats(KVConnectorStats):
    """``data``: counter name -> count since the last report, and the ``GAUGES`` (``STATS``
    says what each one counts)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVTritonStats:
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = v if k in GAUGES else out.get(k, 0) + v
        return KVTritonStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if k not in GAUGES)


def counter_deltas(now: dict[str, Any], before: dict[str, Any]) -> dict[str, int | float]:
    """The numeric counters of ``now`` minus those of ``before`` (non-zero ones only)."""
    out = {}
    for k, v in now.items():
        if isinstance(v, bool) or not isinstance(v, int | float):
            continue
        d = v - before.get(k, 0)
        if d:
            out[k] = d
    return out
