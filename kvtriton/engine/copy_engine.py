"""The copy-engine path: a step's blocks as contiguous pieces, one ``copy_`` each.

On CUDA every piece is a ``cudaMemcpyAsync`` between device memory and the pinned pool on the
current stream (``Tensor.copy_(non_blocking=True)``): the DMA engines move the bytes and no SM is
taken from the model. vLLM measured batched DMA on an H100 (PR #42212) at 3.8-7.1 GB/s for 4-24
KiB pieces, 40-44 GB/s from 28 KiB and 51-52 GB/s from 64 KiB, where SM copies win only below
about 28 KiB; ``choose_copy_engine`` decides per step and group from those figures.
``cuMemcpyBatchAsync`` (one call for every piece, ~0.5 us of host time per descriptor, vLLM PR
#48434) is not reachable through torch, so each piece costs one Python-level ``copy_`` call here
(a few us of host time): the count limit keeps that host time bounded.

A piece is a *span*: consecutive segments of one block that are adjacent both in one GPU
allocation and in the CPU block (a FlashInfer layer's K and V, a block-major layer), and, across
pairs, consecutive blocks that are adjacent on both sides merge further. On CPU tensors the same
code runs as plain memory copies, which is how the tests check it bit-exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "COPY_ENGINE_MAX_PIECES",
    "COPY_ENGINE_MIN_PIECE_BYTES",
    "PieceTable",
    "Span",
    "build_piece_table",
    "choose_copy_engine",
    "copy_pieces",
]

# Smallest piece (bytes) the copy engine gets in backend="auto": vLLM PR #42212 (H100, batched
# DMA) measured 40-44 GB/s from 28 KiB pieces against 3.8-7.1 GB/s at 4-24 KiB, the SM kernel
# winning below. `make gpu-check` measures the crossover on the machine it runs on
# (bench.kernels.bandwidth: "copy_engine" against "kernel" per piece size).
COPY_ENGINE_MIN_PIECE_BYTES = 28 * 1024
# Most pieces one step sends through the copy engine in backend="auto": each is one copy_ call
# of a few microseconds of host time (no cuMemcpyBatchAsync through torch), so 256 pieces keep
# the submission near a millisecond; a step with more goes, group by group from the smallest
# pieces, to the kernel, whose host time does not grow with the number of pieces.
COPY_ENGINE_MAX_PIECES = 256


@dataclass(frozen=True, slots=True)
class Span:
    """One piece of every block of a group: ``nbytes`` bytes at ``offset + block * stride`` in
    ``flat`` (a 1-D uint8 view of the whole GPU allocation) and at ``cpu_offset`` in the CPU
    block. All in bytes."""

    flat: torch.Tensor
    offset: int
    stride: int
    cpu_offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class PieceTable:
    """Per group, the spans of one block (``spans[g]``), built once per engine."""

    spans: tuple[tuple[Span, ...], ...]

    @property
    def pieces_per_block(self) -> np.ndarray:
        """``[G]`` spans per block of each group: the copies one pair costs, before merging."""
        return np.asarray([len(s) for s in self.spans], dtype=np.int64)

    @property
    def piece_bytes(self) -> np.ndarray:
        """``[G]`` bytes of each group's smallest span."""
        return np.asarray([min(sp.nbytes for sp in s) for s in self.spans], dtype=np.int64)


def _flat_bytes(view: torch.Tensor) -> torch.Tensor:
    storage = view.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=view.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def build_piece_table(segments: Sequence[Sequence[tuple[torch.Tensor, int]]]) -> PieceTable:
    """Spans of each group from ``segment_views`` output (``[num_blocks, nbytes]`` uint8 views
    with their CPU offsets): segments in CPU-block order, merged while they stay adjacent on
    both sides (same allocation and block stride)."""
    out = []
    for segs in segments:
        spans: list[Span] = []
        flats: dict[int, torch.Tensor] = {}
        for view, cpu_offset in segs:
            key = view.untyped_storage().data_ptr()
            flat = flats.get(key)
            if flat is None:
                flat = flats[key] = _flat_bytes(view)
            offset, stride, nbytes = view.storage_offset(), view.stride(0), view.shape[1]
            last = spans[-1] if spans else None
            if (last is not None and last.flat is flat and last.stride == stride
                    and last.offset + last.nbytes == offset
                    and last.cpu_offset + last.nbytes == cpu_offset):
                spans[-1] = Span(flat, last.offset, stride, last.cpu_offset,
                                 last.nbytes + nbytes)
            else:
                spans.append(Span(flat, offset, stride, cpu_offset, nbytes))
        out.append(tuple(spans))
    return PieceTable(tuple(out))


def choose_copy_engine(table: PieceTable, pair_counts: np.ndarray, *,
                       min_piece_bytes: int = COPY_ENGINE_MIN_PIECE_BYTES,
                       max_pieces: int = COPY_ENGINE_MAX_PIECES) -> np.ndarray:
    """``[G]`` bool: which groups of a step go through the copy engine.

    ``pair_counts[g]`` is the step's pairs of group g. A group qualifies when its smallest piece
    is at least ``min_piece_bytes``; while the qualifying groups need more than ``max_pieces``
    copies in all, the one with the smallest pieces goes back to the kernel.
    """
    pair_counts = np.asarray(pair_counts, dtype=np.int64)
    sizes = table.piece_bytes
    pieces = table.pieces_per_block * pair_counts
    chosen = (sizes >= min_piece_bytes) & (pair_counts > 0)
    for g in np.argsort(sizes, kind="stable"):
        if pieces[chosen].sum() <= max_pieces:
            break
        chosen[g] = False
    return chosen


def copy_pieces(direction: str, table: PieceTable, cpu_pool: torch.Tensor, gpu_blocks: np.ndarray,
                cpu_blocks: np.ndarray, groups: np.ndarray, *, non_blocking: bool = False) -> int:
    """Copy the pairs' spans between their GPU allocations and ``cpu_pool`` (``[num_cpu_blocks,
    cpu_block_bytes]`` uint8), one ``copy_`` per run of pieces adjacent on both sides, on the
    current stream. Ids are int64 arrays that ``validate_pairs`` returned (trusted here).
    ``direction`` is ``"store"`` (GPU -> CPU) or ``"load"``. Returns the number of copies."""
    if direction not in ("store", "load"):
        raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
    pool = cpu_pool.view(-1)
    row = cpu_pool.shape[1]
    store = direction == "store"
    copies = 0
    for g in np.unique(groups).tolist():
        m = groups == g
        cpu = cpu_blocks[m]
        order = np.argsort(cpu, kind="stable")
        cpu, gpu = cpu[order], gpu_blocks[m][order]
        for span in table.spans[g]:
            n = span.nbytes
            src = span.offset + gpu * span.stride
            dst = cpu * row + span.cpu_offset
            # A run continues while both sides advance by exactly one piece.
            breaks = np.flatnonzero((np.diff(src) != n) | (np.diff(dst) != n)) + 1
            starts = np.concatenate(([0], breaks))
            ends = np.concatenate((breaks, [len(src)]))
            for a, b, length in zip(src[starts].tolist(), dst[starts].tolist(),
                                    ((ends - starts) * n).tolist(), strict=True):
                gpu_bytes = span.flat[a:a + length]
                cpu_bytes = pool[b:b + length]
                if store:
                    cpu_bytes.copy_(gpu_bytes, non_blocking=non_blocking)
                else:
                    gpu_bytes.copy_(cpu_bytes, non_blocking=non_blocking)
            copies += len(starts)
    return copies
