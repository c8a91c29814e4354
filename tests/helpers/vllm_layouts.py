"""KV caches laid out as vLLM allocates them, for the engine tests.

Each attention layout is built the way vLLM's ``_reshape_kv_cache_tensors`` builds it: memory in
the backend's ``get_kv_cache_stride_order()`` (HND is ``(0, 1, 3, 2, 4)``), returned as a permuted
view of the logical shape, which is not a contiguous view. ``layout_engine`` registers such
caches, filled with random bytes, with a ``TransferEngine`` whose CPU pool holds ``SENTINEL``.
"""

from __future__ import annotations

import torch

from kvtriton import TransferEngine
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

SENTINEL = 0x3C
NUM_GPU_BLOCKS = 7
NUM_CPU_BLOCKS = 6
NHD = (0, 1, 2, 3, 4)
HND = (0, 1, 3, 2, 4)
# block_size 16 and 4 heads, so that HND and NHD put different bytes at each address.
LAYOUT = KVLayout([
    FullAttentionSpec(16, 4, 64, 2, dtype=torch.bfloat16),
    SlidingWindowSpec(16, 2, 80, 1, sliding_window=32, dtype=torch.float16),
])

HYBRID = KVLayout([FullAttentionSpec(16, 2, 64, 1, dtype=torch.float16),
                   MambaSpec(32, (6, 3), (2, 4, 8), 2, dtype=torch.float16,
                             ssm_dtype=torch.float32)])


def vllm_attention(shape, stride_order, dtype, device) -> torch.Tensor:
    """As vLLM allocates one layer: memory in ``stride_order``, a view in the logical order."""
    physical = torch.empty([shape[i] for i in stride_order], dtype=dtype, device=device)
    return physical.permute(*[stride_order.index(i) for i in range(len(shape))])


def kv_shape(spec, attn_layout: str, n: int) -> tuple[int, ...]:
    bs, heads, head = spec.page_shape
    return {"flash_attn": (2, n, bs, heads, head), "flashinfer": (n, 2, bs, heads, head),
            "block_major": (n, heads, bs, 2 * head)}[attn_layout]


# name: (attn_layout, stride order or None for the contiguous shape)
LAYOUTS = {
    "flash_attn-NHD": ("flash_attn", NHD),
    "flash_attn-HND": ("flash_attn", HND),
    "flashinfer-NHD": ("flashinfer", NHD),
    "flashinfer-HND": ("flashinfer", HND),
    "cpu-block-major": ("block_major", None),  # vLLM CPU: (num_blocks, heads, bs, 2 * head)
}


def vllm_caches(layout: KVLayout, name: str, device, n: int = NUM_GPU_BLOCKS) -> list[list]:
    attn_layout, order = LAYOUTS[name]
    caches = []
    for spec in layout.groups:
        if spec.kind == "mamba":
            (_, _, conv, cdt), (_, _, ssm, sdt) = spec.segment_parts()
            # States in another stride order too: each block is still one dense range.
            caches.append([(torch.empty((n, *conv), dtype=cdt, device=device),
                            torch.empty((n, *ssm[::-1]), dtype=sdt, device=device)
                            .permute(0, 3, 2, 1)) for _ in range(spec.num_layers)])
            continue
        shape = kv_shape(spec, attn_layout, n)
        order = order or tuple(range(len(shape)))
        caches.append([vllm_attention(shape, order, spec.dtype, device)
                       for _ in range(spec.num_layers)])
    return caches


def tensors(caches) -> list[torch.Tensor]:
    return [t for layers in caches for e in layers for t in (e if isinstance(e, tuple) else (e,))]


def layout_engine(layout, name, device, backend, **kwargs):
    caches = vllm_caches(layout, name, device)
    for t in tensors(caches):
        fill_random(t)
    engine = TransferEngine(layout, caches, NUM_CPU_BLOCKS, backend=backend,
                            attn_layout=LAYOUTS[name][0], **kwargs)
    engine.cpu_pool.fill_(SENTINEL)
    return engine, caches


def fill_random(t: torch.Tensor) -> None:
    """Random bytes over the tensor's whole storage (a permuted view has no uint8 view)."""
    storage = t.untyped_storage()
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).random_(0, 256)
