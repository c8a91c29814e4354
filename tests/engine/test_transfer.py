"""``TransferEngine`` (``kvtriton.engine.transfer``): registration, one planner step at a time,
events, errors, and what only CUDA has.

Every test runs on the ``device`` fixture (CPU with the kernel interpreted here, CUDA on a GPU
box); the ``gpu``-marked ones check what only CUDA has (pinned memory, stream ordering). The
copy-engine path and ``backend="auto"`` are in ``test_copy_engine.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

from kvtriton import TransferEngine
from kvtriton.engine import allocate_kv_caches, segment_views
from kvtriton.kernels.reference import load_blocks_loop, store_blocks_loop
from kvtriton.records import PlannerMeta, Transfer
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.device_lane

SENTINEL = 0x5A
NUM_GPU_BLOCKS = 8
NUM_CPU_BLOCKS = 7
# Small hybrids: every group kind, both attention layouts.
LAYOUTS = {
    "gemma-like-fa": (KVLayout([
        FullAttentionSpec(16, 1, 64, 1, dtype=torch.float16),
        SlidingWindowSpec(16, 2, 64, 2, sliding_window=48, dtype=torch.float16),
    ]), "flash_attn"),
    "nemotron-like-fi": (KVLayout([
        FullAttentionSpec(16, 2, 128, 2, dtype=torch.bfloat16),
        MambaSpec(32, (12, 3), (2, 8, 16), 3, dtype=torch.bfloat16, ssm_dtype=torch.float32),
    ]), "flashinfer"),
}

ENGINE_BACKENDS = ("torch", "triton", "copy_engine", "auto")


def _tensors(caches) -> list[torch.Tensor]:
    return [t for layers in caches for e in layers for t in (e if isinstance(e, tuple) else (e,))]


def _make(name: str, device, backend: str = "torch", **kwargs):
    layout, attn_layout = LAYOUTS[name]
    caches = allocate_kv_caches(layout, NUM_GPU_BLOCKS, attn_layout=attn_layout, device=device)
    for t in _tensors(caches):
        t.view(torch.uint8).random_(0, 256)
    engine = TransferEngine(layout, caches, NUM_CPU_BLOCKS, backend=backend,
                            attn_layout=attn_layout, **kwargs)
    engine.cpu_pool.fill_(SENTINEL)
    return engine, caches


def _snap(engine, caches):
    return engine.cpu_pool.clone(), [t.clone() for t in _tensors(caches)]


def _unchanged(engine, caches, snap) -> bool:
    pool, tensors = snap
    return torch.equal(engine.cpu_pool, pool) and all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(_tensors(caches), tensors, strict=True))


def _meta(store=None, load=None, reqs=None, need_flush=False) -> PlannerMeta:
    return PlannerMeta(Transfer() if store is None else store,
                       Transfer() if load is None else load, reqs or {}, need_flush)


def _same_tensors(caches, expected) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(_tensors(caches), expected, strict=True))


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_stores_loads_and_reports_at_next_poll(name, backend, device):
    engine, caches = _make(name, device, backend)
    layout = engine.layout
    store = Transfer(7, [NUM_GPU_BLOCKS - 1, 3, 3], [NUM_CPU_BLOCKS - 1, 0, 2], [0, 1, 1])
    expected_pool = engine.cpu_pool.clone()
    store_blocks_loop(engine.segments, expected_pool, store.gpu_blocks, store.cpu_blocks,
                      store.groups)
    engine.execute(_meta(store=store))
    engine.flush()  # a no-op on CPU, where the copy ran when submitted
    assert torch.equal(engine.cpu_pool, expected_pool)
    assert engine.poll() == ([7], [])
    assert engine.poll() == ([], [])

    # Load the stored blocks into other GPU blocks, in a later step.
    load = Transfer(8, [0, 5, 6], [NUM_CPU_BLOCKS - 1, 0, 0], [0, 1, 1])
    expected = [t.clone() for t in _tensors(caches)]
    it = iter(expected)
    rebuilt = [[(next(it), next(it)) if isinstance(e, tuple) else next(it) for e in layers]
               for layers in caches]
    load_blocks_loop(segment_views(layout, rebuilt, engine.attn_layout), engine.cpu_pool,
                     load.gpu_blocks, load.cpu_blocks, load.groups)
    assert not _same_tensors(caches, expected), "negative control: the load changes blocks"
    engine.execute(_meta(load=load, reqs={8: ["req-a", "req-b"]}))
    engine.wait_for_loads()
    assert _same_tensors(caches, expected)  # on the current stream, after the load
    engine.flush()
    assert engine.poll() == ([], ["req-a", "req-b"])
    assert engine.num_in_flight == 0
    # What moved, for GB/s: each pair counts its group's bytes per block, all layers.
    per_group = [sum(s.nbytes for s in segs) for segs in layout.segments]
    for kind, t in (("store", store), ("load", load)):
        n, nbytes, seconds = engine.totals[kind]
        assert (n, nbytes) == (1, sum(per_group[g] for g in t.groups)) and seconds > 0


@pytest.mark.parametrize("backend", ["triton", "copy_engine", "auto"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_round_trip_restores_gpu_content(name, backend, device):
    engine, caches = _make(name, device, backend, sm_budget=3)
    original = [t.clone() for t in _tensors(caches)]
    gpu = [1, NUM_GPU_BLOCKS - 1, 0, 4]
    cpu = [0, 1, 2, NUM_CPU_BLOCKS - 1]
    grp = [0, 0, 1, 1]
    engine.store(1, gpu, cpu, grp)
    engine.flush()
    for g, b in zip(grp, gpu, strict=True):
        for view, _ in engine.segments[g]:
            view[b].fill_(SENTINEL)
    assert not _same_tensors(caches, original), "negative control: blocks overwritten"
    engine.load(2, ["r"], gpu, cpu, grp)
    engine.flush()
    assert _same_tensors(caches, original)
    assert engine.poll() == ([1], ["r"])


def test_backends_agree_on_the_pool(device):
    pools = []
    for backend in ENGINE_BACKENDS:
        torch.manual_seed(3)
        engine, _ = _make("nemotron-like-fi", device, backend)
        engine.store(0, [2, 7, 2, 5], [6, 0, 3, 1], [0, 1, 1, 0])
        engine.flush()
        pools.append(engine.cpu_pool.clone())
    assert all(torch.equal(pools[0], p) for p in pools[1:])
    assert not torch.equal(pools[0], torch.full_like(pools[0], SENTINEL))


def test_empty_and_event_only_transfers(device):
    engine, caches = _make("gemma-like-fa", device)
    snap = _snap(engine, caches)
    engine.execute(_meta())
    assert engine.poll() == ([], [])
    # An event with no pairs (every block skipped) still completes and reports its requests.
    engine.execute(_meta(store=Transfer(4), load=Transfer(5), reqs={5: ["x"]}))
    engine.flush()
    assert engine.poll() == ([4], ["x"])
    engine.execute(_meta(store=Transfer(6, [1], [1], [0]), need_flush=True))
    engine.flush()
    assert engine.poll() == ([6], [])
    assert not torch.equal(engine.cpu_pool, snap[0])
    engine.close()


def test_cpu_pool_is_exact_zeroed_and_page_aligned(device):
    layout, attn_layout = LAYOUTS["nemotron-like-fi"]
    caches = allocate_kv_caches(layout, NUM_GPU_BLOCKS, attn_layout=attn_layout, device=device)
    engine = TransferEngine(layout, caches, 5, backend="torch", attn_layout=attn_layout)
    pool = engine.cpu_pool
    assert pool.dtype == torch.uint8 and tuple(pool.shape) == (5, layout.cpu_block_bytes)
    assert pool.data_ptr() % 4096 == 0 and pool.is_contiguous()
    assert pool.count_nonzero() == 0
    # Pinned and mapped exactly where a GPU kernel reads it; the host address otherwise.
    assert pool.is_pinned() == (device.type == "cuda")
    if device.type != "cuda":
        assert engine.cpu_pool_device_ptr == pool.data_ptr()
    engine.close()


def test_any_dtype_with_matching_bytes_is_accepted(device):
    """A bf16 layout served by fp16 tensors, an fp32 one by int32: copies are byte copies."""
    layout = KVLayout([FullAttentionSpec(16, 1, 64, 2, dtype=torch.bfloat16),
                       MambaSpec(16, (4, 3), (2, 4), 1, dtype=torch.float32)])
    caches = [
        [torch.randn(2, 3, 16, 1, 64, device=device).half() for _ in range(2)],
        [(torch.randint(0, 99, (3, 4, 3), dtype=torch.int32, device=device),
          torch.randn(3, 2, 4, device=device))],
    ]
    engine = TransferEngine(layout, caches, 2, backend="triton")
    engine.store(0, [2, 1], [0, 1], [0, 1])
    engine.flush()
    assert torch.equal(engine.cpu_pool[0, :4096].view(torch.float16).view(2, 16, 1, 64)[1],
                       caches[0][0][1, 2].cpu())
    assert torch.equal(engine.cpu_pool[1, :48].view(torch.int32).view(4, 3),
                       caches[1][0][0][1].cpu())


def _ctor_errors(device):
    layout, _ = LAYOUTS["nemotron-like-fi"]
    good = allocate_kv_caches(layout, 4, attn_layout="flashinfer", device=device)
    attn = good[0][0]
    conv, ssm = good[1][0]
    # Every other element of a wider state: the right bytes per block, not one dense range.
    strided = torch.empty((4, 2, 8, 32), dtype=ssm.dtype, device=device)[..., ::2]
    return layout, {
        "groups": ([good[0]], {}, "kv_caches has 1 groups"),
        "layers": ([good[0][:1], good[1]], {}, "kv_caches[0] has 1 layers"),
        "bytes": ([[attn.float(), good[0][1]], good[1]], {}, "kv_caches[0][0] (k) holds"),
        "layout-mismatch": (good, {"attn_layout": "flash_attn"},
                            "must be [2, num_blocks, ...] (flash_attn)"),
        "not-dense": ([good[0], [(conv, strided), *good[1][1:]]], {},
                      "kv_caches[1][0][1] (ssm): each block must be one dense byte range"),
        "mamba-not-pair": ([good[0], [conv, *good[1][1:]]], {}, "must be a (conv, ssm) pair"),
        "num-blocks": ([good[0], [(conv[:3], ssm[:3]), *good[1][1:]]], {},
                       "layers disagree on num_blocks"),
        "backend": (good, {"backend": "cuda"}, "backend must be one of"),
        "attn-layout": (good, {"attn_layout": "paged"}, "'paged'"),
        "cpu-blocks": (good, {"num_cpu_blocks": 0}, "num_cpu_blocks must be a positive int, got 0"),
        "sm-budget": (good, {"sm_budget": 0}, "sm_budget must be a positive int or None, got 0"),
        "min-piece": (good, {"copy_engine_min_piece_bytes": -1},
                      "copy_engine_min_piece_bytes must be a non-negative int, got -1"),
        "max-pieces": (good, {"copy_engine_max_pieces": 2.0},
                       "copy_engine_max_pieces must be a non-negative int, got 2.0"),
    }


CTOR_ERRORS = ("groups", "layers", "bytes", "layout-mismatch", "not-dense", "mamba-not-pair",
               "num-blocks", "backend", "attn-layout", "cpu-blocks", "sm-budget", "min-piece",
               "max-pieces")


@pytest.mark.parametrize("name", CTOR_ERRORS)
def test_registration_errors_name_the_bad_value(name, device):
    layout, cases = _ctor_errors(device)
    assert set(cases) == set(CTOR_ERRORS)
    caches, kwargs, message = cases[name]
    kwargs = {"attn_layout": "flashinfer", "num_cpu_blocks": 2, **kwargs}
    n_cpu = kwargs.pop("num_cpu_blocks")
    with pytest.raises(ValueError, match=re.escape(message)):
        TransferEngine(layout, caches, n_cpu, **kwargs)


STEP_ERRORS = {
    "gpu-id": (_meta(store=Transfer(1, [NUM_GPU_BLOCKS], [0], [0])),
               f"gpu_blocks[0]={NUM_GPU_BLOCKS}"),
    "cpu-id": (_meta(store=Transfer(1, [0], [NUM_CPU_BLOCKS], [0])),
               f"cpu_blocks[0]={NUM_CPU_BLOCKS}"),
    "group": (_meta(store=Transfer(1, [0], [0], [2])), "groups[0]=2"),
    "lengths": (_meta(store=Transfer(1, [0, 1], [0], [0])), "equal lengths"),
    "dup-dest": (_meta(store=Transfer(1, [0, 1], [4, 4], [0, 0])), "cpu_blocks[0]=4"),
    "event": (_meta(store=Transfer(-2, [0], [0], [0])), "store event must be a non-negative int"),
    "pairs-without-event": (_meta(load=Transfer(-1, [0], [0], [0])), "1 pairs but event -1"),
    # A valid store and an invalid load: neither may run.
    "bad-load-after-good-store": (
        _meta(store=Transfer(1, [0, 1], [0, 1], [0, 1]), load=Transfer(2, [0], [0], [5]),
              reqs={2: ["r"]}), "groups[0]=5"),
}


@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
@pytest.mark.parametrize("name", list(STEP_ERRORS))
def test_step_errors_name_the_value_and_change_nothing(name, backend, device):
    engine, caches = _make("gemma-like-fa", device, backend)
    snap = _snap(engine, caches)
    meta, message = STEP_ERRORS[name]
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.execute(meta)
    engine.flush()
    assert _unchanged(engine, caches, snap)
    assert engine.poll() == ([], [])


def test_direct_store_and_load_errors(device):
    engine, caches = _make("gemma-like-fa", device)
    snap = _snap(engine, caches)
    with pytest.raises(ValueError, match=re.escape("gpu_blocks[1]=-3")):
        engine.store(0, [1, -3], [0, 1], [0, 0])
    with pytest.raises(ValueError, match=re.escape("gpu_blocks[0]=2 (group 1)")):
        engine.load(0, ["r"], [2, 2], [0, 1], [1, 1])
    with pytest.raises(ValueError, match="must be host"):
        engine.store(0, torch.tensor([0], device="meta"), [0], [0])
    assert _unchanged(engine, caches, snap)
    assert engine.poll() == ([], [])


def test_backend_failure_is_reported_not_completed(monkeypatch, caplog, device):
    engine, _ = _make("gemma-like-fa", device)

    def boom(direction, pairs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(engine, "_copy", boom)
    engine.execute(_meta(store=Transfer(3, [0], [0], [0]), load=Transfer(4, [1], [1], [0]),
                         reqs={4: ["q"]}))
    assert engine.poll() == ([], [])
    assert engine.poll_failures() == ([3], ["q"])
    assert engine.poll_failures() == ([], [])
    assert "launch failed" in caplog.text


# ---- CUDA only -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_pool_is_pinned_exact_and_mapped():
    layout, attn_layout = LAYOUTS["nemotron-like-fi"]
    caches = allocate_kv_caches(layout, NUM_GPU_BLOCKS, attn_layout=attn_layout, device="cuda")
    engine = TransferEngine(layout, caches, 3, attn_layout=attn_layout)
    pool = engine.cpu_pool
    assert pool.is_pinned() and pool.device.type == "cpu"
    assert pool.numel() == 3 * layout.cpu_block_bytes and pool.data_ptr() % 4096 == 0
    assert engine.cpu_pool_device_ptr != 0
    engine.close()


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ENGINE_BACKENDS)
def test_gpu_store_waits_for_compute_and_load_orders_before_use(backend):
    layout, attn_layout = LAYOUTS["nemotron-like-fi"]
    caches = allocate_kv_caches(layout, NUM_GPU_BLOCKS, attn_layout=attn_layout, device="cuda")
    for t in _tensors(caches):
        t.view(torch.uint8).zero_()
    engine = TransferEngine(layout, caches, NUM_CPU_BLOCKS, backend=backend,
                            attn_layout=attn_layout)
    # Compute writes block 3 after a long kernel; the store must see the write.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 4096
    for view, _ in engine.segments[0]:
        view[3].fill_(7)
    engine.execute(_meta(store=Transfer(1, [3], [2], [0])))
    engine.flush()
    assert engine.poll() == ([1], [])
    seg_bytes = engine.segments[0][0][0].shape[1]
    assert bool((engine.cpu_pool[2, :seg_bytes] == 7).all())

    engine.execute(_meta(load=Transfer(2, [5], [2], [0]), reqs={2: ["r"]}))
    engine.wait_for_loads()
    got = engine.segments[0][0][0][5].clone()  # on the current stream, after the load
    assert bool((got == 7).all())
    engine.flush()
    assert engine.poll() == ([], ["r"])
    engine.close()


@pytest.mark.gpu
def test_gpu_launcher_rejects_pageable_pool():
    from kvtriton.kernels.copy_blocks import copy_blocks

    layout, attn_layout = LAYOUTS["gemma-like-fa"]
    caches = allocate_kv_caches(layout, NUM_GPU_BLOCKS, attn_layout=attn_layout, device="cuda")
    engine = TransferEngine(layout, caches, 2, attn_layout=attn_layout)
    pageable = torch.zeros_like(engine.cpu_pool)  # host memory, not page-locked
    with pytest.raises(ValueError, match="not pinned"):
        copy_blocks("store", engine.table, pageable, [0], [0], [0])
    assert pageable.count_nonzero() == 0
    engine.close()
