"""``segment_views`` (``kvtriton.engine.descriptors``) on the KV layouts vLLM really allocates:
registered as they are, and copied bit-exact by every backend.

The layouts are built as vLLM builds them (``helpers.vllm_layouts``): permuted views of memory
in the attention backend's stride order. A block's bytes are opaque to the copy: the CPU pool
holds them in memory order, whatever the logical order of the elements. Tensors whose blocks are
not dense byte ranges are refused.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.vllm_layouts import (
    HND,
    HYBRID,
    LAYOUT,
    LAYOUTS,
    NUM_CPU_BLOCKS,
    NUM_GPU_BLOCKS,
    SENTINEL,
    kv_shape,
    layout_engine,
    tensors,
    vllm_attention,
)
from kvtriton.engine import allocate_kv_caches, segment_views
from kvtriton.kernels.reference import load_blocks_loop, store_blocks_loop

pytestmark = pytest.mark.device_lane
BACKENDS = ("triton", "copy_engine", "auto", "torch")


def _same(a, b) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
               for x, y in zip(a, b, strict=True))


def _clone_caches(caches):
    """Copies with the same strides (clone keeps a dense permutation), as a reference target."""
    return [[tuple(t.clone() for t in e) if isinstance(e, tuple) else e.clone() for e in layers]
            for layers in caches]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_store_and_load_bit_exact(name, backend, device):
    layout = LAYOUT if name != "cpu-block-major" else HYBRID
    engine, caches = layout_engine(layout, name, device, backend, copy_engine_min_piece_bytes=0)
    gpu, cpu, grp = [NUM_GPU_BLOCKS - 1, 2, 2, 0], [NUM_CPU_BLOCKS - 1, 0, 3, 1], [0, 1, 0, 1]
    expected = engine.cpu_pool.clone()
    store_blocks_loop(engine.segments, expected, gpu, cpu, grp)
    before = _clone_caches(caches)
    engine.store(1, gpu, cpu, grp)
    engine.flush()
    assert torch.equal(engine.cpu_pool, expected)
    assert not torch.equal(engine.cpu_pool, torch.full_like(engine.cpu_pool, SENTINEL))
    assert _same(tensors(caches), tensors(before)), "a store wrote to the GPU side"

    # Load into other blocks (CPU block 0 twice); every KV tensor compared whole.
    load_gpu, load_cpu, load_grp = [1, 3, 4, 5], [NUM_CPU_BLOCKS - 1, 0, 0, 3], [0, 0, 1, 1]
    target = _clone_caches(caches)
    load_blocks_loop(segment_views(layout, target, LAYOUTS[name][0]), engine.cpu_pool,
                     load_gpu, load_cpu, load_grp)
    assert not _same(tensors(caches), tensors(target)), "negative control: the load changes"
    engine.load(2, ["r"], load_gpu, load_cpu, load_grp)
    engine.flush()
    assert _same(tensors(caches), tensors(target))
    assert engine.poll() == ([1], ["r"])
    engine.close()


@pytest.mark.parametrize("name", ["flash_attn-HND", "flashinfer-HND", "cpu-block-major"])
def test_a_block_is_copied_as_its_bytes_in_memory_order(name, device):
    """Opaque blocks: the CPU bytes of a segment are the block's bytes as they lie in memory
    (HND order for an HND cache), not its elements in logical order."""
    layout = LAYOUT if name != "cpu-block-major" else HYBRID
    engine, caches = layout_engine(layout, name, device, "triton")
    engine.store(0, [3], [2], [0])
    engine.flush()
    attn = caches[0][0]
    physical = attn.permute(*LAYOUTS[name][1]) if LAYOUTS[name][1] else attn
    assert physical.is_contiguous()
    page = layout.groups[0].page_bytes
    if name == "cpu-block-major":
        memory = physical[3].reshape(-1).view(torch.uint8)
        assert torch.equal(engine.cpu_pool[2, :2 * page], memory.cpu())
    else:
        for part in (0, 1):
            block = physical[part, 3] if name.startswith("flash_attn") else physical[3, part]
            memory = block.reshape(-1).view(torch.uint8).cpu()
            assert torch.equal(engine.cpu_pool[2, part * page:(part + 1) * page], memory)
        logical = attn[0, 3] if name.startswith("flash_attn") else attn[3, 0]
        assert not torch.equal(engine.cpu_pool[2, :page],
                               logical.contiguous().reshape(-1).view(torch.uint8).cpu()), \
            "negative control: logical order differs from memory order"
    engine.close()


def test_allocate_kv_caches_follows_vllm_stride_order(device):
    for attn_layout in ("flash_attn", "flashinfer"):
        got = allocate_kv_caches(LAYOUT, 5, attn_layout=attn_layout, stride_order=HND,
                                 device=device)[0][0]
        want = vllm_attention(kv_shape(LAYOUT.groups[0], attn_layout, 5), HND, torch.bfloat16,
                              device)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert not got.is_contiguous()
    cpu_layout = allocate_kv_caches(LAYOUT, 5, attn_layout="block_major", device=device)[0][0]
    assert tuple(cpu_layout.shape) == (5, 4, 16, 128) and cpu_layout.is_contiguous()
    with pytest.raises(ValueError, match=re.escape("(0, 1, 2, 2, 4)")):
        allocate_kv_caches(LAYOUT, 5, stride_order=(0, 1, 2, 2, 4), device=device)


def _bad_layouts(device):
    bs, heads, head = LAYOUT.groups[0].page_shape
    wide = torch.empty(2, 4, bs, 2 * heads, head, dtype=torch.bfloat16, device=device)
    ok = allocate_kv_caches(LAYOUT, 4, device=device)
    return {
        # Every other head of a wider tensor: the right bytes per block, not one dense range.
        "strided-heads": (wide[:, :, :, ::2], "each block must be one dense byte range"),
        "overlapping-blocks": (ok[0][0][:, :1].expand(2, 4, bs, heads, head), "overlaps"),
        "kv-dim": (ok[0][0].transpose(0, 1), "must be [2, num_blocks, ...] (flash_attn)"),
        "too-few-dims": (ok[0][0].reshape(2, -1), "at least 3-D"),
    }


@pytest.mark.parametrize("case", ["strided-heads", "overlapping-blocks", "kv-dim", "too-few-dims"])
def test_layouts_without_dense_blocks_are_refused(case, device):
    bad, message = _bad_layouts(device)[case]
    caches = allocate_kv_caches(LAYOUT, 4, device=device)
    caches[0][0] = bad
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        segment_views(LAYOUT, caches)
    assert "kv_caches[0][0]" in str(err.value)
