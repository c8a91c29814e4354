"""The copy-engine path (``kvtriton.engine.copy_engine``): piece tables built from the layouts
vLLM allocates (adjacent segments merged, consecutive blocks coalesced into one copy), and
``backend="auto"``, which gives a step's groups of large, few pieces to the copy engine and the
rest to the kernel.

Every test runs on the ``device`` fixture (CPU with the kernel interpreted here, CUDA on a GPU
box).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtriton.engine.transfer as transfer_mod
from helpers.device_lane import synchronize
from helpers.vllm_layouts import LAYOUT, fill_random, layout_engine
from kvtriton import TransferEngine
from kvtriton.engine import allocate_kv_caches, segment_views
from kvtriton.engine.copy_engine import (
    COPY_ENGINE_MAX_PIECES,
    COPY_ENGINE_MIN_PIECE_BYTES,
    build_piece_table,
    choose_copy_engine,
    copy_pieces,
)
from kvtriton.kernels.reference import store_blocks_loop
from kvtriton.specs import FullAttentionSpec, KVLayout, SlidingWindowSpec

pytestmark = pytest.mark.device_lane

SENTINEL = 0x5A


# ---- piece tables --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "spans"), [
    ("flash_attn-NHD", [4, 2]),   # K and V in separate halves of the tensor: 2 spans per layer
    ("flashinfer-HND", [2, 1]),   # K then V of a block, adjacent on both sides: 1 per layer
])
def test_copy_engine_merges_adjacent_segments(name, spans, device):
    engine, _ = layout_engine(LAYOUT, name, device, "torch")
    assert engine.pieces.pieces_per_block.tolist() == spans


def test_copy_engine_coalesces_consecutive_blocks(device):
    """A group whose block is one span as wide as the CPU block: consecutive GPU blocks going to
    consecutive CPU blocks are one copy."""
    layout = KVLayout([FullAttentionSpec(16, 1, 32, 1, dtype=torch.float16)])
    caches = allocate_kv_caches(layout, 8, attn_layout="block_major", device=device)
    fill_random(caches[0][0])
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


# ---- backend="auto": the copy engine for large, few pieces; the kernel otherwise -----------------


def test_auto_threshold_is_vllms_measured_crossover():
    """28 KiB: where vLLM PR #42212 measured batched DMA reaching 40-44 GB/s on an H100."""
    assert COPY_ENGINE_MIN_PIECE_BYTES == 28 * 1024
    assert COPY_ENGINE_MAX_PIECES > 0


def _pieces(device):
    """Group 0: 4 pieces of 32 KiB per block; group 1: 2 pieces of 4 KiB."""
    layout = KVLayout([FullAttentionSpec(16, 8, 128, 2, dtype=torch.float16),
                       SlidingWindowSpec(16, 1, 128, 1, sliding_window=32,
                                         dtype=torch.float16)])
    caches = allocate_kv_caches(layout, 4, device=device)
    return layout, build_piece_table(segment_views(layout, caches))


def test_choose_copy_engine_by_piece_size_and_count(device):
    _, table = _pieces(device)
    assert table.piece_bytes.tolist() == [32768, 4096]
    assert table.pieces_per_block.tolist() == [4, 2]
    choose = lambda counts, **kw: choose_copy_engine(table, np.asarray(counts), **kw).tolist()
    assert choose([3, 3]) == [True, False]                       # 4 KiB pieces: the kernel
    assert choose([0, 3]) == [False, False]                      # no pairs, nothing to choose
    assert choose([64, 1]) == [True, False]                      # 256 pieces: within the limit
    assert choose([65, 1]) == [False, False]                     # 260 pieces: host-bound
    assert choose([3, 3], min_piece_bytes=4096) == [True, True]
    # Over the count limit, the group with the smaller pieces goes back to the kernel first.
    assert choose([3, 3], min_piece_bytes=0, max_pieces=12) == [True, False]
    assert choose([3, 3], min_piece_bytes=0, max_pieces=11) == [False, False]
    assert choose([3, 3], min_piece_bytes=33 * 1024) == [False, False]


def test_auto_splits_a_step_between_copy_engine_and_kernel(monkeypatch, device):
    layout, _ = _pieces(device)
    caches = allocate_kv_caches(layout, 4, device=device)
    for layers in caches:
        for t in layers:
            t.view(torch.uint8).random_(0, 256)
    engine = TransferEngine(layout, caches, 6, backend="auto")
    engine.cpu_pool.fill_(SENTINEL)
    calls = []
    for name in ("copy_pieces", "copy_blocks"):
        real = getattr(transfer_mod, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, args[3].tolist(), args[5].tolist()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(transfer_mod, name, spy)
    gpu, cpu, grp = [0, 1, 3, 2], [5, 0, 2, 1], [0, 1, 0, 1]
    expected = engine.cpu_pool.clone()
    store_blocks_loop(engine.segments, expected, gpu, cpu, grp)
    engine.store(0, gpu, cpu, grp)
    engine.flush()
    assert calls == [("copy_pieces", [0, 3], [0, 0]), ("copy_blocks", [1, 2], [1, 1])]
    assert torch.equal(engine.cpu_pool, expected)
    assert engine.copy_engine_groups(grp).tolist() == [True, False]
    # The other backends choose nothing, or everything, whatever the step.
    assert TransferEngine(layout, caches, 6, backend="triton").copy_engine_groups(
        grp).tolist() == [False, False]
    assert TransferEngine(layout, caches, 6, backend="copy_engine").copy_engine_groups(
        grp).tolist() == [True, True]
