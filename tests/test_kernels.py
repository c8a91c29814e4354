"""The copy kernel (under ``TRITON_INTERPRET=1`` on CPU) and the torch references, bit-exact.

Every check compares the whole destination, pre-filled with a sentinel, against the per-block
loop reference, so both stray and missing writes fail.
"""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
import torch

from kvtriton.engine import allocate_host_pool, allocate_kv_caches, build_copy_table, segment_views
from kvtriton.kernels.copy_blocks import copy_blocks
from kvtriton.kernels.reference import (
    load_blocks_loop,
    load_blocks_ref,
    store_blocks_loop,
    store_blocks_ref,
)
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


def _random_bytes(t: torch.Tensor, low: int = 0) -> None:
    t.view(torch.uint8).copy_(torch.randint(low, 256, t.view(torch.uint8).shape,
                                            dtype=torch.uint8))


def _tensors(caches) -> list[torch.Tensor]:
    out = []
    for layers in caches:
        for entry in layers:
            out.extend(entry if isinstance(entry, tuple) else [entry])
    return out


def _setup(case: str, num_gpu_blocks: int = NUM_GPU_BLOCKS, num_cpu_blocks: int = NUM_CPU_BLOCKS):
    groups, attn_layout = CASES[case]
    layout = KVLayout(groups)
    caches = allocate_kv_caches(layout, num_gpu_blocks, attn_layout=attn_layout)
    for t in _tensors(caches):
        _random_bytes(t)
    segments = segment_views(layout, caches, attn_layout)
    pool = allocate_host_pool(num_cpu_blocks, layout.cpu_block_bytes, pin=False).tensor
    pool.fill_(SENTINEL)
    return layout, caches, segments, pool


def _store_pairs(layout: KVLayout):
    """Every group, GPU block 0 and the last one, the pool's last block, GPU block 1 stored three
    times (a repeated source); CPU block 4 stays untouched."""
    grp = [0] * 5 if layout.num_groups == 1 else [0, 1, 1, 0, 0]
    return [NUM_GPU_BLOCKS - 1, 1, 1, 0, 1], [NUM_CPU_BLOCKS - 1, 0, 2, 3, 1], grp


def _load_pairs(layout: KVLayout):
    """Distinct destinations, CPU block 0 loaded twice (a repeated source)."""
    grp = [0] * 5 if layout.num_groups == 1 else [0, 1, 1, 0, 0]
    return [NUM_GPU_BLOCKS - 1, 1, 2, 0, 3], [NUM_CPU_BLOCKS - 1, 0, 0, 3, 1], grp


def _snapshot(caches) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(caches)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b, strict=True))


BACKENDS = {
    "triton": lambda d, t, segs, pool, *ids, **kw: copy_blocks(d, t, pool, *ids, **kw),
    "torch": lambda d, t, segs, pool, *ids, **kw: (store_blocks_ref if d == "store"
                                                    else load_blocks_ref)(segs, pool, *ids),
}


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_store_matches_loop_reference(case, backend):
    layout, caches, segments, pool = _setup(case)
    table = build_copy_table(layout, segments)
    gpu, cpu, grp = _store_pairs(layout)
    expected = pool.clone()
    store_blocks_loop(segments, expected, gpu, cpu, grp)
    before = _snapshot(caches)

    sm_budget = 1 + len(case) % 5  # a few grid sizes across cases
    BACKENDS[backend]("store", table, segments, pool, gpu, cpu, grp, sm_budget=sm_budget)

    assert torch.equal(pool, expected)
    assert _same(_tensors(caches), before), "a store wrote to the GPU side"
    assert not torch.equal(pool, torch.full_like(pool, SENTINEL))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_load_matches_loop_reference(case, backend):
    layout, caches, segments, pool = _setup(case)
    _random_bytes(pool)
    for t in _tensors(caches):
        t.view(torch.uint8).fill_(SENTINEL)
    table = build_copy_table(layout, segments)
    gpu, cpu, grp = _load_pairs(layout)
    expected = [t.clone() for t in _tensors(caches)]
    exp_segments = segment_views(layout, _rebuild(caches, expected), CASES[case][1])
    load_blocks_loop(exp_segments, pool, gpu, cpu, grp)
    pool_before = pool.clone()

    BACKENDS[backend]("load", table, segments, pool, gpu, cpu, grp, sm_budget=3)

    assert _same(_tensors(caches), expected)
    assert torch.equal(pool, pool_before), "a load wrote to the CPU pool"


