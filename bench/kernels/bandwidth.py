"""Bandwidth of the one-launch copy kernel against copy-engine, per-block and batched copies (GPU).

For Llama-3-8B-like blocks (16 tokens, 32 layers, 2 MiB per block) at 1 to 4,096 blocks per launch
and for the Mamba hybrid preset (``nemotron-h-8b``: 16 attention blocks per Mamba state block),
each direction (D2H store, H2D load) is timed for:

- ``kernel``: ``kvtriton.kernels.copy_blocks``, one launch per step for every group and layer;
- ``copy_engine``: ``kvtriton.engine.copy_engine.copy_pieces``, one ``cudaMemcpyAsync`` per
  contiguous piece (the path ``backend="auto"`` takes for large pieces);
- ``loop``: one ``copy_`` per (block, layer, part), the per-block baseline;
- ``batched``: per segment ``index_select`` into a staging buffer plus one copy (the CPU blocks of a
  step are made consecutive for it); ``cuMemcpyBatchAsync`` is reported as reachable or not;
- ``ceiling``: one contiguous copy between GPU memory and the pinned pool, the link's practical
  ceiling, measured in the same run.

Device time is that of back-to-back launches of a prepared step between two CUDA events, divided
by their number: the kernel's host preparation (validation, sorting, pinned staging, table copy)
is done once, outside the timing, so small launches are not biased by the host. Host time per
launch is measured separately: the wall time of the whole submitting call, preparation included
(``host_us_median``), and for the kernel its two halves (``host_prep_us_median``,
``host_launch_us_median``). Methods whose work is host-issued copies (copy_engine, loop, batched)
include their submission gaps in the device time, as they would in a server. Every shape of a
scenario is warmed up before any is timed; GB/s come from the explicit bytes moved (pairs x the
group's bytes per block).

Two more measurements:

- ``piece_sweep``: kernel against copy engine for 64 blocks of one layout per piece size (K/V pages
  of 4 to 64 KiB), the crossover ``backend="auto"`` puts at ``COPY_ENGINE_MIN_PIECE_BYTES``; its
  4-24 KiB pieces are the small-piece regime, where vLLM's DMA path manages 5-7 GB/s (vLLM PR
  #42212, H100);
- ``contention``: a bf16 GEMM's time alone and while a 1 GiB store runs on the engine's side
  stream, through the Triton kernel (default SM budget) and through the copy engine.

Results (median, p10, p90) and the targets go to ``bench/results/bench_kernels.json``. Each target
(``TARGETS``) is printed with its measured value, its bound and whether it was met, then one
summary line; the exit code is 0 when every measured target is met (or none is judged: the dry
run), ``EXIT_TARGET_MISSED`` when one is missed.

The dry run computes every target's value from its CPU timings, through the same code as on a GPU
(its largest sizes stand in for ``TARGET_FROM_BLOCKS``, its sweep's pages are 4 and 24 KiB, and
the GEMM runs beside a store on a thread), and judges none of them: the numbers are not link
bandwidth.

    python -m bench.kernels.bandwidth            # full size, needs CUDA
    python -m bench.kernels.bandwidth --quick    # a few sizes, the sweep and the contention run
    python -m bench.kernels.bandwidth --dry-run  # the same harness on CPU tensors, tiny sizes
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result

LLAMA_SIZES = [2**i for i in range(13)]  # 1 .. 4096 blocks per launch
LLAMA_SIZES_QUICK = [1, 16, 64, 256]
LLAMA_SIZES_DRY = [1, 4]
MAMBA_SIZES = [1, 2, 4, 8]  # Mamba state blocks per launch, with 16 attention blocks each
MAMBA_SIZES_QUICK = [1, 2]
LAYER_COUNTS = (8, 32, 64)
LAYERS_PAIRS = 256
LOOP_MAX_PAIRS = 1024  # the per-block loop is host-bound; above this it only costs time
TARGET_FROM_BLOCKS = 64  # the ratio targets cover launches of this many blocks and more
# Back-to-back launches per timed repetition: enough for ~20 ms of device time, at most this many.
MAX_BURST = 16
BURST_SECONDS = 0.02
SWEEP_HEADS = (1, 2, 4, 6, 8, 16)  # K/V pages of 4, 8, 16, 24, 32, 64 KiB (16 tokens x 128 x bf16)
SWEEP_HEADS_DRY = (1, 6)  # 4 and 24 KiB: the ends of the small-piece regime
SWEEP_BLOCKS = 64
SMALL_PIECES = (4 * 1024, 24 * 1024)  # vLLM PR #42212 (H100): its DMA path at 5-7 GB/s here
CONTENTION_BYTES = 2**30
GEMM_SIZE = 8192
GEMM_SLOWDOWN_MAX = 0.05
EXIT_TARGET_MISSED = 3  # the run ended and a measured target was missed (a crash exits 1)

TARGETS = {
    "d2h_vs_ceiling": ("D2H kernel >= 0.90 x the contiguous D2H ceiling from 64 blocks up "
                       "(llama3-8b)", 0.90),
    "d2h_vs_loop": ("D2H kernel >= 5x the per-block copy_ loop from 64 blocks up (llama3-8b, "
                    f"loop measured up to {LOOP_MAX_PAIRS} blocks)", 5.0),
    "h2d_vs_ceiling": ("H2D kernel >= 0.70 x the contiguous H2D ceiling from 64 blocks up "
                       "(llama3-8b)", 0.70),
    "host_time_vs_layers": ("host time per launch independent of the number of layers: max/min "
                            f"over {LAYER_COUNTS} layers at {LAYERS_PAIRS} blocks <= 1.25", 1.25),
    "gemm_slowdown": (f"bf16 GEMM slowdown while a 1 GiB store runs through the kernel at the "
                      f"default SM budget <= {GEMM_SLOWDOWN_MAX:.0%}", GEMM_SLOWDOWN_MAX),
    "small_pieces_vs_copy_engine": (
        "kernel GB/s >= the copy engine's in the same run at every piece of 4-24 KiB (piece "
        f"sweep, {SWEEP_BLOCKS} blocks, both directions), where backend='auto' picks the kernel; "
        "vLLM's DMA path manages 5-7 GB/s there (vLLM PR #42212, H100)", 1.0),
}


@dataclass(slots=True)
class Case:
    """One timed shape: ``fn`` is what runs back to back (the kernel: launches of a prepared
    step), ``host_fn`` the whole submitting call whose wall time is the host time per launch;
    ``parts`` optional named pieces of ``host_fn`` timed the same way."""

    scenario: str
    size: int  # blocks per launch (Mamba state blocks for the hybrid)
    n_pairs: int
    nbytes: int
    method: str
    direction: str
    fn: Callable[[], None]
    reps: int
    host_fn: Callable[[], None] | None = None
    parts: dict[str, Callable[[], None]] | None = None


class Timer:
    """CUDA events on the current stream around back-to-back calls when ``cuda``; the wall clock
    otherwise (CPU copies are synchronous)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def burst(self, fn: Callable[[], None]) -> int:
        """Calls per timed repetition: about ``BURST_SECONDS`` of device time, 1 to
        ``MAX_BURST``, from one call's time after warm-up (always 1 on the CPU, where the
        wall clock of one call is already its whole time)."""
        if not self.cuda:
            return 1
        one = self.device_time(fn, 1)
        return max(1, min(MAX_BURST, int(BURST_SECONDS / max(one, 1e-9))))

    def device_time(self, fn: Callable[[], None], calls: int) -> float:
        """Seconds per call over ``calls`` back-to-back calls."""
        self._sync()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    def host_time(self, fn: Callable[[], None]) -> float:
        """Wall seconds of one call on an idle device (its work is not waited for)."""
        self._sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        self._sync()
        return t1 - t0

    def measure(self, case: Case) -> tuple[list[float], list[float], dict[str, list[float]]]:
        calls = self.burst(case.fn)
        device_s = [self.device_time(case.fn, calls) for _ in range(case.reps)]
        host_s = [self.host_time(case.host_fn or case.fn) for _ in range(case.reps)]
        parts = {name: [self.host_time(fn) for _ in range(case.reps)]
                 for name, fn in (case.parts or {}).items()}
        return device_s, host_s, parts


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def memcpy_batch_status() -> str:
    try:
        from cuda.bindings import driver
    except ImportError:
        return ("not reachable: cuda-python is not installed and torch does not expose "
                "cuMemcpyBatchAsync; the batched baseline is index_select plus one copy")
    if not hasattr(driver, "cuMemcpyBatchAsync"):
        return ("not reachable: this cuda-python has no cuMemcpyBatchAsync (CUDA 12.8+); the "
                "batched baseline is index_select plus one copy")
    return ("reachable through cuda-python but not wired into this harness; the batched baseline "
            "is index_select plus one copy")


