"""The copy kernel, the copy-engine path and the torch references, bit-exact, on the lane's device.

The KV tensors live on the ``device`` fixture (CPU with the kernel under ``TRITON_INTERPRET=1``
here, CUDA on a GPU box): the same tests in both lanes. Every check compares the whole destination,
pre-filled with a sentinel, against the per-block loop reference, so both stray and missing writes
fail.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from device_lane import host_pool, synchronize

from kvtriton.engine import allocate_kv_caches, build_copy_table, segment_views
from kvtriton.engine.copy_engine import build_piece_table, copy_pieces
from kvtriton.kernels.copy_blocks import WIDTHS, copy_blocks, prepare_copy
from kvtriton.kernels.reference import (
    load_blocks_loop,
    load_blocks_ref,
    store_blocks_loop,
    store_blocks_ref,
)
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.device_lane

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
    t.view(torch.uint8).random_(low, 256)


def _tensors(caches) -> list[torch.Tensor]:
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


def _setup(case: str, device, num_gpu_blocks: int = NUM_GPU_BLOCKS,
           num_cpu_blocks: int = NUM_CPU_BLOCKS) -> Rig:
    groups, attn_layout = CASES[case]
    layout = KVLayout(groups)
    caches = allocate_kv_caches(layout, num_gpu_blocks, attn_layout=attn_layout, device=device)
    for t in _tensors(caches):
        _random_bytes(t)
    segments = segment_views(layout, caches, attn_layout)
    hp = host_pool(num_cpu_blocks, layout.cpu_block_bytes)
    hp.tensor.fill_(SENTINEL)
    return Rig(layout, caches, segments, hp.tensor, hp.device_ptr)


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
    rig = _setup(case, device)
    ids = _store_pairs(rig.layout)
    expected = rig.pool.clone()
    store_blocks_loop(rig.segments, expected, *ids)
    before = _snapshot(rig.caches)

    sm_budget = 1 + len(case) % 5  # a few grid sizes across cases
    BACKENDS[backend]("store", rig, ids, sm_budget)

    assert torch.equal(rig.pool, expected)
    assert _same(_tensors(rig.caches), before), "a store wrote to the GPU side"
    assert not torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
def test_load_matches_loop_reference(case, backend, device):
    rig = _setup(case, device)
    _random_bytes(rig.pool)
    for t in _tensors(rig.caches):
        t.view(torch.uint8).fill_(SENTINEL)
    ids = _load_pairs(rig.layout)
    sentinel = _snapshot(rig.caches)
    expected = [t.clone() for t in _tensors(rig.caches)]
    exp_segments = segment_views(rig.layout, _rebuild(rig.caches, expected), CASES[case][1])
    load_blocks_loop(exp_segments, rig.pool, *ids)
    pool_before = rig.pool.clone()

    BACKENDS[backend]("load", rig, ids, 3)

    assert _same(_tensors(rig.caches), expected)
    assert not _same(_tensors(rig.caches), sentinel), "nothing was loaded"
    assert torch.equal(rig.pool, pool_before), "a load wrote to the CPU pool"


def _rebuild(caches, flat: list[torch.Tensor]):
    """The structure of ``caches`` over the tensors of ``flat`` (in ``_tensors`` order)."""
    it = iter(flat)
    return [[(next(it), next(it)) if isinstance(e, tuple) else next(it) for e in layers]
            for layers in caches]


@pytest.mark.parametrize("case", ["swa+full-bf16-h128-fa", "mamba+full-fp16-fp32-fi"])
def test_store_then_load_round_trip(case, device):
    rig = _setup(case, device)
    table = rig.table()
    original = _snapshot(rig.caches)
    src = [NUM_GPU_BLOCKS - 1, 2]
    for g in range(rig.layout.num_groups):
        cpu = [2 * g, 2 * g + 1]
        rig.copy("store", src, cpu, [g, g], table=table, sm_budget=4)
        for view, _ in rig.segments[g]:
            view[src] = SENTINEL  # index_put: view[list] would be a copy
        assert not _same(_tensors(rig.caches), original), "negative control: blocks cleared"
        rig.copy("load", src, cpu, [g, g], table=table, sm_budget=4)
    assert _same(_tensors(rig.caches), original)


def test_chunked_units_and_small_tiles_match(device):
    """Segments cut into many units (odd tail chunks) and tiles smaller than a segment."""
    rig = _setup("mamba+full-fp16-fp32-fi", device)
    table = rig.table(chunk_bytes=48)
    assert table.units.shape[0] > sum(len(s) for s in rig.segments)
    ids = _store_pairs(rig.layout)
    expected = rig.pool.clone()
    store_blocks_loop(rig.segments, expected, *ids)
    rig.copy("store", *ids, table=table, sm_budget=5, tile_bytes=64)
    assert torch.equal(rig.pool, expected)


def test_access_widths_follow_alignment(device):
    rig = _setup("mamba+full-fp16-fp32-fi", device)
    widths = rig.table().rows[:, 4].tolist()
    # Attention pages are 16-byte multiples; the 60-byte conv state pushes offsets to 4 bytes.
    assert widths == [16] * 4 + [4] * 4
    rig = _setup("mamba-uint8-odd", device)
    assert set(rig.table().rows[:, 4].tolist()) == {1}


@pytest.mark.parametrize(("case", "widths"), [
    ("full-fp16-h64-bs16-fa", (16,)),
    ("mamba+full-fp16-fp32-fi", (16, 4)),
    ("mamba-uint8-odd", (1,)),
])
def test_one_launch_per_width_class_present(case, widths, device):
    """The access width is a constexpr of the launch: a step launches once per width class its
    groups need, never a kernel that branches over widths at run time."""
    rig = _setup(case, device)
    table = rig.table()
    launch = prepare_copy("store", table, rig.pool, *_store_pairs(rig.layout), sm_budget=64,
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
    rig = _setup("swa+full-bf16-h128-fa", device)
    before = _snapshot(rig.caches)
    assert rig.copy("store", [], [], []) == 0
    assert rig.copy("load", np.zeros(0, np.int64), [], []) == 0
    assert torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))
    assert _same(_tensors(rig.caches), before)


def test_one_pair_last_blocks(device):
    rig = _setup("full-fp32-h128-bs16-fi", device)
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
    for t in _tensors(caches):
        _random_bytes(t, low=1)  # no zero bytes: the untouched pool stays all zero
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
    rig = _setup("swa+full-bf16-h128-fa", device)
    before = _snapshot(rig.caches)
    args, message = _error_cases(NUM_GPU_BLOCKS, NUM_CPU_BLOCKS)[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        rig.copy(*args)
    assert torch.equal(rig.pool, torch.full_like(rig.pool, SENTINEL))
    assert _same(_tensors(rig.caches), before)


def test_launcher_rejects_bad_pool_budget_and_tiles(device):
    rig = _setup("full-fp16-h64-bs16-fa", device)
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


def test_vectorized_reference_matches_loop_on_random_schedules(device):
    rig = _setup("mamba+full-fp16-fp32-fi", device, 9, 12)
    layout, caches, segments, pool = rig.layout, rig.caches, rig.segments, rig.pool
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
