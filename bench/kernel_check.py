"""Kernel correctness, run as part of the harness: the Triton copy kernel against the torch
reference on every preset's real per-block segment sizes (with fewer layers), whole pools
compared byte for byte. Under ``TRITON_INTERPRET=1`` on a machine without CUDA, on the GPU
otherwise. Writes ``bench/results/kernel_check.json``.
"""

from __future__ import annotations

import dataclasses
import time

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


def check(name: str, device: str, seed: int = 0) -> dict:
    layout = _shrunk(name)
    gen = torch.Generator().manual_seed(seed)
    n_gpu, n_cpu = 16, 12
    kv = {b: allocate_kv_caches(layout, n_gpu, device=device) for b in ("triton", "torch")}
    _fill_random(kv["torch"], gen)
    for ta, tb in zip(_tensors(kv["triton"]), _tensors(kv["torch"]), strict=True):
        ta.copy_(tb)
    engines = {b: TransferEngine(layout, kv[b], n_cpu, backend=b) for b in kv}
    for e in engines.values():
        e.cpu_pool.fill_(0xA5)
    gpu = torch.randperm(n_gpu - 1, generator=gen)[:PAIRS].add(1).tolist()
    cpu = torch.randperm(n_cpu, generator=gen)[:PAIRS].tolist()
    groups = [i % layout.num_groups for i in range(PAIRS)]
    t0 = time.perf_counter()
    for e in engines.values():
        e.execute(PlannerMeta(Transfer(0, gpu, cpu, groups), Transfer(), {}))
        e.poll()
    store_ok = torch.equal(engines["triton"].cpu_pool.cpu(), engines["torch"].cpu_pool.cpu())
    # Load the stored blocks into other GPU blocks and compare every KV tensor.
    dst = [b for b in range(1, n_gpu) if b not in gpu][:PAIRS]
    for e in engines.values():
        e.execute(PlannerMeta(Transfer(), Transfer(0, dst, cpu, groups), {0: ["r"]}))
        e.poll()
    load_ok = all(torch.equal(ta.cpu(), tb.cpu())
                  for ta, tb in zip(_tensors(kv["triton"]), _tensors(kv["torch"]), strict=True))
    return {"preset": name, "layout": layout.describe(), "pairs": PAIRS,
            "store_bit_exact": store_ok, "load_bit_exact": load_ok,
            "seconds": time.perf_counter() - t0}


def main() -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    mode = "cuda" if cuda else "TRITON_INTERPRET=1 on CPU"
    rows = []
    for name in PRESETS:
        row = check(name, device)
        rows.append(row)
        ok = row["store_bit_exact"] and row["load_bit_exact"]
        print(f"  kernel vs torch reference, {name:14s} ({mode}): "
              f"{'bit-exact' if ok else 'MISMATCH'} in {row['seconds']:.1f}s")
    path = write_result("kernel_check", {"mode": mode, "rows": rows})
    print(f"wrote {path}")
    if not all(r["store_bit_exact"] and r["load_bit_exact"] for r in rows):
        raise SystemExit("kernel check failed: the Triton kernel and the torch reference differ")
    return {"mode": mode, "rows": rows}


if __name__ == "__main__":
    main()
