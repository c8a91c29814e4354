"""Faults of the second tier: counted by kind, warned about once per kind, and the store's
return announced. A fault never reaches the GPU: its blocks are recomputed."""

from __future__ import annotations

import logging

__all__ = ["FAULT_KINDS", "FaultLog"]

logger = logging.getLogger("kvtriton.second_tier")

#: Every kind of fault, with what the reader of the log should know.
FAULT_KINDS: dict[str, str] = {
    "unreachable": "the master or the transfer engine did not answer (down, restarting)",
    "missing": "a block named by the existence query was gone at its read (evicted, lease)",
    "short_read": "a read returned another length than the block's",
    "corrupt": "a block's header or checksum did not match what was asked for",
    "timeout": "a fetch took longer than fetch_timeout_s; the request ran without it",
    "full": "the store had no room for a put: every segment full, or none at all (no replica "
            "contributes segment_bytes and no store host has joined)",
    "error": "any other error code from Mooncake's client",
}


class FaultLog:
    """Counts per kind (``counts``); the first fault of a kind is a warning, later ones are not;
    the first success after an ``unreachable`` fault is an info line."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.counts = dict.fromkeys(FAULT_KINDS, 0)
        self._warned: set[str] = set()
        self._down = False

    def fault(self, kind: str, n: int = 1, detail: str = "") -> None:
        self.counts[kind] += n
        if kind == "unreachable":
            self._down = True
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning("KVTritonConnector %s: second tier fault %r (%s)%s; those blocks "
                           "are recomputed, the engine goes on (warned once per kind, counted "
                           "in second_tier_faults_%s)", self.where, kind, FAULT_KINDS[kind],
                           f": {detail}" if detail else "", kind)

    def as_stats(self) -> dict[str, int]:
        """The counts under their ``STATS`` names (``second_tier_faults_<kind>``)."""
        return {f"second_tier_faults_{k}": v for k, v in self.counts.items()}

    def ok(self) -> None:
        if self._down:
            self._down = False
            logger.info("KVTritonConnector %s: the second tier answers again", self.where)
