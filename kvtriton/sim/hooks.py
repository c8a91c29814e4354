"""What integrity mode needs from a scheduler, as an interface the scheduler calls.

The scheduler (``kvtriton.sim.scheduler``, ``kvtriton.sim.batch_scheduler``) calls the hook with
plain values (group, block and key ids, a request's keys and block tables, token counts); the
serving loop attaches it to both block pools, whose key listeners it uses, and names each step. So
the checker that moves real bytes (``kvtriton.sim.integrity``, which imports torch, the transfer
engine and Triton) never imports the scheduler, and the scheduler imports it only as this protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from kvtriton.pool import BlockPool
    from kvtriton.records import PlannerMeta

__all__ = ["IntegrityHook"]


class IntegrityHook(Protocol):
    """Real KV bytes that follow the scheduler's blocks."""

    def attach(self, gpu: BlockPool, cpu: BlockPool | None) -> None:
        """Follow the scheduler's GPU pool and the CPU tier (None: no tier): every block
        registered under a key in either is checked as it is (``IntegrityError``). Raises
        ``ValueError`` if a pool does not fit the hook's tensors."""

    def begin_step(self, step: int) -> None:
        """Scheduler step ``step`` begins: errors raised until the next one name it."""

    def fill(self, group: int, block: int, key: int) -> None:
        """The model computed GPU ``block`` of ``group``, the block keyed ``key``."""

    def execute(self, meta: PlannerMeta) -> None:
        """Run one step's store and load copies."""

    def check_load(self, request_id: str, keys: np.ndarray, tables: Sequence[Sequence[int]],
                   start: int, end: int, step: int) -> None:
        """A load of tokens ``[start, end)`` into ``tables`` (per group, GPU block ids) landed;
        ``keys[g, j]`` is group g's key after hash block j. Raises on a block that does not hold
        its key's bytes (``step`` names the scheduler step in the message)."""
