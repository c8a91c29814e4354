"""From a layout's KV tensors to the copy kernels' tables, built once per engine.

``segment_views`` checks the registered tensors against the layout and returns, per group and per
segment, a ``[num_gpu_blocks, nbytes]`` uint8 view (no copy) with the segment's CPU offset: the
torch and copy-engine backends copy through these views, and ``build_copy_table`` reads the GPU
base address and block stride of each one into the int64 descriptor rows of the Triton kernel.

A segment's bytes of one block are opaque: any tensor layout is accepted in which each block is
one dense byte range (the block's elements fill ``nbytes`` consecutive bytes, in whatever order
the strides put them), so vLLM's HND stride order ``(0, 1, 3, 2, 4)`` registers as it is
allocated, a permuted view that is not a contiguous logical view.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvtriton.kernels.copy_blocks import CHUNK_BYTES, WIDTHS
from kvtriton.kernels.pairs import CopyTable
from kvtriton.specs import KVLayout
from kvtriton.validation import is_int

__all__ = ["ATTN_LAYOUTS", "allocate_kv_caches", "build_copy_table", "segment_views"]

# How an attention layer's tensor holds K and V (see segment_views), with vLLM's logical shapes:
#   flash_attn   [2, num_blocks, ...]  FlashAttention (2, num_blocks, block_size, heads, head)
#   flashinfer   [num_blocks, 2, ...]  FlashInfer (num_blocks, 2, block_size, heads, head)
#   block_major  [num_blocks, ...]     one dense range per block holding K and V (vLLM's CPU
#                                      platform: (num_blocks, heads, block_size, 2 * head))
ATTN_LAYOUTS = ("flash_attn", "flashinfer", "block_major")
_ATTN_PART = {"k": 0, "v": 1}
_MAMBA_PART = {"conv": 0, "ssm": 1}


def _dense_blocks(x: torch.Tensor) -> bool:
    """Whether every ``x[b]`` fills one dense range of ``x[b].numel()`` elements: its non-unit
    dims, sorted by stride, are those of a contiguous tensor (any permutation of one)."""
    expect = 1
    for stride, size in sorted((st, sz) for st, sz in zip(x.stride()[1:], x.shape[1:],
                                                          strict=True) if sz != 1):
        if stride != expect:
            return False
        expect *= size
    return True


def _block_bytes_view(name: str, x: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``x`` ``[num_blocks, ...]`` as ``[num_blocks, nbytes]`` uint8, sharing storage; row b is
    block b's byte range, whatever order the strides give its elements."""
    if x.dim() < 2:
        raise ValueError(f"{name} must be [num_blocks, ...], got shape {tuple(x.shape)}")
    per_block = x.shape[1:].numel() * x.element_size()
    if per_block != nbytes:
        raise ValueError(f"{name} holds {per_block} bytes per block ({x.dtype} "
                         f"{tuple(x.shape[1:])}), the layout expects {nbytes}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} has no blocks")
    if not _dense_blocks(x):
        raise ValueError(f"{name}: each block must be one dense byte range, got strides "
                         f"{x.stride()} for shape {tuple(x.shape)}")
    es = x.element_size()
    if x.shape[0] > 1 and x.stride(0) * es < nbytes:
        raise ValueError(f"{name}: block stride {x.stride(0)} elements overlaps the "
                         f"{nbytes}-byte blocks")
    # Bytes straight from the storage, never reshape: a copy would silently detach the engine
    # from the KV cache, and a permuted (HND) view has no uint8 view of its logical shape.
    # With all strides positive, element 0 of block b is that block's lowest address.
    out = torch.empty(0, dtype=torch.uint8, device=x.device)
    return out.set_(x.untyped_storage(), x.storage_offset() * es, (x.shape[0], nbytes),
                    (x.stride(0) * es, 1))


def _attention_part(name: str, entry, part: str, attn_layout: str, page_bytes: int
                    ) -> torch.Tensor:
    """Segment ``part`` (``"k"`` or ``"v"``) of one attention layer as a uint8 block view."""
    i = _ATTN_PART[part]
    if not isinstance(entry, torch.Tensor):
        raise ValueError(f"{name} must be an attention tensor, got {type(entry).__name__}")
    if attn_layout == "block_major":
        # K and V share each block's range; which bytes are K is the backend's business, the
        # copy only has to keep the range whole, so the first page_bytes go with segment "k".
        whole = _block_bytes_view(name, entry, 2 * page_bytes)
        return whole[:, i * page_bytes:(i + 1) * page_bytes]
    if entry.dim() < 3:
        raise ValueError(f"{name} must be at least 3-D ({attn_layout}), got shape "
                         f"{tuple(entry.shape)}")
    kv_dim = 0 if attn_layout == "flash_attn" else 1
    if entry.shape[kv_dim] != 2:
        lead = "[2, num_blocks, ...]" if kv_dim == 0 else "[num_blocks, 2, ...]"
        raise ValueError(f"{name} must be {lead} ({attn_layout}), got shape "
                         f"{tuple(entry.shape)}")
    return _block_bytes_view(f"{name} ({part})", entry.select(kv_dim, i), page_bytes)