def _rebuild(caches, flat: list[torch.Tensor]):
    """The structure of ``caches`` over the tensors of ``flat`` (in ``_tensors`` order)."""
    it = iter(flat)
    return [[(next(it), next(it)) if isinstance(e, tuple) else next(it) for e in layers]
            for layers in caches]


@pytest.mark.parametrize("case", ["swa+full-bf16-h128-fa", "mamba+full-fp16-fp32-fi"])
def test_store_then_load_round_trip(case):
    layout, caches, segments, pool = _setup(case)
    table = build_copy_table(layout, segments)
    original = _snapshot(caches)
    src = [NUM_GPU_BLOCKS - 1, 2]
    for g in range(layout.num_groups):
        cpu = [2 * g, 2 * g + 1]
        copy_blocks("store", table, pool, src, cpu, [g, g], sm_budget=4)
        for view, _ in segments[g]:
            view[src].fill_(SENTINEL)
        copy_blocks("load", table, pool, src, cpu, [g, g], sm_budget=4)
    assert _same(_tensors(caches), original)


def test_chunked_units_and_small_tiles_match():
    """Segments cut into many units (odd tail chunks) and tiles smaller than a segment."""
    layout, _, segments, pool = _setup("mamba+full-fp16-fp32-fi")
    table = build_copy_table(layout, segments, chunk_bytes=48)
    assert table.units.shape[0] > sum(len(s) for s in segments)
    gpu, cpu, grp = _store_pairs(layout)
    expected = pool.clone()
    store_blocks_loop(segments, expected, gpu, cpu, grp)
    copy_blocks("store", table, pool, gpu, cpu, grp, sm_budget=5, tile_bytes=64)
    assert torch.equal(pool, expected)


def test_access_widths_follow_alignment():
    _, _, segments, _ = _setup("mamba+full-fp16-fp32-fi")
    layout = KVLayout(CASES["mamba+full-fp16-fp32-fi"][0])
    widths = build_copy_table(layout, segments).rows[:, 4].tolist()
    # Attention pages are 16-byte multiples; the 60-byte conv state pushes offsets to 4 bytes.
    assert widths == [16] * 4 + [4] * 4
    layout = KVLayout(CASES["mamba-uint8-odd"][0])
    _, _, segments, _ = _setup("mamba-uint8-odd")
    assert set(build_copy_table(layout, segments).rows[:, 4].tolist()) == {1}


def test_zero_pairs_touch_nothing():
    layout, caches, segments, pool = _setup("swa+full-bf16-h128-fa")
    table = build_copy_table(layout, segments)
    before = _snapshot(caches)
    assert copy_blocks("store", table, pool, [], [], []) == 0
    assert copy_blocks("load", table, pool, np.zeros(0, np.int64), [], []) == 0
    assert torch.equal(pool, torch.full_like(pool, SENTINEL))
    assert _same(_tensors(caches), before)


def test_one_pair_last_blocks():
    layout, _, segments, pool = _setup("full-fp32-h128-bs16-fi")
    table = build_copy_table(layout, segments)
    expected = pool.clone()
    store_blocks_loop(segments, expected, [NUM_GPU_BLOCKS - 1], [NUM_CPU_BLOCKS - 1], [0])
    copy_blocks("store", table, pool, torch.tensor([NUM_GPU_BLOCKS - 1]),
                torch.tensor([NUM_CPU_BLOCKS - 1]), torch.tensor([0]), sm_budget=64)
    assert torch.equal(pool, expected)


