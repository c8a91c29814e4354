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

The targets and their verdict are in ``bench.kernels.targets``, the timing of a shape in
``bench.kernels.timing`` and the contention run in ``bench.kernels.contention``.

    python -m bench.kernels.bandwidth            # full size, needs CUDA
    python -m bench.kernels.bandwidth --quick    # a few sizes, the sweep and the contention run
    python -m bench.kernels.bandwidth --dry-run  # the same harness on CPU tensors, tiny sizes
"""

from __future__ import annotations

import argparse
import functools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result
from bench.kernels.contention import contention
from bench.kernels.targets import (
    LAYER_COUNTS,
    LAYERS_PAIRS,
    LOOP_MAX_PAIRS,
    SWEEP_BLOCKS,
    TARGET_FROM_BLOCKS,
    evaluate_targets,
    exit_code,
    find_row,
    piece_table,
    target_table,
    targets_summary,
)
from bench.kernels.timing import Case, Timer, interpreted, time_cases

LLAMA_SIZES = [2**i for i in range(13)]  # 1 .. 4096 blocks per launch
LLAMA_SIZES_QUICK = [1, 16, 64, 256]
LLAMA_SIZES_DRY = [1, 4]
MAMBA_SIZES = [1, 2, 4, 8]  # Mamba state blocks per launch, with 16 attention blocks each
MAMBA_SIZES_QUICK = [1, 2]
SWEEP_HEADS = (1, 2, 4, 6, 8, 16)  # K/V pages of 4, 8, 16, 24, 32, 64 KiB (16 tokens x 128 x bf16)
SWEEP_HEADS_DRY = (1, 6)  # 4 and 24 KiB: the ends of the small-piece regime


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
        timed = time_cases(timer, scenario.cases(("kernel", "copy_engine"), reps),
                           1 if dry_run else 3)
        rows.extend({**row, "piece_bytes": spec.page_bytes} for row in timed)
        scenario.engine.close()
    crossover = {}
    for d in ("d2h", "h2d"):
        wins = [r["piece_bytes"] for r in rows
                if r["direction"] == d and r["method"] == "copy_engine"
                and r["gbps_median"] >= find_row(rows, direction=d, method="kernel",
                                                 piece_bytes=r["piece_bytes"])["gbps_median"]]
        crossover[d] = min(wins) if wins else None
    from kvtriton.engine.copy_engine import COPY_ENGINE_MAX_PIECES, COPY_ENGINE_MIN_PIECE_BYTES

    return {"blocks": n, "layers": 2, "rows": rows, "measured_crossover_bytes": crossover,
            "COPY_ENGINE_MIN_PIECE_BYTES": COPY_ENGINE_MIN_PIECE_BYTES,
            "COPY_ENGINE_MAX_PIECES": COPY_ENGINE_MAX_PIECES,
            "note": ("copy_engine pieces are one torch copy_ each (no cuMemcpyBatchAsync through "
                     "torch): below a few hundred KiB its time is host submission, not DMA")}


def run(quick: bool, dry_run: bool, sm_budget: int | None, reps: int | None,
        extras: bool = True) -> dict:
    cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if cuda else "cpu"
    backend = "triton" if cuda or interpreted() else "torch"
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
        results.extend(time_cases(timer, scenario.cases(methods, reps), 1 if dry_run else 3))
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
