"""Kernel correctness, run as part of the harness: the Triton copy kernel, the copy-engine path
and ``backend="auto"`` against the torch reference on every preset's real per-block segment sizes
(with fewer layers), whole pools and whole KV tensors compared byte for byte. Under
``TRITON_INTERPRET=1`` on a machine without CUDA, on the GPU otherwise, where every engine's side
streams are synchronized (``flush``) before anything is compared. Writes
``bench/results/kernel_check.json`` (``--results-dir`` elsewhere).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from bench.common import write_result
from kvtriton.engine import TransferEngine
from kvtriton.engine.descriptors import allocate_kv_caches
from kvtriton.planner import PlannerMeta, Transfer
from kvtriton.specs import PRESETS, KVLayout, preset

LAYERS = 2  # per group: enough to exercise multi-layer descriptors, cheap in the interpreter
PAIRS = 6


def _shrunk(name: str) -> KVLayout:
    base = preset(name)
    groups = [dataclasses.replace(g, num_layers=min(g.num_layers, LAYERS)) for g in base.groups]
    if name == "nemotron-h-8b":  # a 2 MiB SSM state is slow to interpret; keep its odd shape
        groups[1] = dataclasses.replace(groups[1], ssm_state_shape=(8, 64, 16))
    return KVLayout(groups, base.hash_block_size, name=f"{name}-{LAYERS}L")


def _tensors(kv) -> list[torch.Tensor]:
    """Every KV tensor as raw bytes: random bf16 bytes hold NaNs, which never compare equal."""
    return [t.view(torch.uint8) for group in kv for layer in group
            for t in (layer if isinstance(layer, tuple) else (layer,))]


def _fill_random(kv, gen: torch.Generator) -> None:
    for t in _tensors(kv):
        t.copy_(torch.randint(0, 256, t.shape, generator=gen, dtype=torch.uint8))


BACKENDS = ("torch", "triton", "copy_engine", "auto")  # the first is the reference


def _step(engine: TransferEngine, meta: PlannerMeta) -> tuple[list[int], list[str]]:
    """Run one step and wait for it: on CUDA the copies run on the engine's side streams, which
    neither ``poll`` nor a later read on the current stream waits for."""
    engine.execute(meta)
    engine.flush()
    return engine.poll()


def check(name: str, device: str, seed: int = 0) -> dict:
    layout = _shrunk(name)
    gen = torch.Generator().manual_seed(seed)
    n_gpu, n_cpu = 16, 12
    kv = {b: allocate_kv_caches(layout, n_gpu, device=device) for b in BACKENDS}
    ref = BACKENDS[0]
    _fill_random(kv[ref], gen)
    for b in BACKENDS[1:]:
        for ta, tb in zip(_tensors(kv[b]), _tensors(kv[ref]), strict=True):
            ta.copy_(tb)
    engines = {b: TransferEngine(layout, kv[b], n_cpu, backend=b) for b in BACKENDS}
    for e in engines.values():
        e.cpu_pool.fill_(0xA5)
    gpu = torch.randperm(n_gpu - 1, generator=gen)[:PAIRS].add(1).tolist()
    cpu = torch.randperm(n_cpu, generator=gen)[:PAIRS].tolist()
    groups = [i % layout.num_groups for i in range(PAIRS)]
    t0 = time.perf_counter()
    reported = {b: _step(e, PlannerMeta(Transfer(0, gpu, cpu, groups), Transfer(), {}))
                for b, e in engines.items()}
    store_ok = {b: torch.equal(engines[b].cpu_pool, engines[ref].cpu_pool)
                and reported[b] == ([0], []) for b in BACKENDS[1:]}
    # Load the stored blocks into other GPU blocks and compare every KV tensor.
    dst = [b for b in range(1, n_gpu) if b not in gpu][:PAIRS]
    reported = {b: _step(e, PlannerMeta(Transfer(), Transfer(0, dst, cpu, groups), {0: ["r"]}))
                for b, e in engines.items()}
    load_ok = {b: all(torch.equal(ta.cpu(), tb.cpu())
                      for ta, tb in zip(_tensors(kv[b]), _tensors(kv[ref]), strict=True))
               and reported[b] == ([], ["r"]) for b in BACKENDS[1:]}
    copy_engine_groups = engines["auto"].copy_engine_groups(groups).tolist()
    for e in engines.values():
        e.close()
    return {"preset": name, "layout": layout.describe(), "pairs": PAIRS,
            "store_bit_exact": all(store_ok.values()), "load_bit_exact": all(load_ok.values()),
            "store_bit_exact_by_backend": store_ok, "load_bit_exact_by_backend": load_ok,
            "auto_copy_engine_groups": copy_engine_groups,
            "seconds": time.perf_counter() - t0}


def findings(name: str, doc: dict) -> dict:
    """Whether every copy was bit-exact, and for each hybrid preset (groups of different block
    bytes) the share of its CPU block that its smallest group's block fills: the bytes a
    one-size CPU pool leaves unused (the presets' own byte counts)."""
    fill = {}
    for preset_name in sorted(PRESETS):
        layout = preset(preset_name)
        per = layout.group_block_bytes
        if len(set(per)) > 1:
            fill[preset_name] = min(per) / layout.cpu_block_bytes
    return {"all_bit_exact": all(r["store_bit_exact"] and r["load_bit_exact"]
                                 for r in doc["rows"]),
            "smallest_group_fill": fill}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results-dir", type=Path, default=None)
    # The harness calls main() with no arguments: never read its own command line.
    args = ap.parse_args([] if argv is None else argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    mode = "cuda" if cuda else "TRITON_INTERPRET=1 on CPU"
    rows = []
    for name in PRESETS:
        row = check(name, device)
        rows.append(row)
        ok = row["store_bit_exact"] and row["load_bit_exact"]
        bad = [b for b in BACKENDS[1:] if not (row["store_bit_exact_by_backend"][b]
                                               and row["load_bit_exact_by_backend"][b])]
        print(f"  {', '.join(BACKENDS[1:])} vs torch reference, {name:14s} ({mode}): "
              f"{'bit-exact' if ok else 'MISMATCH in ' + ', '.join(bad)} in "
              f"{row['seconds']:.1f}s")
    payload = {"mode": mode, "backends": list(BACKENDS), "rows": rows}
    path = write_result("kernel_check", payload, args.results_dir, findings)
    print(f"wrote {path}")
    if not all(r["store_bit_exact"] and r["load_bit_exact"] for r in rows):
        raise SystemExit("kernel check failed: a backend and the torch reference differ")
    return payload


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
