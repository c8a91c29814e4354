"""The connector's counters in vLLM's stats path (``get_kv_connector_stats``).

Each call reports the planner's counters accrued since the previous call (blocks, tokens, events:
all counts), plus two gauges of the tier now: CPU blocks in use and blocks in stores not yet
completed. Counters add up across reports and workers; gauges keep the latest value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["GAUGES", "KVTritonStats", "counter_deltas"]

GAUGES = ("cpu_used_blocks", "pending_store_blocks", "key_ids")


@dataclass
class KVTritonStats(KVConnectorStats):
    """``data``: counter name -> count since the last report, and the ``GAUGES``."""

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
