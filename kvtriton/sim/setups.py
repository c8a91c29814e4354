"""The CPU-tier policies the simulator compares side by side."""

from __future__ import annotations

from dataclasses import dataclass

from kvtriton.planner import PlannerConfig

__all__ = ["DEFAULT_POLICIES", "TIER_POLICIES", "TierPolicy", "tier_policy"]


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """A CPU tier setup: planner switches (``None``: no CPU tier) and the CPU pool's eviction."""

    name: str
    planner: PlannerConfig | None
    cpu_eviction: str
    description: str


_TAIL = PlannerConfig(restore=True, cpu_free_order="tail_first")
# Running requests' blocks may hold up to half of the CPU tier before re-stores stop: past that a
# re-store mostly evicts another running request's block (see the thrash counts in the results).
_BOUNDED = PlannerConfig(restore=True, cpu_free_order="tail_first", restore_share=0.5)

TIER_POLICIES: dict[str, TierPolicy] = {
    p.name: p
    for p in (
        TierPolicy("no_cpu", None, "lru", "GPU prefix cache only"),
        TierPolicy("control", PlannerConfig(restore=False, cpu_free_order="head_first"), "lru",
                   "cursor-only stores as vLLM's SimpleCPUOffloadConnector, head first, LRU"),
        TierPolicy("restore", PlannerConfig(restore=True, cpu_free_order="head_first"), "lru",
                   "re-store evicted blocks of running requests, head first, LRU"),
        TierPolicy("restore_tail", _TAIL, "lru", "re-store, CPU blocks freed tail first, LRU"),
        TierPolicy("restore_tail_bounded", _BOUNDED, "lru",
                   "re-store while running requests hold < 50% of the CPU tier, tail first, LRU"),
        TierPolicy("restore_tail_bounded_arc", _BOUNDED, "arc",
                   "bounded re-store, tail first, ARC on the CPU tier"),
        TierPolicy("restore_tail_bounded_s3fifo", _BOUNDED, "s3fifo",
                   "bounded re-store, tail first, S3-FIFO on the CPU tier"),
    )
}

DEFAULT_POLICIES = tuple(TIER_POLICIES)


def tier_policy(name: str) -> TierPolicy:
    try:
        return TIER_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(TIER_POLICIES)}") from None
