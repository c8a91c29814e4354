"""The copy kernel (``kvtriton.kernels.copy_blocks``), bit-exact on the lane's device, beside the
two other backends (the copy-engine path and the torch references) held to the same check.

The KV tensors live on the ``device`` fixture (CPU with the kernel under ``TRITON_INTERPRET=1``
here, CUDA on a GPU box): the same tests in both lanes. Every check compares the whole destination,
pre-filled with a sentinel, against the per-block loop reference, so both stray and missing writes
fail. The rig (``helpers.copy_rig``) holds the cases and the pairs.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from helpers.copy_rig import (
    CASES,
    NUM_CPU_BLOCKS,
    NUM_GPU_BLOCKS,
    SENTINEL,
    Rig,
    load_pairs,
    random_bytes,
    rebuild,
    same,
    setup_rig,
    snapshot,
    store_pairs,
    tensors,
)
from helpers.device_lane import host_pool, synchronize
from kvtriton.engine import allocate_kv_caches, segment_views
from kvtriton.engine.copy_engine import build_piece_table, copy_pieces
from kvtriton.kernels.copy_blocks import WIDTHS, copy_blocks, prepare_copy
from kvtriton.kernels.reference import (
    load_blocks_loop,
    load_blocks_ref,
    store_blocks_loop,
    store_blocks_ref,
)
from kvtriton.specs import FullAttentionSpec, KVLayout

pytestmark = pytest.mark.device_lane


def _ids(*ids):
    return [np.asarray(x, dtype=np.int64) for x in ids]


def _run_triton(direction, rig, ids, sm_budget):
    rig.copy(direction, *ids, sm_budget=sm_budget)


def _run_copy_engine(direction, rig, ids, sm_budget):
    copy_pieces(direction, build_piece_table(rig.segments), rig.pool, *_ids(*ids),
                non_blocking=True)
    synchronize()


def _run_torch(direction, rig, ids, sm_budget):
    fn = store_blocks_ref if direction == "store" else load_blocks_ref
    fn(rig.segments, rig.pool, *ids)
    synchronize()


BACKENDS = {"triton": _run_triton, "copy_engine": _run_copy_engine, "torch": _run_torch}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_store_matches_loop_reference(case, backend, device):
    rig = setup_rig(case, device)
    ids = store_pairs(rig.layout)
    expected = rig.pool.clone()
    store_blocks_loop(rig.segments, expected, *ids)
    before = snapshot(rig.caches)

    sm_budget = 1 + len(case) % 5  # a few grid sizes across cases
    BACKENDS[backend]("store", rig, ids, sm_budget)

    assert torch.equal(rig.pool, expected)
    assert same(tensors(rig.caches), before), "a store wrote to the GPU side"
    assert not torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_load_matches_loop_reference(case, backend, device):
    rig = setup_rig(case, device)
    random_bytes(rig.pool)
    for t in tensors(rig.caches):
        t.view(torch.uint8).fill_(SENTINEL)
    ids = load_pairs(rig.layout)
    sentinel = snapshot(rig.caches)
    expected = [t.clone() for t in tensors(rig.caches)]
    exp_segments = segment_views(rig.layout, rebuild(rig.caches, expected), CASES[case][1])
    load_blocks_loop(exp_segments, rig.pool, *ids)
    pool_before = rig.pool.clone()

    BACKENDS[backend]("load", rig, ids, 3)

    assert same(tensors(rig.caches), expected)
    assert not same(tensors(rig.caches), sentinel), "nothing was loaded"
    assert torch.equal(rig.pool, pool_before), "a load wrote to the CPU pool"


@pytest.mark.parametrize("case", ["swa+full-bf16-h128-fa", "mamba+full-fp16-fp32-fi"])
def test_store_then_load_round_trip(case, device):
    rig = setup_rig(case, device)
    table = rig.table()
    original = snapshot(rig.caches)
    src = [NUM_GPU_BLOCKS - 1, 2]
    for g in range(rig.layout.num_groups):
        cpu = [2 * g, 2 * g + 1]
        rig.copy("store", src, cpu, [g, g], table=table, sm_budget=4)
        for view, _ in rig.segments[g]:
            view[src] = SENTINEL  # index_put: view[list] would be a copy
        assert not same(tensors(rig.caches), original), "negative control: blocks cleared"
        rig.copy("load", src, cpu, [g, g], table=table, sm_budget=4)
    assert same(tensors(rig.caches), original)


def test_chunked_units_and_small_tiles_match(device):
    """Segments cut into many units (odd tail chunks) and tiles smaller than a segment."""
    rig = setup_rig("mamba+full-fp16-fp32-fi", device)
    table = rig.table(chunk_bytes=48)
    assert table.units.shape[0] > sum(len(s) for s in rig.segments)
    ids = store_pairs(rig.layout)
    expected = rig.pool.clone()
    store_blocks_loop(rig.segments, expected, *ids)
    rig.copy("store", *ids, table=table, sm_budget=5, tile_bytes=64)
    assert torch.equal(rig.pool, expected)


def test_access_widths_follow_alignment(device):
    rig = setup_rig("mamba+full-fp16-fp32-fi", device)
    widths = rig.table().rows[:, 4].tolist()
    # Attention pages are 16-byte multiples; the 60-byte conv state pushes offsets to 4 bytes.
    assert widths == [16] * 4 + [4] * 4
    rig = setup_rig("mamba-uint8-odd", device)
    assert set(rig.table().rows[:, 4].tolist()) == {1}


@pytest.mark.parametrize(("case", "widths"), [
    ("full-fp16-h64-bs16-fa", (16,)),
    ("mamba+full-fp16-fp32-fi", (16, 4)),
    ("mamba-uint8-odd", (1,)),
])
def test_one_launch_per_width_class_present(case, widths, device):
    """The access width is a constexpr of the launch: a step launches once per width class its
    groups need, never a kernel that branches over widths at run time."""
    rig = setup_rig(case, device)
    table = rig.table()
    launch = prepare_copy("store", table, rig.pool, *store_pairs(rig.layout), sm_budget=64,
                          cpu_pool_device_ptr=rig.pool_ptr)
    assert tuple(WIDTHS[w] for w, _ in launch.grids) == widths
    units = table.units.cpu()
    rows = table.rows.cpu()
    for w, width in enumerate(WIDTHS):  # each class's unit ranges hold only rows of its width
        for start, count in table.group_units_host[w].tolist():
            assert set(rows[units[start:start + count, 0], 4].tolist()) <= {width}
    # Only the first group's pairs: the width classes of the other group launch nothing.
    only_attention = prepare_copy("store", table, rig.pool, [1], [0], [0],
                                  cpu_pool_device_ptr=rig.pool_ptr)
    assert [WIDTHS[w] for w, _ in only_attention.grids] == [widths[0]]


def test_zero_pairs_touch_nothing(device):
    rig = setup_rig("swa+full-bf16-h128-fa", device)
    before = snapshot(rig.caches)
    assert rig.copy("store", [], [], []) == 0
    assert rig.copy("load", np.zeros(0, np.int64), [], []) == 0
    assert torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))
    assert same(tensors(rig.caches), before)


def test_one_pair_last_blocks(device):
    rig = setup_rig("full-fp32-h128-bs16-fi", device)
    expected = rig.pool.clone()
    store_blocks_loop(rig.segments, expected, [NUM_GPU_BLOCKS - 1], [NUM_CPU_BLOCKS - 1], [0])
    rig.copy("store", torch.tensor([NUM_GPU_BLOCKS - 1]), torch.tensor([NUM_CPU_BLOCKS - 1]),
             torch.tensor([0]), sm_budget=64)
    assert torch.equal(rig.pool, expected)


def test_offset_past_2_gib_uses_int64_addressing(device):
    """A pool just over 2 GiB: the last CPU blocks start past 2^31 bytes."""
    layout = KVLayout([FullAttentionSpec(16, 1, 128, 8, dtype=torch.float16)])  # 64 KiB blocks
    block = layout.cpu_block_bytes
    num_cpu = 2**31 // block + 3
    last = num_cpu - 1
    assert last * block > 2**31
    caches = allocate_kv_caches(layout, 4, device=device)
    for t in tensors(caches):
        random_bytes(t, low=1)  # no zero bytes: the untouched pool stays all zero
    segments = segment_views(layout, caches)
    # Freshly mapped pages read as zero without being committed: the sentinel here is 0.
    hp = host_pool(num_cpu, block)
    rig = Rig(layout, caches, segments, hp.tensor, hp.device_ptr)
    pool = hp.tensor
    try:
        cpu = [last, 2**31 // block, 5]
        rig.copy("store", [0, 1, 2], cpu, [0, 0, 0], sm_budget=3)
        expected = torch.zeros((3, block), dtype=torch.uint8)
        store_blocks_loop(segments, expected, [0, 1, 2], [0, 1, 2], [0, 0, 0])
        for i, c in enumerate(cpu):
            assert torch.equal(pool[c], expected[i])
        edges = [0, *sorted(cpu), num_cpu]
        for lo, hi in itertools.pairwise(edges):
            rest = pool[lo + (lo > 0):hi]
            if rest.numel():
                assert torch.aminmax(rest) == (0, 0), f"stray write in blocks [{lo}, {hi})"
        for view, _ in segments[0]:
            assert not torch.equal(view[3], view[0]), "negative control: blocks 0 and 3 differ"
        rig.copy("load", [3], [last], [0])
        for view, _ in segments[0]:
            assert torch.equal(view[3], view[0])
    finally:
        del pool, rig, hp


def _error_cases(n_gpu, n_cpu):
    ok = ([0], [0], [0])
    return {
        "unequal-lengths": (("store", *ok[:2], [0, 0]), "equal lengths"),
        "gpu-id-high": (("store", [n_gpu], [0], [0]), f"gpu_blocks[0]={n_gpu}"),
        "gpu-id-negative": (("load", [-1], [0], [0]), "gpu_blocks[0]=-1"),
        "cpu-id-high": (("store", [0, 1], [0, n_cpu], [0, 0]), f"cpu_blocks[1]={n_cpu}"),
        "group-high": (("store", [0], [0], [2]), "groups[0]=2"),
        "float-ids": (("store", [0.0], [0], [0]), "integers"),
        "2d-ids": (("store", [[0]], [0], [0]), "1-D"),
        "dup-store-dest": (("store", [0, 1], [3, 3], [0, 0]), "cpu_blocks[0]=3"),
        "dup-load-dest": (("load", [2, 2], [0, 1], [1, 1]), "gpu_blocks[0]=2 (group 1)"),
        "bad-direction": (("swap", *ok), "'swap'"),
    }


@pytest.mark.parametrize("name", list(_error_cases(NUM_GPU_BLOCKS, NUM_CPU_BLOCKS)))
def test_launcher_rejects_bad_input_and_writes_nothing(name, device):
    rig = setup_rig("swa+full-bf16-h128-fa", device)
    before = snapshot(rig.caches)
    args, message = _error_cases(NUM_GPU_BLOCKS, NUM_CPU_BLOCKS)[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        rig.copy(*args)
    assert torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))
    assert same(tensors(rig.caches), before)


def test_launcher_rejects_bad_pool_budget_and_tiles(device):
    rig = setup_rig("full-fp16-h64-bs16-fa", device)
    table = rig.table()
    pool = rig.pool
    ids = ([0], [0], [0])
    raw = torch.zeros(pool.numel() + 16, dtype=torch.uint8)
    bad_pools = {
        "2-D uint8": pool.view(torch.int16),
        "row bytes": pool[:, :-16],
        "aligned": raw[1:1 + pool.numel()].view(pool.shape),
    }
    for message, bad in bad_pools.items():
        with pytest.raises(ValueError, match=message):
            copy_blocks("store", table, bad, *ids)
    with pytest.raises(ValueError, match="contiguous"):
        copy_blocks("store", table, torch.zeros(pool.shape[1], pool.shape[0],
                                                dtype=torch.uint8).t(), *ids)
    for budget in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=rf"sm_budget.*{budget!r}"):
            rig.copy("store", *ids, sm_budget=budget)
    for tile in (0, 8, 48, 100.0):
        with pytest.raises(ValueError, match=rf"tile_bytes.*{tile!r}"):
            rig.copy("store", *ids, tile_bytes=tile)
    with pytest.raises(ValueError, match=r"num_warps must be .* got 3"):
        rig.copy("store", *ids, num_warps=3)
    for ptr in (rig.pool_ptr + 4, 0):
        with pytest.raises(ValueError, match=rf"cpu_pool_device_ptr.*{ptr}"):
            copy_blocks("store", table, pool, *ids, cpu_pool_device_ptr=ptr)
    assert raw.count_nonzero() == 0 and torch.equal(pool, torch.full_like(pool, SENTINEL))
