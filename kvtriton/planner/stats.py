"""Counters and gauges the planner keeps; every figure the simulator reports per setup."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

__all__ = ["PlannerStats", "ScanOutcomes"]


@dataclass(slots=True)
class ScanOutcomes:
    """What the store scan decided for each candidate position, by outcome.

    A candidate is a position in ``[cursor, ready)`` or a position below the cursor whose key the
    CPU evicted. Precedence: null, not_hashed, in_flight, already_cached, duplicate (its key was
    met earlier in the pass), restore_capped, deferred (no CPU space), then stored/restored.
    """

    null: int = 0
    not_hashed: int = 0
    in_flight: int = 0
    already_cached: int = 0
    duplicate: int = 0
    restore_capped: int = 0
    deferred: int = 0
    stored: int = 0
    restored: int = 0

    def add(self, other: ScanOutcomes) -> None:
        for k in _OUTCOMES:
            setattr(self, k, getattr(self, k) + getattr(other, k))


_OUTCOMES = tuple(f.name for f in fields(ScanOutcomes))


@dataclass(slots=True)
class PlannerStats:
    """Cumulative planner figures. Blocks are CPU blocks; tokens are prompt tokens.

    ``select_calls`` counts the selector's passes and ``select_s`` is their measured time
    (``time.perf_counter`` around each pass inside ``build_meta``); it and the other ``*_s``
    parts are the figures that differ from run to run; every other figure is a count.
    """

    flush_stored: int = 0
    handoff_stored: int = 0
    handoff_dropped: int = 0
    lazy_stored: int = 0
    admission_skipped: int = 0
    gpu_hit_refreshed: int = 0
    stores_completed: int = 0
    blocks_stored: int = 0
    loads_issued: int = 0
    blocks_loaded: int = 0
    cpu_hit_tokens: int = 0
    lookups: int = 0
    lookups_unaligned: int = 0
    chain_holes: int = 0
    lookups_with_holes: int = 0
    restore_thrash: int = 0
    running_evictions: int = 0
    stale_reports: int = 0
    failed_transfers: int = 0
    abandoned_stores: int = 0
    select_calls: int = 0
    select_s: float = 0.0
    # The rest of a step's build, by part (``bench.vllm.vs_vllm`` reports them): the new blocks
    # joining the tables, the CPU blocks allocated (evictions included), the batch listeners
    # those evictions called, the GPU sources pinned and flagged in flight.
    tables_s: float = 0.0
    alloc_s: float = 0.0
    listen_s: float = 0.0
    pin_s: float = 0.0
    scan: ScanOutcomes = field(default_factory=ScanOutcomes)

    def as_dict(self, measured: bool = True) -> dict:
        """Every figure, flat; ``measured=False`` leaves out the measured seconds."""
        skip = ("scan",) if measured else ("scan", *_MEASURED)
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out.update({f"scan_{k}": v for k, v in asdict(self.scan).items()})
        return out


_MEASURED = ("select_s", "tables_s", "alloc_s", "listen_s", "pin_s")
