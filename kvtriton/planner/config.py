"""The planner's switches, the knobs the benchmarks compare."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvtriton.validation import is_finite_number, is_int

__all__ = ["PlannerConfig"]


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """How the planner selects, frees and bounds its stores.

    - ``restore``: re-store blocks of running requests that the CPU evicted below the cursor
      (off: the cursor-only control, as vLLM's ``SimpleCPUOffloadConnector`` stores).
    - ``scan``: ``"fused"`` (one vectorized pass) or ``"loop"`` (the per-block reference); both
      select exactly the same blocks.
    - ``cpu_free_order``: order in which a completed store's CPU blocks join the CPU free queue;
      ``"tail_first"`` makes a chain's head the last to be evicted, ``"head_first"`` is
      vLLM's connector's ascending order.
    - ``max_restores_per_step``: cap on re-stores selected in one step (None: only the CPU budget).
    - ``max_restores_per_key``: a key re-stored this many times is not re-stored again, which
      bounds thrash when the running working set exceeds the CPU (None: unbounded). Thrash is
      counted either way.
    - ``restore_share``: re-stores go ahead only while running requests' blocks hold less than
      this share of the CPU pool, and only as many as fit under it; past it each re-store would
      evict another running request's block (None: no bound).
    - ``scan_idle``: also scan running requests with no scheduled tokens this step (vLLM's
      connector skips them, so their evicted blocks wait).
    - ``lazy``: offload from the GPU free queue instead of eagerly (``lazy_target_blocks``
      overrides the target derived from the layout and ``max_num_batched_tokens``).
    - ``fine_grained``: CPU hits may end on any hash boundary (full-attention layouts only).
    - ``world_size``: workers that must report a store before it counts.
    - ``admission``: ``"all"`` stores every block the scan selects; ``"second"`` only blocks
      whose key at least two requests have held (counted at admission), as SGLang HiCache's
      ``write_through_selective`` backs up a node on its second hit. Eager stores only.
      ``"hinted"`` (lazy mode only): a key whose last holder finished with the hint ``close``
      (``request_finished(..., hint="close")``: its session ended) is not offloaded.
    - ``refresh_on_gpu_hit``: a request's GPU prefix hit also counts as a use of the CPU copies
      of those blocks (their eviction order is refreshed, once per request): the tier's recency
      then follows every hit, not only CPU hits.
    - ``hold_finished``: a request that finishes while a store of its blocks is in flight or
      queued (its finish flush) keeps its whole GPU table referenced until its last store
      completes, then releases it tail first: its blocks join the GPU free queue together, in
      the order the scheduler frees a table, so the GPU prefix cache evicts a chain's head last,
      as it does without a CPU tier. Off (vLLM's ``SimpleCPUOffloadConnector``): the scheduler
      frees the unpinned blocks at the finish and each store's sources join the queue when it
      completes, after them and head first, so the chain's head is evicted before its tail and
      the next turn loses its whole GPU prefix hit (``bench/tier_study/finish_free_order.py``).
    """

    restore: bool = True
    scan: Literal["fused", "loop"] = "fused"
    cpu_free_order: Literal["tail_first", "head_first"] = "tail_first"
    max_restores_per_step: int | None = None
    max_restores_per_key: int | None = None
    restore_share: float | None = None
    scan_idle: bool = False
    lazy: bool = False
    lazy_target_blocks: int | None = None
    max_num_batched_tokens: int = 8192
    fine_grained: bool = False
    world_size: int = 1
    admission: Literal["all", "second", "hinted"] = "all"
    refresh_on_gpu_hit: bool = False
    hold_finished: bool = True

    def __post_init__(self) -> None:
        if self.scan not in ("fused", "loop"):
            raise ValueError(f"scan must be 'fused' or 'loop', got {self.scan!r}")
        if self.cpu_free_order not in ("tail_first", "head_first"):
            raise ValueError(
                f"cpu_free_order must be 'tail_first' or 'head_first', got {self.cpu_free_order!r}")
        for name in ("restore", "scan_idle", "lazy", "fine_grained", "refresh_on_gpu_hit",
                     "hold_finished"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a bool, got {v!r}")
        for name in ("max_restores_per_step", "max_restores_per_key", "lazy_target_blocks"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise ValueError(f"{name} must be None or a non-negative int, got {v!r}")
        share = self.restore_share
        if share is not None and (not is_finite_number(share) or not 0 <= share <= 1):
            raise ValueError(f"restore_share must be None or a number in [0, 1], got {share!r}")
        if self.admission not in ("all", "second", "hinted"):
            raise ValueError(f"admission must be 'all', 'second' or 'hinted', got "
                             f"{self.admission!r}")
        if self.admission == "second" and self.lazy:
            raise ValueError("admission 'second' applies to eager stores, not lazy mode")
        if self.admission == "hinted" and not self.lazy:
            raise ValueError("admission 'hinted' needs lazy mode: an eager store happens when a "
                             "block is computed, before the turn's hint is known")
        if not is_int(self.world_size) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        if not is_int(self.max_num_batched_tokens) or self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens must be a positive int, got "
                             f"{self.max_num_batched_tokens!r}")