def test_offset_past_2_gib_uses_int64_addressing():
    """A pool just over 2 GiB: the last CPU blocks start past 2^31 bytes."""
    layout = KVLayout([FullAttentionSpec(16, 1, 128, 8, dtype=torch.float16)])  # 64 KiB blocks
    block = layout.cpu_block_bytes
    num_cpu = 2**31 // block + 3
    last = num_cpu - 1
    assert last * block > 2**31
    caches = allocate_kv_caches(layout, 4)
    for t in _tensors(caches):
        _random_bytes(t, low=1)  # no zero bytes: the untouched pool stays all zero
    segments = segment_views(layout, caches)
    table = build_copy_table(layout, segments)
    # Freshly mapped pages read as zero without being committed: the sentinel here is 0.
    pool = allocate_host_pool(num_cpu, block, pin=False).tensor
    try:
        cpu = [last, 2**31 // block, 5]
        copy_blocks("store", table, pool, [0, 1, 2], cpu, [0, 0, 0], sm_budget=3)
        expected = torch.zeros((3, block), dtype=torch.uint8)
        store_blocks_loop(segments, expected, [0, 1, 2], [0, 1, 2], [0, 0, 0])
        for i, c in enumerate(cpu):
            assert torch.equal(pool[c], expected[i])
        edges = [0, *sorted(cpu), num_cpu]
        for lo, hi in itertools.pairwise(edges):
            rest = pool[lo + (lo > 0):hi]
            if rest.numel():
                assert torch.aminmax(rest) == (0, 0), f"stray write in blocks [{lo}, {hi})"
        copy_blocks("load", table, pool, [3], [last], [0])
        for view, _ in segments[0]:
            assert torch.equal(view[3], view[0])
    finally:
        del pool


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
def test_launcher_rejects_bad_input_and_writes_nothing(name):
    layout, caches, segments, pool = _setup("swa+full-bf16-h128-fa")
    table = build_copy_table(layout, segments)
    before = _snapshot(caches)
    args, message = _error_cases(NUM_GPU_BLOCKS, NUM_CPU_BLOCKS)[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        copy_blocks(args[0], table, pool, *args[1:])
    assert torch.equal(pool, torch.full_like(pool, SENTINEL))
    assert _same(_tensors(caches), before)


def test_launcher_rejects_bad_pool_and_budget():
    layout, _, segments, pool = _setup("full-fp16-h64-bs16-fa")
    table = build_copy_table(layout, segments)
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
            copy_blocks("store", table, pool, *ids, sm_budget=budget)
    assert raw.count_nonzero() == 0 and torch.equal(pool, torch.full_like(pool, SENTINEL))


def test_vectorized_reference_matches_loop_on_random_schedules():
    layout, caches, segments, pool = _setup("mamba+full-fp16-fp32-fi", 9, 12)
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(0, 12))
        cpu = rng.permutation(12)[:n]
        grp = rng.integers(0, layout.num_groups, n)
        gpu = rng.integers(0, 9, n)  # repeated sources allowed
        expected = pool.clone()
        store_blocks_loop(segments, expected, gpu, cpu, grp)
        store_blocks_ref(segments, pool, gpu, cpu, grp)
        assert torch.equal(pool, expected)

        dest = rng.permutation(layout.num_groups * 9)[:n]  # distinct (group, block) destinations
        grp, gpu = dest // 9, dest % 9
        cpu = rng.integers(0, 12, n)
        expected = _snapshot(caches)
        load_blocks_loop(segment_views(layout, _rebuild(caches, expected), "flashinfer"), pool,
                         gpu, cpu, grp)
        load_blocks_ref(segments, pool, gpu, cpu, grp)
        assert _same(_tensors(caches), expected)


@pytest.fixture
def bench_kernels(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from bench import bench_kernels

    return bench_kernels


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_bench_without_gpu_says_so_and_exits_0(bench_kernels, capsys, tmp_path):
    assert bench_kernels.main(["--results-dir", str(tmp_path)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


def test_bench_dry_run_writes_json(bench_kernels, tmp_path):
    assert bench_kernels.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["mode"] == "cpu-dry-run"
    methods = {(r["scenario"], r["method"], r["direction"]) for r in doc["results"]}
    for method in ("kernel", "loop", "batched", "ceiling"):
        for direction in ("d2h", "h2d"):
            assert ("nemotron-h-8b", method, direction) in methods
    assert all(math.isfinite(r["gbps_median"]) and r["gbps_median"] > 0 for r in doc["results"])
    assert set(doc["targets"]) == set(bench_kernels.TARGETS)
    assert all(t["met"] is None for t in doc["targets"].values()), "a dry run judges no target"
