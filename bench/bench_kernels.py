"""Bandwidth of the one-launch copy kernel against per-block and batched copies (GPU).

For Llama-3-8B-like blocks (16 tokens, 32 layers, 2 MiB per block) at 1 to 4,096 blocks per launch
and for the Mamba hybrid preset (``nemotron-h-8b``: 16 attention blocks per Mamba state block),
each direction (D2H store, H2D load) is timed for:

- ``kernel``: ``kvtriton.kernels.copy_blocks``, one launch for every group and layer;
- ``loop``: one ``copy_`` per (block, layer, part), the per-block baseline;
- ``batched``: per segment ``index_select`` into a staging buffer plus one copy (the CPU blocks of a
  step are made consecutive for it); ``cuMemcpyBatchAsync`` is reported as reachable or not;
- ``ceiling``: one contiguous copy between GPU memory and the pinned pool, the link's practical
  ceiling, measured in the same run.

Device time comes from CUDA events after a warm-up of every shape of a scenario; GB/s from the
explicit bytes moved (pairs x the group's bytes per block); host time per launch is the wall time
of the submitting call. Results (median, p10, p90) and the targets go to
``bench/results/bench_kernels.json``.

    python -m bench.bench_kernels            # full size, needs CUDA
    python -m bench.bench_kernels --quick    # a few sizes
    python -m bench.bench_kernels --dry-run  # the same harness on CPU tensors, tiny sizes
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.common import write_result

LLAMA_SIZES = [2**i for i in range(13)]  # 1 .. 4096 blocks per launch
LLAMA_SIZES_QUICK = [1, 16, 64, 256]
MAMBA_SIZES = [1, 2, 4, 8]  # Mamba state blocks per launch, with 16 attention blocks each
MAMBA_SIZES_QUICK = [1, 2]
LAYER_COUNTS = (8, 32, 64)
LAYERS_PAIRS = 256
LOOP_MAX_PAIRS = 1024  # the per-block loop is host-bound; above this it only costs time
TARGET_FROM_BLOCKS = 64

TARGETS = {
    "d2h_vs_ceiling": ("D2H kernel >= 0.90 x the contiguous D2H ceiling from 64 blocks up "
                       "(llama3-8b)", 0.90),
    "d2h_vs_loop": ("D2H kernel >= 5x the per-block copy_ loop from 64 blocks up (llama3-8b, "
                    f"loop measured up to {LOOP_MAX_PAIRS} blocks)", 5.0),
    "h2d_vs_ceiling": ("H2D kernel >= 0.70 x the contiguous H2D ceiling from 64 blocks up "
                       "(llama3-8b)", 0.70),
    "host_time_vs_layers": ("host time per launch independent of the number of layers: max/min "
                            f"over {LAYER_COUNTS} layers at {LAYERS_PAIRS} blocks <= 1.25", 1.25),
}


@dataclass(slots=True)
class Case:
    scenario: str
    size: int  # blocks per launch (Mamba state blocks for the hybrid)
    n_pairs: int
    nbytes: int
    method: str
    direction: str
    fn: Callable[[], None]
    reps: int


class Timer:
    """CUDA events on the current stream when ``cuda``; the wall clock otherwise."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def measure(self, fn: Callable[[], None], reps: int) -> tuple[list[float], list[float]]:
        device_s, host_s = [], []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                device_s.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                device_s.append(t1 - t0)
            host_s.append(t1 - t0)
        return device_s, host_s


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
        from kvtriton.kernels.copy_blocks import copy_blocks
        from kvtriton.kernels.reference import load_blocks_loop, store_blocks_loop

        eng = self.engine
        out = []
        for n, (gpu, cpu, grp) in self.pair_sets.items():
            nbytes = self.nbytes(n)
            for direction in ("store", "load"):
                d = "d2h" if direction == "store" else "h2d"
                if "kernel" in methods:
                    def kernel(direction=direction, gpu=gpu, cpu=cpu, grp=grp):
                        copy_blocks(direction, eng.table, eng.cpu_pool, gpu, cpu, grp,
                                    sm_budget=eng.sm_budget,
                                    cpu_pool_device_ptr=eng.cpu_pool_device_ptr)
                    out.append(Case(self.name, n, len(gpu), nbytes, "kernel", d, kernel, reps))
                if "loop" in methods and n <= LOOP_MAX_PAIRS:
                    loop_fn = store_blocks_loop if direction == "store" else load_blocks_loop

                    def loop(loop_fn=loop_fn, gpu=gpu, cpu=cpu, grp=grp):
                        loop_fn(eng.segments, eng.cpu_pool, gpu, cpu, grp,
                                non_blocking=eng.device.type == "cuda")
                    out.append(Case(self.name, n, len(gpu), nbytes, "loop", d, loop,
                                    max(2, reps // 4)))
                if "batched" in methods:
                    out.append(Case(self.name, n, len(gpu), nbytes, "batched", d,
                                    self._batched(direction, gpu, grp), reps))
                if "ceiling" in methods:
                    out.append(Case(self.name, n, len(gpu), nbytes, "ceiling", d,
                                    self._contiguous(direction, nbytes), reps))
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


def _summarize(case: Case, device_s: list[float], host_s: list[float]) -> dict:
    gbps = [case.nbytes / t / 1e9 for t in device_s]
    return {
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


def _find(results, **key) -> dict | None:
    for r in results:
        if all(r[k] == v for k, v in key.items()):
            return r
    return None


def evaluate_targets(results: list[dict], evaluate: bool) -> dict:
    """Each bandwidth target: the worst ratio over the sizes it covers, and whether it held."""
    out = {}
    ratios: dict[str, list[float]] = {k: [] for k in TARGETS}
    for r in results:
        if r["scenario"] != "llama3-8b" or r["method"] != "kernel" \
                or r["blocks_per_launch"] < TARGET_FROM_BLOCKS:
            continue
        ceiling = _find(results, scenario="llama3-8b", method="ceiling", direction=r["direction"],
                        blocks_per_launch=max(x["blocks_per_launch"] for x in results
                                    if x["scenario"] == "llama3-8b"))
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
    for key, (text, bound) in TARGETS.items():
        vals = ratios[key]
        if not vals:
            out[key] = {"target": text, "value": None, "met": None, "note": "not measured"}
            continue
        worst = max(vals) if key == "host_time_vs_layers" else min(vals)
        met = worst <= bound if key == "host_time_vs_layers" else worst >= bound
        out[key] = {"target": text, "value": worst, "met": bool(met) if evaluate else None}
        if not evaluate:
            out[key]["note"] = "not evaluated: CPU dry run, the numbers are not link bandwidth"
    return out


def run(quick: bool, dry_run: bool, sm_budget: int | None, reps: int | None) -> dict:
    cuda = torch.cuda.is_available() and not dry_run
    device = "cuda" if cuda else "cpu"
    from kvtriton.kernels.copy_blocks import INTERPRETED

    backend = "triton" if cuda or INTERPRETED else "torch"
    rng = np.random.default_rng(0)
    llama, mamba, by_layers = _layouts(dry_run)
    if dry_run:
        llama_sizes, mamba_sizes, reps = [1, 4], [1], reps or 2
    elif quick:
        llama_sizes, mamba_sizes, reps = LLAMA_SIZES_QUICK, MAMBA_SIZES_QUICK, reps or 5
    else:
        llama_sizes, mamba_sizes, reps = LLAMA_SIZES, MAMBA_SIZES, reps or 20
    layers_pairs = 4 if dry_run else LAYERS_PAIRS

    timer = Timer(cuda)
    all_methods = ("kernel", "loop", "batched", "ceiling")
    plan = [
        ("llama3-8b", llama, lambda: _llama_pairs(llama_sizes, rng), all_methods),
        ("nemotron-h-8b", mamba, lambda: _mamba_pairs(mamba_sizes, rng), all_methods),
        *((f"layers-{n}", lay, lambda: _llama_pairs([layers_pairs], rng), ("kernel",))
          for n, lay in by_layers.items()),
    ]
    results = []
    for name, layout, pairs, methods in plan:
        scenario = Scenario(name, layout, pairs(), device, backend, sm_budget)
        cases = scenario.cases(methods, reps)
        for case in cases:  # warm every shape (and compile) before timing any
            for _ in range(1 if dry_run else 3):
                case.fn()
        if cuda:
            torch.cuda.synchronize()
        for case in cases:
            device_s, host_s = timer.measure(case.fn, case.reps)
            results.append(_summarize(case, device_s, host_s))
        scenario.engine.close()
        del scenario, cases
        if cuda:
            torch.cuda.empty_cache()
    return {
        "mode": "gpu" if cuda else "cpu-dry-run",
        "note": ("CUDA-event timing on the GPU" if cuda else
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
        "cuMemcpyBatchAsync": memcpy_batch_status(),
        "targets": evaluate_targets(results, evaluate=cuda),
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
    print(f"bench_kernels: {len(payload['results'])} timings -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