def segment_views(layout: KVLayout, kv_caches: Sequence, attn_layout: str = "flash_attn"
                  ) -> list[list[tuple[torch.Tensor, int]]]:
    """Per group, per segment of ``layout.segments[g]``: ``(uint8 [num_gpu_blocks, nbytes]
    view, cpu_offset)``.

    ``kv_caches[g][layer]`` is, for an attention group, one tensor per layer in ``attn_layout``
    (``ATTN_LAYOUTS``): ``[2, num_blocks, ...]`` (``"flash_attn"``), ``[num_blocks, 2, ...]``
    (``"flashinfer"``) or ``[num_blocks, ...]`` holding K and V together (``"block_major"``);
    for a Mamba group a pair ``(conv [num_blocks, ...], ssm [num_blocks, ...])``. Any dtype and
    any strides are accepted whose blocks are each one dense byte range of the layout's bytes per
    block. Raises ``ValueError`` naming the tensor that does not fit.
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
                if not isinstance(part, torch.Tensor):
                    raise ValueError(f"{name} must be a tensor, got {type(part).__name__}")
                view = _block_bytes_view(name, part, seg.nbytes)
            else:
                view = _attention_part(name, entry, seg.part, attn_layout, seg.nbytes)
            if device is None:
                device = view.device
            elif view.device != device:
                raise ValueError(f"{name} is on {view.device}, other KV tensors on {device}")
            views.append((view, seg.cpu_offset))
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
    CPU offset allow; segments larger than ``chunk_bytes`` bytes are split into several work
    units; units are ordered by width class, then group, so each launch (one per width) reads
    one range per group."""
    if not isinstance(chunk_bytes, int) or chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes!r}")
    cpu_block_bytes = layout.cpu_block_bytes
    rows: list[tuple[int, ...]] = []
    row_groups: list[int] = []
    for g, segs in enumerate(segments):
        for view, offset in segs:
            base = view.data_ptr()
            stride = view.stride(0)
            nbytes = view.shape[1]
            rows.append((base, stride, nbytes, offset,
                         _width(base, stride, nbytes, offset, cpu_block_bytes)))
            row_groups.append(g)
    units: list[tuple[int, int, int]] = []
    group_units = np.zeros((len(WIDTHS), len(segments), 2), dtype=np.int64)
    for w, width in enumerate(WIDTHS):
        for g in range(len(segments)):
            first = len(units)
            for r, row in enumerate(rows):
                if row_groups[r] == g and row[4] == width:
                    units.extend((r, s, min(chunk_bytes, row[2] - s))
                                 for s in range(0, row[2], chunk_bytes))
            group_units[w, g] = (first, len(units) - first)
    device = segments[0][0][0].device
    return CopyTable(
        rows=torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(device),
        units=torch.tensor(units, dtype=torch.int64).reshape(-1, 3).to(device),
        group_units_host=group_units,
        num_gpu_blocks=tuple(int(segs[0][0].shape[0]) for segs in segments),
        cpu_block_bytes=cpu_block_bytes,
        device=device,
    )


def _attention_shape(spec, num_gpu_blocks: int, attn_layout: str) -> tuple[int, ...]:
    block_size, heads, head = spec.page_shape
    if attn_layout == "flash_attn":
        return (2, num_gpu_blocks, block_size, heads, head)
    if attn_layout == "flashinfer":
        return (num_gpu_blocks, 2, block_size, heads, head)
    return (num_gpu_blocks, heads, block_size, 2 * head)


def allocate_kv_caches(layout: KVLayout, num_gpu_blocks: int, *, attn_layout: str = "flash_attn",
                       stride_order: Sequence[int] | None = None,
                       device: torch.device | str = "cpu") -> list[list]:
    """Empty KV tensors for ``layout`` in the shapes ``TransferEngine`` registers: per group, per
    layer, an attention tensor in ``attn_layout`` or a Mamba ``(conv, ssm)`` pair, each with
    ``num_gpu_blocks`` blocks (for tests, benchmarks and simulations).

    Attention tensors have the logical shape of their layout: ``(2, num_blocks, block_size,
    heads, head)`` (flash_attn), ``(num_blocks, 2, block_size, heads, head)`` (flashinfer) or
    ``(num_blocks, heads, block_size, 2 * head)`` (block_major). ``stride_order`` allocates them
    as vLLM does for a backend's ``get_kv_cache_stride_order()``: memory in the permuted order,
    returned as a permuted view of the logical shape (``(0, 1, 3, 2, 4)`` is HND).
    """
    if attn_layout not in ATTN_LAYOUTS:
        raise ValueError(f"attn_layout must be one of {ATTN_LAYOUTS}, got {attn_layout!r}")
    if not is_int(num_gpu_blocks) or num_gpu_blocks <= 0:
        raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
    ndim = 4 if attn_layout == "block_major" else 5
    if stride_order is not None and sorted(stride_order) != list(range(ndim)):
        raise ValueError(f"stride_order must be a permutation of range({ndim}) for "
                         f"{attn_layout}, got {tuple(stride_order)!r}")
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
                continue
            shape = _attention_shape(spec, num_gpu_blocks, attn_layout)
            if stride_order is None:
                layers.append(torch.empty(shape, dtype=spec.dtype, device=device))
                continue
            order = tuple(stride_order)
            physical = torch.empty(tuple(shape[i] for i in order), dtype=spec.dtype,
                                   device=device)
            layers.append(physical.permute(*(order.index(i) for i in range(ndim))))
        caches.append(layers)
    return caches
