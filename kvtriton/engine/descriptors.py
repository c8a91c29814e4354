"""From a layout's KV tensors to the copy kernels' tables, built once per engine.

``segment_views`` checks the registered tensors against the layout and returns, per group and per
segment, a ``[num_gpu_blocks, nbytes]`` uint8 view (no copy) with the segment's CPU offset: the
torch backend copies through these views, and ``build_copy_table`` reads the GPU base address and
block stride of each one into the int64 descriptor rows of the Triton kernel.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvtriton.kernels.copy_blocks import CHUNK_BYTES, WIDTHS, CopyTable
from kvtriton.specs import KVLayout

__all__ = ["ATTN_LAYOUTS", "allocate_kv_caches", "build_copy_table", "segment_views"]

ATTN_LAYOUTS = ("flash_attn", "flashinfer")
_ATTN_PART = {"k": 0, "v": 1}
_MAMBA_PART = {"conv": 0, "ssm": 1}


def _block_bytes_view(name: str, x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``x`` ``[num_blocks, ...]`` as ``[num_blocks, nbytes]`` uint8, sharing storage."""
    if x.dim() < 2:
        raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(x.shape)}")
    per_block = x.shape[1:].numel() * x.element_size()
    if per_block != nbytes:
        raise ValueError(f"{name} holds {per_block} bytes per block ({x.dtype} "
                         f"{tuple(x.shape[1:])}), the layout expects {nbytes}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no blocks")
    if not x[0].is_contiguous():
        raise ValueError(f"{name}: each block must be contiguous, got strides {x.stride()} for "
                         f"shape {tuple(x.shape)}")
    if x.stride(0) * x.element_size() < nbytes:
        raise ValueError(f"{name}: block stride {x.stride(0)} elements overlaps the "
                         f"{nbytes}-byte blocks")
    # view, never reshape: a copy would silently detach the engine from the KV cache.
    return x.view(x.shape[0], -1).view(torch.uint8).view(x.shape[0], nbytes)


def segment_views(layout: KVLayout, kv_caches: Sequence, attn_layout: str = "flash_attn"
                  ) -> list[list[tuple[torch.Tensor, int]]]:
    """Per group, per segment of ``layout.segments[g]``: ``(uint8 [num_gpu_blocks, nbytes]
    view, cpu_offset)``.

    ``kv_caches[g][layer]`` is, for an attention group, ``[2, num_blocks, block_size, heads,
    head_dim]`` (``attn_layout="flash_attn"``) or ``[num_blocks, 2, ...]`` (``"flashinfer"``);
    for a Mamba group a pair ``(conv [num_blocks, *conv_shape], ssm [num_blocks, *ssm_shape])``.
    Any dtype is accepted whose bytes per block match the layout. Raises ``ValueError`` naming the
    tensor that does not fit.
    """
    if attn_layout not in ATTN_LAYOUTS:
        raise ValueError(f"attn_layout must be one of {ATTN_LAYOUTS}, got {attn_layout!r}")
    if len(kv_caches) != layout.num_groups:
        raise ValueError(f"kv_caches has {len(kv_caches)} groups, the layout has "
                         f"{layout.num_groups}")
    device = None
    out = []
    for g, (spec, segs) in enumerate(zip(layout.groups, layout.segments, strict=True)):
        layers = kv_caches[g]
        if len(layers) != spec.num_layers:
            raise ValueError(f"kv_caches[{g}] has {len(layers)} layers, group {g} has "
                             f"{spec.num_layers}")
        views = []
        for seg in segs:
            entry = layers[seg.layer]
            name = f"kv_caches[{g}][{seg.layer}]"
            if spec.kind == "mamba":
                if not isinstance(entry, tuple | list) or len(entry) != 2:
                    raise ValueError(f"{name} must be a (conv, ssm) pair for a Mamba group")
                part = entry[_MAMBA_PART[seg.part]]
                name = f"{name}[{_MAMBA_PART[seg.part]}] ({seg.part})"
            else:
                if not isinstance(entry, torch.Tensor) or entry.dim() != 5:
                    shape = tuple(entry.shape) if isinstance(entry, torch.Tensor) else entry
                    raise ValueError(f"{name} must be a 5-D attention tensor, got {shape!r}")
                i = _ATTN_PART[seg.part]
                if attn_layout == "flash_attn":
                    if entry.shape[0] != 2:
                        raise ValueError(f"{name} must be [2, num_blocks, ...] (flash_attn), got "
                                         f"shape {tuple(entry.shape)}")
                    part = entry[i]
                else:
                    if entry.shape[1] != 2:
                        raise ValueError(f"{name} must be [num_blocks, 2, ...] (flashinfer), got "
                                         f"shape {tuple(entry.shape)}")
                    part = entry[:, i]
                name = f"{name} ({seg.part})"
            if not isinstance(part, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(part).__name__}")
            if device is None:
                device = part.device
            elif part.device != device:
                raise ValueError(f"{name} is on {part.device}, other KV tensors on {device}")
            views.append((_block_bytes_view(name, part, seg.nbytes), seg.cpu_offset))
        n_blocks = {v.shape[0] for v, _ in views}
        if len(n_blocks) > 1:
            raise ValueError(f"kv_caches[{g}]: layers disagree on num_blocks: {sorted(n_blocks)}")
        out.append(views)
    return out