def _layouts(dry_run: bool):
    from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, preset

    if dry_run:
        llama = KVLayout([FullAttentionSpec(16, 1, 64, 4)], name="llama-like-tiny")
        mamba = KVLayout([FullAttentionSpec(16, 1, 64, 2),
                          MambaSpec(64, (8, 3), (2, 4, 8), 2)], name="nemotron-like-tiny")
        layers = {n: KVLayout([FullAttentionSpec(16, 1, 64, n // 8)], name=f"tiny-{n // 8}L")
                  for n in LAYER_COUNTS}
    else:
        llama = preset("llama3-8b")
        mamba = preset("nemotron-h-8b")
        layers = {n: KVLayout([FullAttentionSpec(16, 8, 128, n)], name=f"llama-like-{n}L")
                  for n in LAYER_COUNTS}
    return llama, mamba, layers


class Scenario:
    """One layout, its engine (tables and pinned pool) and the pairs for each size."""

    def __init__(self, name: str, layout, pair_sets: dict[int, tuple], device, backend: str,
                 sm_budget: int | None):
        from kvtriton.engine import TransferEngine, allocate_kv_caches

        self.name = name
        self.layout = layout
        n_gpu = int(max(max(p[0], default=0) for p in pair_sets.values())) + 1
        n_cpu = int(max(max(p[1], default=0) for p in pair_sets.values())) + 1
        self.caches = allocate_kv_caches(layout, n_gpu, device=device)
        for segs in self.caches:
            for entry in segs:
                for t in entry if isinstance(entry, tuple) else (entry,):
                    t.view(torch.uint8).random_(0, 256)
        self.engine = TransferEngine(layout, self.caches, n_cpu, backend=backend,
                                     sm_budget=sm_budget)
        self.pair_sets = pair_sets
        self.device = torch.device(device)
        # One GPU scratch buffer for the staging and ceiling copies of every size.
        self._scratch = torch.empty(max(self.nbytes(n) for n in pair_sets), dtype=torch.uint8,
                                    device=self.device)

    def nbytes(self, n: int) -> int:
        grp = np.asarray(self.pair_sets[n][2], dtype=np.int64)
        per_group = np.asarray(self.layout.group_block_bytes, dtype=np.int64)
        return int(per_group[grp].sum())

    def cases(self, methods: tuple[str, ...], reps: int) -> list[Case]:
        from kvtriton.engine.copy_engine import copy_pieces
        from kvtriton.kernels.copy_blocks import copy_blocks, launch_copy, prepare_copy
        from kvtriton.kernels.reference import load_blocks_loop, store_blocks_loop

        eng = self.engine
        cuda = self.device.type == "cuda"
        out = []
        for n, (gpu, cpu, grp) in self.pair_sets.items():
            nbytes = self.nbytes(n)
            ids = [np.asarray(x, dtype=np.int64) for x in (gpu, cpu, grp)]
            for direction in ("store", "load"):
                d = "d2h" if direction == "store" else "h2d"
                case = functools.partial(Case, self.name, n, len(gpu), nbytes)
                if "kernel" in methods:
                    kw = {"sm_budget": eng.sm_budget,
                          "cpu_pool_device_ptr": eng.cpu_pool_device_ptr}
                    prepared = prepare_copy(direction, eng.table, eng.cpu_pool, *ids, **kw)
                    submit = functools.partial(copy_blocks, direction, eng.table, eng.cpu_pool,
                                               *ids, **kw)
                    prepare = functools.partial(prepare_copy, direction, eng.table, eng.cpu_pool,
                                                *ids, **kw)
                    launch = functools.partial(launch_copy, prepared)
                    out.append(case("kernel", d, launch, reps, host_fn=submit,
                                    parts={"prep": prepare, "launch": launch}))
                if "copy_engine" in methods:
                    out.append(case("copy_engine", d, functools.partial(
                        copy_pieces, direction, eng.pieces, eng.cpu_pool, *ids,
                        non_blocking=cuda), reps))
                if "loop" in methods and n <= LOOP_MAX_PAIRS:
                    loop_fn = store_blocks_loop if direction == "store" else load_blocks_loop
                    out.append(case("loop", d, functools.partial(
                        loop_fn, eng.segments, eng.cpu_pool, gpu, cpu, grp, non_blocking=cuda),
                        max(2, reps // 4)))
                if "batched" in methods:
                    out.append(case("batched", d, self._batched(direction, gpu, grp), reps))
                if "ceiling" in methods:
                    out.append(case("ceiling", d, self._contiguous(direction, nbytes), reps))
        return out

    def _batched(self, direction: str, gpu, grp) -> Callable[[], None]:
        """Per group: gather every segment into a ``[n, group_bytes]`` staging tensor with one
        ``index_select`` each, then one copy to or from CPU blocks ``0..n-1`` of that group."""
        eng = self.engine
        gpu, grp = np.asarray(gpu), np.asarray(grp)
        plans = []
        for g, segs in enumerate(eng.segments):
            ids = torch.from_numpy(gpu[grp == g]).to(self.device)
            if ids.numel() == 0:
                continue
            gbytes = self.layout.group_block_bytes[g]
            start = sum(p[2].numel() for p in plans)
            staging = self._scratch[start: start + ids.numel() * gbytes].view(ids.numel(), gbytes)
            # Rows wider than the group's block (multi-group layouts) make this copy strided.
            host = eng.cpu_pool[: ids.numel(), :gbytes]
            plans.append((segs, ids, staging, host))
        non_blocking = self.device.type == "cuda"

        def run():
            for segs, ids, staging, host in plans:
                if direction == "store":
                    for view, off in segs:
                        staging[:, off:off + view.shape[1]].copy_(view.index_select(0, ids))
                    host.copy_(staging, non_blocking=non_blocking)
                else:
                    staging.copy_(host, non_blocking=non_blocking)
                    for view, off in segs:
                        view.index_copy_(0, ids, staging[:, off:off + view.shape[1]])
        return run

    def _contiguous(self, direction: str, nbytes: int) -> Callable[[], None]:
        flat = self.engine.cpu_pool.view(-1)
        nbytes = min(nbytes, flat.numel())
        dev_buf = self._scratch[:nbytes]
        host = flat[:nbytes]
        non_blocking = self.device.type == "cuda"
        if direction == "store":
            return lambda: host.copy_(dev_buf, non_blocking=non_blocking)
        return lambda: dev_buf.copy_(host, non_blocking=non_blocking)


def _llama_pairs(sizes: list[int], rng) -> dict[int, tuple]:
    top = max(sizes)
    gpu_perm = rng.permutation(top)  # scattered GPU blocks, as in a paged cache
    cpu_perm = rng.permutation(top)
    return {n: (gpu_perm[:n], cpu_perm[:n], np.zeros(n, dtype=np.int64)) for n in sizes}


def _mamba_pairs(sizes: list[int], rng) -> dict[int, tuple]:
    out = {}
    top = max(sizes) * 17
    gpu_perm = rng.permutation(top)
    cpu_perm = rng.permutation(top)
    for m in sizes:
        n = 17 * m
        grp = np.concatenate([np.zeros(16 * m, np.int64), np.ones(m, np.int64)])
        out[m] = (gpu_perm[:n], cpu_perm[:n], grp)
    return out


def _summarize(case: Case, device_s: list[float], host_s: list[float],
               parts: dict[str, list[float]]) -> dict:
    gbps = [case.nbytes / t / 1e9 for t in device_s]
    out = {
        "scenario": case.scenario,
        "blocks_per_launch": case.size,
        "pairs": case.n_pairs,
        "bytes": case.nbytes,
        "method": case.method,
        "direction": case.direction,
        "reps": case.reps,
        "gbps_median": _pct(gbps, 50),
        "gbps_p10": _pct(gbps, 10),
        "gbps_p90": _pct(gbps, 90),
        "time_us_median": _pct(device_s, 50) * 1e6,
        "time_us_p10": _pct(device_s, 10) * 1e6,
        "time_us_p90": _pct(device_s, 90) * 1e6,
        "host_us_median": _pct(host_s, 50) * 1e6,
    }
    for name, values in parts.items():
        out[f"host_{name}_us_median"] = _pct(values, 50) * 1e6
    return out


def _find(results, **key) -> dict | None:
    for r in results:
        if all(r[k] == v for k, v in key.items()):
            return r
    return None


LOWER_IS_BETTER = ("host_time_vs_layers", "gemm_slowdown")
MET_COLUMN = {"met": "yes", "missed": "NO", "not evaluated": "n/a (dry run)",
              "not measured": "not measured"}


def _small_piece_ratios(sweep: dict | None) -> list[float]:
    """Kernel GB/s over copy-engine GB/s for each sweep row in ``SMALL_PIECES``."""
    rows = (sweep or {}).get("rows", [])
    lo, hi = SMALL_PIECES
    out = []
    for r in rows:
        if r["method"] != "kernel" or not lo <= r["piece_bytes"] <= hi:
            continue
        engine = _find(rows, method="copy_engine", direction=r["direction"],
                       piece_bytes=r["piece_bytes"])
        if engine:
            out.append(r["gbps_median"] / engine["gbps_median"])
    return out


def evaluate_targets(results: list[dict], evaluate: bool, contention: dict | None = None,
                     sweep: dict | None = None, target_from: int = TARGET_FROM_BLOCKS) -> dict:
    """Each target: the worst value over the sizes it covers (llama3-8b launches of
    ``target_from`` blocks and more for the ratios), its bound, and ``status``: ``met`` or
    ``missed``; ``not evaluated`` when ``evaluate`` is false (the value is computed, ``met`` is
    None); ``not measured`` when nothing it covers was timed."""
    out = {}
    ratios: dict[str, list[float]] = {k: [] for k in TARGETS}
    llama_top = max((x["blocks_per_launch"] for x in results if x["scenario"] == "llama3-8b"),
                    default=None)
    for r in results:
        if r["scenario"] != "llama3-8b" or r["method"] != "kernel" \
                or r["blocks_per_launch"] < target_from:
            continue
        ceiling = _find(results, scenario="llama3-8b", method="ceiling", direction=r["direction"],
                        blocks_per_launch=llama_top)
        key = "d2h_vs_ceiling" if r["direction"] == "d2h" else "h2d_vs_ceiling"
        if ceiling:
            ratios[key].append(r["gbps_median"] / ceiling["gbps_median"])
        loop = _find(results, scenario="llama3-8b", method="loop", direction=r["direction"],
                     blocks_per_launch=r["blocks_per_launch"])
        if loop and r["direction"] == "d2h":
            ratios["d2h_vs_loop"].append(r["gbps_median"] / loop["gbps_median"])
    hosts = [r["host_us_median"] for r in results
             if r["scenario"].startswith("layers-") and r["method"] == "kernel"
             and r["direction"] == "d2h"]
    if hosts:
        ratios["host_time_vs_layers"].append(max(hosts) / min(hosts))
    slowdown = ((contention or {}).get("kernel") or {}).get("slowdown")
    if slowdown is not None:
        ratios["gemm_slowdown"].append(slowdown)
    ratios["small_pieces_vs_copy_engine"] = _small_piece_ratios(sweep)
    for key, (text, bound) in TARGETS.items():
        lower = key in LOWER_IS_BETTER
        row = {"target": text, "op": "<=" if lower else ">=", "bound": bound, "value": None,
               "met": None}
        vals = ratios[key]
        if not vals:
            out[key] = {**row, "status": "not measured", "note": "not measured"}
            continue
        worst = max(vals) if lower else min(vals)
        met = worst <= bound if lower else worst >= bound
        row["value"] = worst
        if evaluate:
            out[key] = {**row, "met": bool(met), "status": "met" if met else "missed"}
        else:
            out[key] = {**row, "status": "not evaluated",
                        "note": "not evaluated: CPU dry run, the numbers are not link bandwidth"}
    return out


def targets_summary(targets: dict) -> str:
    """One line: how many targets were met, which were missed, which were not measured."""
    def named(status: str) -> list[str]:
        return [k for k, t in targets.items() if t["status"] == status]

    unjudged = named("not evaluated")
    parts = [f"targets: not judged (CPU dry run), {len(unjudged)} of {len(targets)} computed"
             if unjudged else f"targets: {len(named('met'))} of {len(targets)} met"]
    if named("missed"):
        parts.append(f"MISSED: {', '.join(named('missed'))}")
    if named("not measured"):
        parts.append(f"not measured: {', '.join(named('not measured'))}")
    return "; ".join(parts)


def exit_code(targets: dict) -> int:
    """``EXIT_TARGET_MISSED`` when a measured target was missed, else 0."""
    return EXIT_TARGET_MISSED if any(t["status"] == "missed" for t in targets.values()) else 0


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in (header, *rows)]


def target_table(targets: dict) -> list[str]:
    """Each target's measured value, bound and verdict, then the summary line."""
    rows = [(name, "-" if t["value"] is None else f"{t['value']:.3g}",
             f"{t['op']} {t['bound']:g}", MET_COLUMN[t["status"]])
            for name, t in targets.items()]
    return [*_table(("target", "measured", "bound", "met"), rows), targets_summary(targets)]


def piece_table(sweep: dict | None) -> list[str]:
    """Kernel against copy-engine GB/s per piece size and direction, from the same run."""
    if not sweep:
        return []
    lo, hi = SMALL_PIECES
    rows = []
    for r in sorted((r for r in sweep["rows"] if r["method"] == "kernel"),
                    key=lambda r: (r["piece_bytes"], r["direction"])):
        engine = _find(sweep["rows"], method="copy_engine", direction=r["direction"],
                       piece_bytes=r["piece_bytes"])
        rows.append((f"{r['piece_bytes'] / 1024:g} KiB", r["direction"], f"{r['gbps_median']:.3g}",
                     f"{engine['gbps_median']:.3g}",
                     f"{r['gbps_median'] / engine['gbps_median']:.3g}",
                     "small" if lo <= r["piece_bytes"] <= hi else ""))
    title = [f"piece sweep: kernel against copy engine in this run ({sweep['blocks']} blocks, "
             f"{sweep['layers']} layers per piece size)",
             f"small: {lo // 1024}-{hi // 1024} KiB pieces, where vLLM's DMA path manages 5-7 GB/s "
             "(vLLM PR #42212, H100)"]
    return [*title, *_table(("piece", "dir", "kernel GB/s", "copy engine GB/s", "kernel/engine",
                            "regime"), rows)]


def _time_cases(timer: Timer, cases: list[Case], warmups: int) -> list[dict]:
    for case in cases:  # warm every shape (and compile) before timing any
        for _ in range(warmups):
            case.fn()
    timer._sync()
    return [_summarize(case, *timer.measure(case)) for case in cases]


def piece_sweep(device: str, dry_run: bool, backend: str, sm_budget: int | None, reps: int,
                timer: Timer, rng) -> dict:
    """Kernel against copy engine per piece size; the crossover per direction is the smallest
    piece from which the copy engine is at least as fast."""
    from kvtriton.specs import FullAttentionSpec, KVLayout

    heads, n = (SWEEP_HEADS_DRY, 2) if dry_run else (SWEEP_HEADS, SWEEP_BLOCKS)
    rows = []
    for h in heads:
        spec = FullAttentionSpec(16, h, 128, 2)
        layout = KVLayout([spec], name=f"pieces-{spec.page_bytes // 1024}KiB")
        scenario = Scenario(layout.name, layout, _llama_pairs([n], rng), device, backend,
                            sm_budget)
        timed = _time_cases(timer, scenario.cases(("kernel", "copy_engine"), reps),
                            1 if dry_run else 3)
        rows.extend({**row, "piece_bytes": spec.page_bytes} for row in timed)
        scenario.engine.close()
    crossover = {}
    for d in ("d2h", "h2d"):
        wins = [r["piece_bytes"] for r in rows
                if r["direction"] == d and r["method"] == "copy_engine"
                and r["gbps_median"] >= _find(rows, direction=d, method="kernel",
                                              piece_bytes=r["piece_bytes"])["gbps_median"]]
        crossover[d] = min(wins) if wins else None
    from kvtriton.engine.copy_engine import COPY_ENGINE_MAX_PIECES, COPY_ENGINE_MIN_PIECE_BYTES

    return {"blocks": n, "layers": 2, "rows": rows, "measured_crossover_bytes": crossover,
            "COPY_ENGINE_MIN_PIECE_BYTES": COPY_ENGINE_MIN_PIECE_BYTES,
            "COPY_ENGINE_MAX_PIECES": COPY_ENGINE_MAX_PIECES,
            "note": ("copy_engine pieces are one torch copy_ each (no cuMemcpyBatchAsync through "
                     "torch): below a few hundred KiB its time is host submission, not DMA")}


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
    backend = "triton" if cuda or _interpreted() else "torch"
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
           "gemm_alone_ms": _pct(gemm_alone, 50) * 1e3}
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


def _interpreted() -> bool:
    from kvtriton.kernels.copy_blocks import INTERPRETED

    return INTERPRETED


def run(quick: bool, dry_run: bool, sm_budget: int | None, reps: int | None,
        extras: bool = True) -> dict:
    cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if cuda else "cpu"
    backend = "triton" if cuda or _interpreted() else "torch"
    rng = np.random.default_rng(0)
    llama, mamba, by_layers = _layouts(dry_run)
    if dry_run:
        llama_sizes, mamba_sizes, reps = LLAMA_SIZES_DRY, [1], reps or 1
    elif quick:
        llama_sizes, mamba_sizes, reps = LLAMA_SIZES_QUICK, MAMBA_SIZES_QUICK, reps or 5
    else:
        llama_sizes, mamba_sizes, reps = LLAMA_SIZES, MAMBA_SIZES, reps or 20
    layers_pairs = 4 if dry_run else LAYERS_PAIRS

    timer = Timer(cuda)
    all_methods = ("kernel", "copy_engine", "loop", "batched", "ceiling")
    plan = [
        ("llama3-8b", llama, lambda: _llama_pairs(llama_sizes, rng), all_methods),
        ("nemotron-h-8b", mamba, lambda: _mamba_pairs(mamba_sizes, rng), all_methods),
        *((f"layers-{n}", lay, lambda: _llama_pairs([layers_pairs], rng), ("kernel",))
          for n, lay in by_layers.items()),
    ]
    results = []
    for name, layout, pairs, methods in plan:
        scenario = Scenario(name, layout, pairs(), device, backend, sm_budget)
        results.extend(_time_cases(timer, scenario.cases(methods, reps), 1 if dry_run else 3))
        scenario.engine.close()
        del scenario
        if cuda:
            torch.cuda.empty_cache()
    sweep = piece_sweep(device, dry_run, backend, sm_budget, reps, timer, rng) if extras else None
    if cuda:
        torch.cuda.empty_cache()
    busy = contention(device, dry_run, sm_budget, reps) if extras else None
    # The dry run's sizes are all below TARGET_FROM_BLOCKS: its largest stands in, so the target
    # code runs on the CPU too (judging nothing).
    target_from = max(llama_sizes) if dry_run else TARGET_FROM_BLOCKS
    targets = evaluate_targets(results, evaluate=cuda, contention=busy, sweep=sweep,
                               target_from=target_from)
    return {
        "mode": "gpu" if cuda else "cpu-dry-run",
        "note": ("CUDA-event timing of back-to-back launches of prepared steps on the GPU"
                 if cuda else
                 "CPU tensors, tiny layouts, wall-clock timing: exercises the harness only, the "
                 "numbers are not link bandwidth"),
        "backend": backend,
        "sm_budget": sm_budget,
        "layouts": {"llama3-8b": llama.describe(), "nemotron-h-8b": mamba.describe()},
        "mamba_pairs": ("nemotron-h-8b: blocks_per_launch counts Mamba state blocks; each comes "
                        "with 16 attention blocks (pairs = 17 x blocks_per_launch)"),
        "batched_note": ("per group: index_select of each segment into a [n, group_bytes] "
                         "staging tensor, then one copy to CPU blocks 0..n-1; where a group's "
                         "block is narrower than the CPU block (nemotron-h-8b) that copy is "
                         "strided and torch stages it through pageable memory"),
        "timing_note": ("time_us: device time per launch of back-to-back launches (kernel: of a "
                        "prepared step, host preparation excluded); host_us: wall time of the "
                        "whole submitting call, preparation included"),
        "cuMemcpyBatchAsync": memcpy_batch_status(),
        "target_from_blocks": target_from,
        "targets": targets,
        "targets_summary": targets_summary(targets),
        "report": [*piece_table(sweep), *([""] if sweep else []), *target_table(targets)],
        "piece_sweep": sweep,
        "contention": busy,
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few sizes only")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the harness on CPU tensors at tiny sizes (no GPU needed)")
    parser.add_argument("--sm-budget", type=int, default=None, help="kernel programs (SMs)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per shape")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.dry_run:
        print("bench_kernels: no CUDA device on this machine; nothing measured "
              "(--dry-run runs the harness on CPU tensors)")
        return 0
    if not torch.cuda.is_available():
        # Must precede the first import of the kernel module to run it in the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    payload = run(args.quick, args.dry_run, args.sm_budget, args.reps)
    name = "bench_kernels_cpu_dryrun" if args.dry_run else (
        "bench_kernels_quick" if args.quick else "bench_kernels")
    path = write_result(name, payload, args.results_dir)
    print(f"bench_kernels: {len(payload['results'])} timings -> {path}\n")
    print("\n".join(payload["report"]))
    return exit_code(payload["targets"])


if __name__ == "__main__":
    raise SystemExit(main())
