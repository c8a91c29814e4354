"""``kv_connector_extra_config`` of ``KVTritonConnector``: every key, its unit, default and check.

The connector is configured the way vLLM configures any KV connector, through
``KVTransferConfig.kv_connector_extra_config`` (the ``--kv-transfer-config`` JSON). Parsing is
strict: an unknown key or a value outside its allowed set is one ``ValueError`` at start-up that
names the key and what it accepts, before any request is served. This module imports nothing of
vLLM, so the checks run (and are tested) without it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtriton.eviction import EVICTION_QUEUES
from kvtriton.planner import PlannerConfig
from kvtriton.setups import TierPolicy
from kvtriton.validation import is_int

__all__ = ["DEFAULT_CPU_BYTES_PER_RANK", "ConnectorConfig", "extra_config_for",
           "parse_extra_config"]

DEFAULT_CPU_BYTES_PER_RANK = 8 << 30  # 8 GiB, vLLM SimpleCPUOffloadConnector's default size


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings, one field per ``kv_connector_extra_config`` key.

    - ``cpu_bytes_per_rank``: bytes of pinned host memory for the CPU tier on each rank
      (default 8 GiB). Every rank holds the same CPU blocks, so the tier stores
      ``cpu_bytes_per_rank`` of each rank's share of the KV; blocks are sized as vLLM's own
      offload connector sizes them (GPU blocks x bytes / GPU KV bytes).
    - ``restore``: re-store CPU-evicted blocks of running requests (default true; eager mode
      only, lazy mode stores from the GPU free queue).
    - ``cpu_free_order``: ``"tail_first"`` (default: a chain's head is evicted last) or
      ``"head_first"`` (vLLM SimpleCPUOffloadConnector's order).
    - ``cpu_eviction``: the CPU tier's eviction policy, ``"lru"`` (default), ``"arc"`` or
      ``"s3fifo"``.
    - ``restore_share``: re-stores stop while running requests' blocks hold this share of the
      CPU tier, a number in [0, 1], or null for no bound (default null).
    - ``max_restores_per_step``: cap on re-stores per scheduler step, blocks (default null).
    - ``max_restores_per_key``: a block re-stored this many times is not re-stored again
      (default null).
    - ``offload``: ``"eager"`` (default: store each block once it is computed) or ``"lazy"``
      (store a GPU block as it nears eviction from the GPU prefix cache).
    - ``lazy_target_blocks``: lazy mode's GPU blocks kept offloaded ahead of eviction (default
      null: two steps' worth of ``max_num_batched_tokens``).
    - ``scan``: ``"fused"`` (default) or ``"loop"`` (the per-block reference; same selection).
    - ``scan_idle``: also scan running requests with no tokens this step (default false).
    """

    cpu_bytes_per_rank: int = DEFAULT_CPU_BYTES_PER_RANK
    restore: bool = True
    cpu_free_order: str = "tail_first"
    cpu_eviction: str = "lru"
    restore_share: float | None = None
    max_restores_per_step: int | None = None
    max_restores_per_key: int | None = None
    offload: str = "eager"
    lazy_target_blocks: int | None = None
    scan: str = "fused"
    scan_idle: bool = False

    def planner_config(self, *, world_size: int, max_num_batched_tokens: int) -> PlannerConfig:
        """The planner's switches for this connector on ``world_size`` workers."""
        return PlannerConfig(
            restore=self.restore,
            scan=self.scan,
            cpu_free_order=self.cpu_free_order,
            max_restores_per_step=self.max_restores_per_step,
            max_restores_per_key=self.max_restores_per_key,
            restore_share=self.restore_share,
            scan_idle=self.scan_idle,
            lazy=self.offload == "lazy",
            lazy_target_blocks=self.lazy_target_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            world_size=world_size,
        )

    def describe(self) -> str:
        """One line for the start-up log."""
        bound = [f"{k}={getattr(self, k)}" for k in
                 ("restore_share", "max_restores_per_step", "max_restores_per_key")
                 if getattr(self, k) is not None]
        return (f"CPU {self.cpu_bytes_per_rank / 2**30:.2f} GiB/rank, {self.offload}, "
                f"re-store {'on' if self.restore else 'off'}"
                + (f" ({', '.join(bound)})" if bound else "")
                + f", free {self.cpu_free_order}, eviction {self.cpu_eviction}, "
                f"scan {self.scan}")


# Keys whose value is the planner's field of the same name.
_PLANNER_KEYS = ("restore", "cpu_free_order", "restore_share", "max_restores_per_step",
                 "max_restores_per_key", "scan", "scan_idle", "lazy_target_blocks")


def extra_config_for(policy: TierPolicy) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` that runs ``policy`` (a ``kvtriton.setups`` setup) in
    the connector: the inverse of ``ConnectorConfig.planner_config``. ``ValueError`` for a setup
    with no CPU tier or with an axis the connector has no key for."""
    p = policy.planner
    if p is None:
        raise ValueError(f"setup {policy.name!r} has no CPU tier: run vLLM without the connector")
    if (policy.oracle or policy.hints or policy.lookahead or p.admission != "all"
            or p.refresh_on_gpu_hit):
        raise ValueError(f"setup {policy.name!r} uses an axis the connector does not take "
                         "(next-use oracle, unbounded tier, hints, waiting-queue lookahead, "
                         "second-sight or hinted admission, refresh)")
    return {**{k: getattr(p, k) for k in _PLANNER_KEYS},
            "cpu_eviction": policy.cpu_eviction, "offload": "lazy" if p.lazy else "eager"}


_CHOICES: dict[str, tuple[str, ...]] = {
    "cpu_free_order": ("tail_first", "head_first"),
    "cpu_eviction": tuple(EVICTION_QUEUES),
    "offload": ("eager", "lazy"),
    "scan": ("fused", "loop"),
}
_BOOLS = ("restore", "scan_idle")
_OPTIONAL_COUNTS = ("max_restores_per_step", "max_restores_per_key", "lazy_target_blocks")
_KEYS = tuple(f.name for f in fields(ConnectorConfig))


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"KVTritonConnector: kv_connector_extra_config[{key!r}] = {value!r} is "
                      f"not allowed; expected {allowed}")


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Check ``kv_connector_extra_config`` and return the settings; ``ValueError`` names the
    first unknown key (with the known ones) or bad value (with what it accepts)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS))
    if unknown:
        raise ValueError(f"KVTritonConnector: unknown kv_connector_extra_config key "
                         f"{unknown[0]!r}; known keys: {', '.join(_KEYS)}")
    for key, value in extra.items():
        if key == "cpu_bytes_per_rank":
            if not is_int(value) or value <= 0:
                raise _bad(key, value, "a positive int (bytes)")
        elif key in _BOOLS:
            if not isinstance(value, bool):
                raise _bad(key, value, "true or false")
        elif key in _CHOICES:
            if value not in _CHOICES[key]:
                raise _bad(key, value, "one of " + ", ".join(map(repr, _CHOICES[key])))
        elif key in _OPTIONAL_COUNTS:
            if value is not None and (not is_int(value) or value < 0):
                raise _bad(key, value, "null or a non-negative int")
        elif key == "restore_share" and value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or not 0 <= value <= 1):
            raise _bad(key, value, "null or a number in [0, 1]")
    return ConnectorConfig(**extra)
