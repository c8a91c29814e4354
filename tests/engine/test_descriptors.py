"""KV layouts vLLM really allocates, registered as they are and copied bit-exact by every backend.

Each attention layout is built the way vLLM's ``_reshape_kv_cache_tensors`` builds it: memory in
the backend's ``get_kv_cache_stride_order()`` (HND is ``(0, 1, 3, 2, 4)``), returned as a permuted
view of the logical shape, which is not a contiguous view. A block's bytes are opaque to the copy:
the CPU pool holds them in memory order, whatever the logical order of the elements.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from device_lane import synchronize

from kvtriton import TransferEngine
from kvtriton.engine import allocate_kv_caches, segment_views
from kvtriton.engine.copy_engine import build_piece_table, copy_pieces
from kvtriton.kernels.reference import load_blocks_loop, store_blocks_loop
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.device_lane

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


def _shape(spec, attn_layout: str, n: int) -> tuple[int, ...]:
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
BACKENDS = ("triton", "copy_engine", "auto", "torch")


def _caches(layout: KVLayout, name: str, device, n: int = NUM_GPU_BLOCKS) -> list[list]:
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
        shape = _shape(spec, attn_layout, n)
        order = order or tuple(range(len(shape)))
        caches.append([vllm_attention(shape, order, spec.dtype, device)
                       for _ in range(spec.num_layers)])
    return caches


def _tensors(caches) -> list[torch.Tensor]:
    return [t for layers in caches for e in layers for t in (e if isinstance(e, tuple) else (e,))]


def _engine(layout, name, device, backend, **kwargs):
    caches = _caches(layout, name, device)
    for t in _tensors(caches):
        _fill_random(t)
    engine = TransferEngine(layout, caches, NUM_CPU_BLOCKS, backend=backend,
                            attn_layout=LAYOUTS[name][0], **kwargs)
    engine.cpu_pool.fill_(SENTINEL)
    return engine, caches


def _fill_random(t: torch.Tensor) -> None:
    """Random bytes over the tensor's whole storage (a permuted view has no uint8 view)."""
    storage = t.untyped_storage()
    torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).random_(0, 256)


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
    engine, caches = _engine(layout, name, device, backend, copy_engine_min_piece_bytes=0)
    gpu, cpu, grp = [NUM_GPU_BLOCKS - 1, 2, 2, 0], [NUM_CPU_BLOCKS - 1, 0, 3, 1], [0, 1, 0, 1]
    expected = engine.cpu_pool.clone()
    store_blocks_loop(engine.segments, expected, gpu, cpu, grp)
    before = _clone_caches(caches)
    engine.store(1, gpu, cpu, grp)
    engine.flush()
    assert torch.equal(engine.cpu_pool, expected)
    assert not torch.equal(engine.cpu_pool, torch.full_like(engine.cpu_pool, SENTINEL))
    assert _same(_tensors(caches), _tensors(before)), "a store wrote to the GPU side"

    # Load into other blocks (CPU block 0 twice); every KV tensor compared whole.
    load_gpu, load_cpu, load_grp = [1, 3, 4, 5], [NUM_CPU_BLOCKS - 1, 0, 0, 3], [0, 0, 1, 1]
    target = _clone_caches(caches)
    load_blocks_loop(segment_views(layout, target, LAYOUTS[name][0]), engine.cpu_pool,
                     load_gpu, load_cpu, load_grp)
    assert not _same(_tensors(caches), _tensors(target)), "negative control: the load changes"
    engine.load(2, ["r"], load_gpu, load_cpu, load_grp)
    engine.flush()
    assert _same(_tensors(caches), _tensors(target))
    assert engine.poll() == ([1], ["r"])
    engine.close()


@pytest.mark.parametrize("name", ["flash_attn-HND", "flashinfer-HND", "cpu-block-major"])
def test_a_block_is_copied_as_its_bytes_in_memory_order(name, device):
    """Opaque blocks: the CPU bytes of a segment are the block's bytes as they lie in memory
    (HND order for an HND cache), not its elements in logical order."""
    layout = LAYOUT if name != "cpu-block-major" else HYBRID
    engine, caches = _engine(layout, name, device, "triton")
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
        want = vllm_attention(_shape(LAYOUT.groups[0], attn_layout, 5), HND, torch.bfloat16,
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


@pytest.mark.parametrize(("name", "spans"), [
    ("flash_attn-NHD", [4, 2]),   # K and V in separate halves of the tensor: 2 spans per layer
    ("flashinfer-HND", [2, 1]),   # K then V of a block, adjacent on both sides: 1 per layer
])
def test_copy_engine_merges_adjacent_segments(name, spans, device):
    engine, _ = _engine(LAYOUT, name, device, "torch")
    assert engine.pieces.pieces_per_block.tolist() == spans


def test_copy_engine_coalesces_consecutive_blocks(device):
    """A group whose block is one span as wide as the CPU block: consecutive GPU blocks going to
    consecutive CPU blocks are one copy."""
    layout = KVLayout([FullAttentionSpec(16, 1, 32, 1, dtype=torch.float16)])
    caches = allocate_kv_caches(layout, 8, attn_layout="block_major", device=device)
    _fill_random(caches[0][0])
    segments = segment_views(layout, caches, "block_major")
    table = build_piece_table(segments)
    assert table.pieces_per_block.tolist() == [1]
    pool = torch.full((6, layout.cpu_block_bytes), SENTINEL, dtype=torch.uint8)
    expected = pool.clone()
    ids = [np.asarray(x, dtype=np.int64) for x in ([2, 3, 4, 7], [0, 1, 2, 4], [0, 0, 0, 0])]
    store_blocks_loop(segments, expected, *ids)
    assert copy_pieces("store", table, pool, *ids) == 2  # blocks 2-4 in one run, then 7
    synchronize()
    assert torch.equal(pool, expected)
