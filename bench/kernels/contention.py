"""The contention run of the kernel bandwidth study: a bf16 GEMM's time alone and while a 1 GiB
store runs beside it on a low-priority side stream, through the Triton kernel and through the
copy engine (on the CPU dry run, the store on a thread beside the GEMMs).

Its slowdown is the ``gemm_slowdown`` target (``bench.kernels.targets``).
"""

from __future__ import annotations

import functools
import threading
import time

import numpy as np
import torch

from bench.kernels.timing import Timer, interpreted, pct

CONTENTION_BYTES = 2**30
GEMM_SIZE = 8192


def _gemm(n: int, device: str):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    return lambda: torch.mm(a, b, out=c)


def contention(device: str, dry_run: bool, sm_budget: int | None, reps: int) -> dict:
    """A bf16 GEMM's time alone, and while a store of ``CONTENTION_BYTES`` runs on a
    low-priority side stream through the kernel and through the copy engine."""
    from kvtriton.engine import TransferEngine, allocate_kv_caches
    from kvtriton.engine.copy_engine import copy_pieces
    from kvtriton.kernels.copy_blocks import launch_copy, prepare_copy
    from kvtriton.specs import FullAttentionSpec, KVLayout, preset

    cuda = device == "cuda"
    layout = KVLayout([FullAttentionSpec(16, 1, 32, 1)], name="tiny") if dry_run else \
        preset("llama3-8b")
    n = 2 if dry_run else CONTENTION_BYTES // layout.cpu_block_bytes
    caches = allocate_kv_caches(layout, n, device=device)
    backend = "triton" if cuda or interpreted() else "torch"
    engine = TransferEngine(layout, caches, n, backend=backend, sm_budget=sm_budget)
    ids = [np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)[::-1].copy(),
           np.zeros(n, dtype=np.int64)]
    stores = {"copy_engine": functools.partial(copy_pieces, "store", engine.pieces,
                                               engine.cpu_pool, *ids, non_blocking=cuda)}
    if backend == "triton":
        prepared = prepare_copy("store", engine.table, engine.cpu_pool, *ids,
                                sm_budget=engine.sm_budget,
                                cpu_pool_device_ptr=engine.cpu_pool_device_ptr)
        stores["kernel"] = functools.partial(launch_copy, prepared)
    gemm = _gemm(256 if dry_run else GEMM_SIZE, device)
    timer = Timer(cuda)
    for fn in (gemm, *stores.values()):
        fn()
    gemm_alone = [timer.device_time(gemm, 1) for _ in range(max(reps, 5))]
    out = {"bytes": n * layout.cpu_block_bytes, "gemm": f"bf16 {GEMM_SIZE}^3" if not dry_run
           else "bf16 256^3", "sm_budget": engine.sm_budget,
           "gemm_alone_ms": pct(gemm_alone, 50) * 1e3}
    for method, store in stores.items():
        store_alone = timer.device_time(store, 1)
        row = {"store_alone_ms": store_alone * 1e3,
               "store_alone_gbps": out["bytes"] / store_alone / 1e9}
        if cuda:
            row.update(_overlap(gemm, store, out["gemm_alone_ms"] / 1e3, store_alone))
        else:
            row.update(_overlap_thread(gemm, store, out["gemm_alone_ms"] / 1e3))
            row["note"] = ("CPU dry run: the store on a thread beside the GEMMs, sharing the "
                           "cores; not the GPU's contention")
        out[method] = row
    engine.close()
    return out


def _slowdown(marks: list[tuple[float, float]], start: float, end: float, gemm_s: float) -> dict:
    """The GEMMs (``marks``: start and end seconds) that ran entirely inside the store's span
    (``start``, ``end``, the same clock) against the GEMM alone (``gemm_s``)."""
    during = [b - a for a, b in marks if a >= start and b <= end]
    if not during:
        return {"slowdown": None, "gemms_during": 0, "store_during_ms": (end - start) * 1e3,
                "note": "no GEMM ran entirely inside the store"}
    gemm_during = float(np.median(during))
    return {"slowdown": gemm_during / gemm_s - 1, "gemm_during_ms": gemm_during * 1e3,
            "gemms_during": len(during), "store_during_ms": (end - start) * 1e3}


def _overlap(gemm, store, gemm_s: float, store_s: float) -> dict:
    """GEMMs queued back to back on the current stream, the store on a low-priority side
    stream; the GEMMs that ran entirely inside the store's span are compared with alone."""
    count = min(400, int(1.5 * store_s / max(gemm_s, 1e-6)) + 4)
    side = torch.cuda.Stream(priority=0)
    ev = lambda: torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = ev()
    t0.record()
    marks = []
    for _ in range(count):
        a, b = ev(), ev()
        a.record()
        gemm()
        b.record()
        marks.append((a, b))
    s0, s1 = ev(), ev()
    with torch.cuda.stream(side):
        s0.record(side)
        store()
        s1.record(side)
    torch.cuda.synchronize()
    since = lambda e: t0.elapsed_time(e) / 1e3  # seconds after t0
    return _slowdown([(since(a), since(b)) for a, b in marks], since(s0), since(s1), gemm_s)


def _overlap_thread(gemm, store, gemm_s: float, gemms: int = 8) -> dict:
    """The dry run's stand-in for ``_overlap`` on the CPU: the store back to back on a thread
    while ``gemms`` GEMMs run beside it, all of them inside its span by construction."""
    started, stop = threading.Event(), threading.Event()
    span: list[float] = []
    errors: list[BaseException] = []

    def run_store():
        try:
            span.append(time.perf_counter())
            started.set()
            while not stop.is_set():
                store()
            span.append(time.perf_counter())
        except BaseException as exc:  # re-raised in the caller's thread
            errors.append(exc)
            started.set()

    side = threading.Thread(target=run_store)
    side.start()
    started.wait()
    marks = []
    while len(marks) < gemms and side.is_alive():
        t = time.perf_counter()
        gemm()
        marks.append((t, time.perf_counter()))
    stop.set()
    side.join()
    if errors:
        raise errors[0]
    return _slowdown(marks, *span, gemm_s)
