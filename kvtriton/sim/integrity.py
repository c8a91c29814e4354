"""Integrity mode: real KV bytes move through the real ``TransferEngine`` during a simulation.

Every block the simulated model computes is filled with bytes derived from its key; every block
loaded from the CPU tier is compared with the bytes its position's key must have. Any difference
stops the run with the request, block and step. The tensors belong to a miniature copy of the
layout (same groups, block sizes and hash size; one layer, one head of four int32 values; tiny
Mamba states), so the check costs little while exercising the same descriptor tables and copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtriton.engine import TransferEngine
from kvtriton.engine.descriptors import allocate_kv_caches
from kvtriton.pool import NULL_BLOCK
from kvtriton.records import PlannerMeta
from kvtriton.sim.errors import IntegrityError
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

__all__ = ["IntegrityChecker", "IntegrityError", "miniature"]


def miniature(layout: KVLayout) -> KVLayout:
    """``layout`` with the same groups and block sizes but tiny per-block segments."""
    groups = []
    for g in layout.groups:
        if isinstance(g, MambaSpec):
            groups.append(MambaSpec(g.block_size, (4,), (8,), 1, dtype=torch.int32))
        elif isinstance(g, SlidingWindowSpec):
            groups.append(SlidingWindowSpec(g.block_size, 1, 4, 1, g.sliding_window,
                                            dtype=torch.int32))
        else:
            groups.append(FullAttentionSpec(g.block_size, 1, 4, 1, dtype=torch.int32))
    return KVLayout(groups, layout.hash_block_size, name=f"{layout.name}-mini")


def _pattern(key: int, segment: int, nbytes: int) -> torch.Tensor:
    """Bytes a segment of the block keyed ``key`` holds: a key-seeded sequence (int64 math)."""
    seed = (key * 0x9E3779B1 + segment * 0x85EBCA77 + 1) & 0x7FFFFFFF
    i = torch.arange(nbytes, dtype=torch.int64)
    return (((i + 1) * seed) >> 7).remainder(251).to(torch.uint8)


class IntegrityChecker:
    """Owns the miniature KV tensors and the engine; the scheduler calls it as its
    ``kvtriton.sim.hooks.IntegrityHook``."""

    def __init__(self, layout: KVLayout, num_gpu_blocks: int, num_cpu_blocks: int,
                 backend: str = "torch") -> None:
        self.layout = miniature(layout)
        kv = allocate_kv_caches(self.layout, num_gpu_blocks + 1)
        for group in kv:
            for layer in group:
                for t in (layer if isinstance(layer, tuple) else (layer,)):
                    t.fill_(-1)
        self.engine = TransferEngine(self.layout, kv, num_cpu_blocks + 1, backend=backend)
        self._loaded: set[int] = set()
        self.blocks_checked = 0
        self.blocks_filled = 0

    def attach(self, num_gpu_blocks: int) -> None:
        """Raises ``ValueError`` if a GPU pool of ``num_gpu_blocks`` blocks does not fit."""
        held = self.engine.segments[0][0][0].shape[0]
        if num_gpu_blocks > held:
            raise ValueError(f"integrity tensors hold {held} GPU blocks, the pool has "
                             f"{num_gpu_blocks}")

    def fill(self, group: int, block: int, key: int) -> None:
        """The model computed ``block`` of ``group``: write its key's bytes."""
        for s, (view, _) in enumerate(self.engine.segments[group]):
            view[block] = _pattern(key, s, view.shape[1])
        self.blocks_filled += 1

    def execute(self, meta: PlannerMeta) -> None:
        """Run one step's copies (done when submitted, on CPU tensors)."""
        self.engine.execute(meta)
        self.engine.poll()
        self._loaded.update(meta.load.gpu_blocks)

    def check_load(self, request_id: str, keys: np.ndarray, tables: Sequence[Sequence[int]],
                   start: int, end: int, step: int) -> None:
        """Compare every block loaded for tokens ``[start, end)`` of ``request_id`` (its tables
        and keys ``[groups, hash blocks]``) with the bytes of its position's key."""
        hbs = self.layout.hash_block_size
        for g, spec in enumerate(self.layout.groups):
            r = spec.block_size // hbs
            table = tables[g]
            for pos in range(start // spec.block_size, -(-end // spec.block_size)):
                b = table[pos]
                if b == NULL_BLOCK or b not in self._loaded:
                    continue
                j = min((pos + 1) * r, end // hbs) - 1
                key = int(keys[g, j])
                for s, (view, _) in enumerate(self.engine.segments[g]):
                    if not torch.equal(view[b], _pattern(key, s, view.shape[1])):
                        raise IntegrityError(
                            f"step {step}: request {request_id!r}: GPU block {b} (group {g}, "
                            f"position {pos}, segment {s}) does not hold key {key} after its "
                            "CPU load")
                self._loaded.discard(b)
                self.blocks_checked += 1