def _width(*values: int) -> int:
    g = math.gcd(*values)
    return next(w for w in WIDTHS if g % w == 0)


def build_copy_table(layout: KVLayout, segments: Sequence[Sequence[tuple[torch.Tensor, int]]],
                     chunk_bytes: int = CHUNK_BYTES) -> CopyTable:
    """The Triton kernel's int64 tables for ``segments`` (from ``segment_views``), on their
    device. Each row gets the widest access (16, 4 or 1 bytes) its addresses, stride, size and
    CPU offset allow; segments larger than ``chunk_bytes`` are split into several work units."""
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    cpu_block_bytes = layout.cpu_block_bytes
    rows, units, group_units = [], [], []
    for segs in segments:
        first_unit = len(units)
        for view, offset in segs:
            base = view.data_ptr()
            stride = view.stride(0)
            nbytes = view.shape[1]
            r = len(rows)
            rows.append((base, stride, nbytes, offset,
                         _width(base, stride, nbytes, offset, cpu_block_bytes)))
            units.extend((r, s, min(chunk_bytes, nbytes - s))
                         for s in range(0, nbytes, chunk_bytes))
        group_units.append((first_unit, len(units) - first_unit))
    device = segments[0][0][0].device
    return CopyTable(
        rows=torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(device),
        units=torch.tensor(units, dtype=torch.int64).reshape(-1, 3).to(device),
        group_units_host=np.asarray(group_units, dtype=np.int64).reshape(-1, 2),
        num_gpu_blocks=tuple(int(segs[0][0].shape[0]) for segs in segments),
        cpu_block_bytes=cpu_block_bytes,
        device=device,
    )


def allocate_kv_caches(layout: KVLayout, num_gpu_blocks: int, *, attn_layout: str = "flash_attn",
                       device: torch.device | str = "cpu") -> list[list]:
    """Empty KV tensors for ``layout`` in the shapes ``TransferEngine`` registers: per group, per
    layer, an attention tensor in ``attn_layout`` or a Mamba ``(conv, ssm)`` pair, each with
    ``num_gpu_blocks`` blocks (for tests, benchmarks and simulations)."""
    if attn_layout not in ATTN_LAYOUTS:
        raise ValueError(f"attn_layout must be one of {ATTN_LAYOUTS}, got {attn_layout!r}")
    if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
        raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
    caches: list[list] = []
    for spec in layout.groups:
        layers: list = []
        for _ in range(spec.num_layers):
            if spec.kind == "mamba":
                (_, _, conv_shape, conv_dtype), (_, _, ssm_shape, ssm_dtype) = spec.segment_parts()
                layers.append((
                    torch.empty((num_gpu_blocks, *conv_shape), dtype=conv_dtype, device=device),
                    torch.empty((num_gpu_blocks, *ssm_shape), dtype=ssm_dtype, device=device),
                ))
            else:
                lead = (2, num_gpu_blocks) if attn_layout == "flash_attn" else (num_gpu_blocks, 2)
                layers.append(torch.empty((*lead, *spec.page_shape), dtype=spec.dtype,
                                          device=device))
        caches.append(layers)
    return caches
