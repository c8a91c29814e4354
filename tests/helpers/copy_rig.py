"""A rig for the copy-kernel tests: KV tensors of one case on the lane's device, their segment
views and a sentinel CPU pool the lane's kernel can address, with the cases (every group kind,
dtypes paired with head sizes, both block sizes and both attention layouts) and the pairs each
direction copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from helpers.device_lane import host_pool, synchronize
from kvtriton.engine import allocate_kv_caches, build_copy_table, segment_views
from kvtriton.kernels.copy_blocks import copy_blocks
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

SENTINEL = 0xA5
FP8 = torch.uint8  # fp8 KV caches are registered as their uint8 bits


def _full(bs, heads, head, layers, dtype):
    return FullAttentionSpec(bs, heads, head, layers, dtype=dtype)


# (groups, attn_layout): each group kind, dtypes paired with head sizes, both block sizes and
# both attention layouts; widths 16, 4 and 1 all occur (the Mamba states are 4- and 1-aligned).
CASES = {
    "full-fp16-h64-bs16-fa": ([_full(16, 2, 64, 2, torch.float16)], "flash_attn"),
    "full-bf16-h80-bs32-fi": ([_full(32, 4, 80, 3, torch.bfloat16)], "flashinfer"),
    "full-fp32-h128-bs16-fi": ([_full(16, 2, 128, 1, torch.float32)], "flashinfer"),
    "full-fp8-h256-bs32-fa": ([_full(32, 1, 256, 2, FP8)], "flash_attn"),
    "swa+full-bf16-h128-fa": (
        [_full(16, 1, 128, 1, torch.bfloat16),
         SlidingWindowSpec(16, 2, 128, 3, sliding_window=64, dtype=torch.bfloat16)],
        "flash_attn",
    ),
    "mamba+full-fp16-fp32-fi": (
        [_full(16, 1, 64, 2, torch.float16),
         MambaSpec(32, (10, 3), (2, 4, 8), 2, dtype=torch.float16, ssm_dtype=torch.float32)],
        "flashinfer",
    ),
    "mamba-uint8-odd": ([MambaSpec(16, (5, 3), (7, 3), 3, dtype=torch.uint8)], "flash_attn"),
}

NUM_GPU_BLOCKS = 6
NUM_CPU_BLOCKS = 6


def random_bytes(t: torch.Tensor, low: int = 0) -> None:
    t.view(torch.uint8).random_(low, 256)


def tensors(caches) -> list[torch.Tensor]:
    out = []
    for layers in caches:
        for entry in layers:
            out.extend(entry if isinstance(entry, tuple) else [entry])
    return out


@dataclass
class Rig:
    """KV tensors of one case on the lane's device, their segment views and a sentinel pool the
    lane's kernel can address (``pool_ptr``: its device address)."""

    layout: KVLayout
    caches: list
    segments: list
    pool: torch.Tensor
    pool_ptr: int

    def table(self, **kwargs):
        return build_copy_table(self.layout, self.segments, **kwargs)

    def copy(self, direction: str, *ids, table=None, **kwargs) -> int:
        """The Triton launcher on this rig's pool; synchronized, so the host may compare."""
        n = copy_blocks(direction, table or self.table(), self.pool, *ids,
                        cpu_pool_device_ptr=self.pool_ptr, **kwargs)
        synchronize()
        return n


def setup_rig(case: str, device, num_gpu_blocks: int = NUM_GPU_BLOCKS,
              num_cpu_blocks: int = NUM_CPU_BLOCKS) -> Rig:
    groups, attn_layout = CASES[case]
    layout = KVLayout(groups)
    caches = allocate_kv_caches(layout, num_gpu_blocks, attn_layout=attn_layout, device=device)
    for t in tensors(caches):
        random_bytes(t)
    segments = segment_views(layout, caches, attn_layout)
    hp = host_pool(num_cpu_blocks, layout.cpu_block_bytes)
    hp.tensor.fill_(SENTINEL)
    return Rig(layout, caches, segments, hp.tensor, hp.device_ptr)


def store_pairs(layout: KVLayout):
    """Every group, GPU block 0 and the last one, the pool's last block, GPU block 1 stored three
    times (a repeated source); CPU block 4 stays untouched."""
    grp = [0] * 5 if layout.num_groups == 1 else [0, 1, 1, 0, 0]
    return [NUM_GPU_BLOCKS - 1, 1, 1, 0, 1], [NUM_CPU_BLOCKS - 1, 0, 2, 3, 1], grp


def load_pairs(layout: KVLayout):
    """Distinct destinations, CPU block 0 loaded twice (a repeated source)."""
    grp = [0] * 5 if layout.num_groups == 1 else [0, 1, 1, 0, 0]
    return [NUM_GPU_BLOCKS - 1, 1, 2, 0, 3], [NUM_CPU_BLOCKS - 1, 0, 0, 3, 1], grp


def snapshot(caches) -> list[torch.Tensor]:
    return [t.clone() for t in tensors(caches)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b, strict=True))


def rebuild(caches, flat: list[torch.Tensor]):
    """The structure of ``caches`` over the tensors of ``flat`` (in ``tensors`` order)."""
    it = iter(flat)
    return [[(next(it), next(it)) if isinstance(e, tuple) else next(it) for e in layers]
            for layers in caches]
