"""Block copies between paged GPU KV tensors and the block-major CPU pool, one launch per step.

A step's store (GPU -> CPU, gather) or load (CPU -> GPU, scatter) is a list of pairs
``(gpu_block, cpu_block, group)``. Every group and every layer moves in one launch of
``_copy_blocks_kernel`` per access width present (one launch for every shipped preset, whose
segments are all 16-byte aligned), driven by int64 tables that are built once per engine
(``kvtriton.kernels.pairs.CopyTable``, by ``kvtriton.engine.descriptors.build_copy_table``):

- ``rows``  ``[R, 5]``: one row per segment (a layer's K or V page, a Mamba conv or SSM state):
  GPU base address, GPU block stride (bytes), segment bytes, offset in the CPU block, and the
  access width in bytes (16, 4 or 1) that every address of that row is aligned to;
- ``units`` ``[U, 3]``: the work units of one block: row, first byte, bytes; ordered by width
  class, then group. Large segments (Mamba SSM states, MiBs) are cut into chunks so that a few
  pairs still spread over every program;
- ``group_units`` ``[W, G, 2]``: for width class w (``WIDTHS[w]``) and group g, the range of
  g's units of that width in ``units``.

The access width is a ``constexpr`` of the launch: a runtime branch over the three widths inlines
three copy loops into one kernel, which takes 255 registers per thread plus spills on sm_90 at 8
warps (a whole SM's register file for each of the persistent programs); one width per launch
takes about 48. ``tests/kernels/test_compiled.py`` checks this on the compiled artifact.

Per step the host sends only the pairs, sorted by group, and each width class's per-group unit and
pair ranges: one small int64 buffer, not one descriptor per (block x layer) as a batched memcpy
needs. ``prepare_copy`` does that host work once and ``launch_copy`` enqueues the launches, so a
benchmark can time launches of a prepared step back to back; ``copy_blocks`` does both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs

from kvtriton.kernels.pairs import CopyTable, validate_pairs
from kvtriton.validation import is_int

__all__ = [
    "DEFAULT_SM_BUDGET",
    "CopyLaunch",
    "copy_blocks",
    "launch_copy",
    "prepare_copy",
    "tile_bytes_for",
]

# Copies compete with the model for SMs: a few programs saturate a PCIe link (vLLM tuned 12 on
# an H100 for 8-32 KiB pieces), so the default grid stays small.
DEFAULT_SM_BUDGET = 16
# Bytes one program moves per loop iteration on the 16-byte path: four 16-byte vectors per thread
# at 8 warps, so each SM keeps enough reads in flight to cover host-memory latency (~1-2 us) on
# loads. Narrower paths move the same number of accesses per thread (tile_bytes_for), which keeps
# their registers below the 16-byte path's.
TILE_BYTES = 16384
NUM_WARPS = 8
# Units of work are at most this many bytes of one segment.
CHUNK_BYTES = 256 * 1024
# Access widths in bytes, widest first; a row gets the widest its addresses allow.
WIDTHS = (16, 4, 1)

INTERPRETED = bool(knobs.runtime.interpret)


@triton.jit
def _copy_span(src_addr, dst_addr, n_bytes, WIDTH: tl.constexpr, TILE: tl.constexpr,
               STREAM_STORE: tl.constexpr):
    """Copy ``n_bytes`` from address ``src_addr`` to ``dst_addr`` (int64 scalars) in tiles of
    ``TILE`` bytes, every address ``WIDTH``-byte aligned; full tiles unmasked so they vectorize.
    ``STREAM_STORE`` marks the stores streaming (``st.global.cs``): bytes written to the host pool
    are not read again by the GPU, so they should not displace the model's lines in L2."""
    if WIDTH == 16:
        # 4 x int32 per access; the hints let the compiler emit 128-bit accesses.
        p_src = tl.multiple_of(src_addr.to(tl.pointer_type(tl.int32)), 16)
        p_dst = tl.multiple_of(dst_addr.to(tl.pointer_type(tl.int32)), 16)
        n = tl.multiple_of(n_bytes // 4, 4)
        ELEMS: tl.constexpr = TILE // 4
    elif WIDTH == 4:
        p_src = src_addr.to(tl.pointer_type(tl.int32))
        p_dst = dst_addr.to(tl.pointer_type(tl.int32))
        n = n_bytes // 4
        ELEMS: tl.constexpr = TILE // 4
    else:
        p_src = src_addr.to(tl.pointer_type(tl.uint8))
        p_dst = dst_addr.to(tl.pointer_type(tl.uint8))
        n = n_bytes
        ELEMS: tl.constexpr = TILE
    o_t = tl.arange(0, ELEMS)  # [ELEMS]
    n_full = n // ELEMS * ELEMS
    for start in range(0, n_full, ELEMS):
        b_x = tl.load(p_src + start + o_t, eviction_policy="evict_first")  # [ELEMS]
        if STREAM_STORE:
            tl.store(p_dst + start + o_t, b_x, cache_modifier=".cs")
        else:
            tl.store(p_dst + start + o_t, b_x)
    if n_full < n:
        o_tail = n_full + o_t  # [ELEMS]
        m_tail = o_tail < n
        b_x = tl.load(p_src + o_tail, mask=m_tail, eviction_policy="evict_first")
        if STREAM_STORE:
            tl.store(p_dst + o_tail, b_x, mask=m_tail, cache_modifier=".cs")
        else:
            tl.store(p_dst + o_tail, b_x, mask=m_tail)


@triton.jit
def _copy_blocks_kernel(
    p_pairs,
    p_step_groups,
    p_rows,
    p_units,
    cpu_addr,
    cpu_block_bytes,
    num_groups,
    TO_CPU: tl.constexpr,
    WIDTH: tl.constexpr,
    TILE: tl.constexpr,
):
    """Copy every (pair, unit) of one step and one access width between GPU and CPU blocks.

    Grid: ``(num_programs,)``, persistent. The work of group g is ``pair_count[g] x unit_count[g]``
    items (item w: pair ``w // unit_count``, unit ``w % unit_count``); items are numbered across
    groups and program i takes the items congruent to i modulo the grid size.

    Pointers (all int64): ``p_pairs`` ``[n, 2]`` (gpu block, cpu block), sorted by group;
    ``p_step_groups`` ``[G, 4]`` (unit start, unit count, pair start, pair count) of this width
    class; ``p_rows`` ``[R, 5]`` and ``p_units`` ``[U, 3]`` as in the module docstring.
    ``cpu_addr`` is the device address of CPU block 0 and ``cpu_block_bytes`` the pool's row
    pitch, both in bytes. ``TO_CPU`` selects the store (gather into the CPU pool) or the load
    (scatter into GPU blocks); ``WIDTH`` (16, 4 or 1) the access width every unit of this launch
    allows; ``TILE`` the bytes per loop iteration.
    """
    i_prog = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0).to(tl.int64)
    done = i_prog * 0
    for i_g in range(num_groups):
        unit_start = tl.load(p_step_groups + i_g * 4 + 0)
        unit_count = tl.load(p_step_groups + i_g * 4 + 1)
        pair_start = tl.load(p_step_groups + i_g * 4 + 2)
        pair_count = tl.load(p_step_groups + i_g * 4 + 3)
        n_work = pair_count * unit_count
        # Continue the round-robin where the previous group left off, so small groups do not all
        # land on the first programs.
        first = (i_prog - done % n_prog + n_prog) % n_prog
        for w in range(first, n_work, n_prog):
            i_pair = pair_start + w // unit_count
            i_unit = unit_start + w % unit_count
            gpu_block = tl.load(p_pairs + i_pair * 2 + 0)
            cpu_block = tl.load(p_pairs + i_pair * 2 + 1)
            row = tl.load(p_units + i_unit * 3 + 0)
            byte_start = tl.load(p_units + i_unit * 3 + 1)
            n_bytes = tl.load(p_units + i_unit * 3 + 2)
            gpu_base = tl.load(p_rows + row * 5 + 0)
            gpu_stride = tl.load(p_rows + row * 5 + 1)
            cpu_offset = tl.load(p_rows + row * 5 + 3)
            gpu_at = gpu_base + gpu_block * gpu_stride + byte_start
            cpu_at = cpu_addr + cpu_block * cpu_block_bytes + cpu_offset + byte_start
            if TO_CPU:
                _copy_span(gpu_at, cpu_at, n_bytes, WIDTH, TILE, True)
            else:
                _copy_span(cpu_at, gpu_at, n_bytes, WIDTH, TILE, False)
        done += n_work


def tile_bytes_for(width: int, tile_bytes: int = TILE_BYTES) -> int:
    """Bytes per loop iteration on the ``width``-byte path: as many accesses per thread as the
    16-byte path makes with ``tile_bytes``."""
    return tile_bytes * width // WIDTHS[0]


def _check_pool(table: CopyTable, cpu_pool: torch.Tensor) -> None:
    if not isinstance(cpu_pool, torch.Tensor):
        raise ValueError(f"cpu_pool must be a torch.Tensor, got {type(cpu_pool).__name__}")
    if cpu_pool.dtype != torch.uint8 or cpu_pool.dim() != 2:
        raise ValueError(f"cpu_pool must be a 2-D uint8 tensor, got {cpu_pool.dtype} "
                         f"{tuple(cpu_pool.shape)}")
    if cpu_pool.shape[1] != table.cpu_block_bytes:
        raise ValueError(f"cpu_pool row bytes {cpu_pool.shape[1]} != cpu_block_bytes "
                         f"{table.cpu_block_bytes}")
    if not cpu_pool.is_contiguous():
        raise ValueError(f"cpu_pool must be contiguous, got strides {cpu_pool.stride()}")
    if cpu_pool.device.type != "cpu":
        raise ValueError(f"cpu_pool must live in host memory, got device {cpu_pool.device}")
    if cpu_pool.data_ptr() % 16:
        raise ValueError(f"cpu_pool address {cpu_pool.data_ptr():#x} is not 16-byte aligned")
    if table.device.type == "cuda" and not cpu_pool.is_pinned():
        raise ValueError("cpu_pool is not pinned (page-locked); a CUDA copy kernel cannot "
                         "address pageable host memory")


@dataclass(frozen=True, slots=True)
class CopyLaunch:
    """One step's copies, prepared on the host and ready to launch (``prepare_copy``).

    ``step`` is an int64 device tensor: ``[len(WIDTHS), G, 4]`` per-class group ranges followed by
    the ``[n, 2]`` sorted pairs; ``grids`` lists ``(width class, programs)`` of each launch;
    ``cpu_addr`` is the device address of CPU block 0 (bytes).
    """

    to_cpu: bool
    table: CopyTable
    step: torch.Tensor
    grids: tuple[tuple[int, int], ...]
    cpu_addr: int
    num_pairs: int
    tile_bytes: int
    num_warps: int


def _check_launch_args(direction: str, sm_budget, tile_bytes, num_warps) -> None:
    if direction not in ("store", "load"):
        raise ValueError(f"direction must be 'store' or 'load', got {direction!r}")
    if not is_int(sm_budget) or sm_budget <= 0:
        raise ValueError(f"sm_budget must be a positive int, got {sm_budget!r}")
    if not isinstance(tile_bytes, int) or tile_bytes < 16 or tile_bytes & (tile_bytes - 1):
        raise ValueError(f"tile_bytes must be a power of two multiple of 16, got {tile_bytes!r}")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {num_warps!r}")


def prepare_copy(
    direction: str,
    table: CopyTable,
    cpu_pool: torch.Tensor,
    gpu_blocks,
    cpu_blocks,
    groups,
    *,
    sm_budget: int = DEFAULT_SM_BUDGET,
    cpu_pool_device_ptr: int | None = None,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
    ids_checked: bool = False,
) -> CopyLaunch:
    """The host half of ``copy_blocks``: validate, sort the pairs by group, build the per-width
    ranges and send them to the device in one copy (queued on the current stream). Raises
    ``ValueError`` naming the bad value; see ``copy_blocks`` for the arguments."""
    _check_launch_args(direction, sm_budget, tile_bytes, num_warps)
    _check_pool(table, cpu_pool)
    cpu_addr = cpu_pool.data_ptr() if cpu_pool_device_ptr is None else cpu_pool_device_ptr
    if not is_int(cpu_addr) or cpu_addr <= 0 or cpu_addr % 16:
        raise ValueError(f"cpu_pool_device_ptr must be a positive, 16-byte aligned address, "
                         f"got {cpu_pool_device_ptr!r}")
    cpu_addr = int(cpu_addr)  # a NumPy int passes is_int; Triton specializes on Python ints
    if ids_checked:
        gpu, cpu, grp = gpu_blocks, cpu_blocks, groups
    else:
        gpu, cpu, grp = validate_pairs(table, cpu_pool.shape[0], direction,
                                       gpu_blocks, cpu_blocks, groups)
    n = len(gpu)
    if n and table.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"the Triton copy kernel needs CUDA tensors or TRITON_INTERPRET=1; the "
                         f"KV tensors are on {table.device}")

    num_classes, num_groups = table.group_units_host.shape[:2]
    counts = np.bincount(grp, minlength=num_groups)
    step = np.empty((num_classes, num_groups, 4), dtype=np.int64)
    step[:, :, :2] = table.group_units_host
    step[:, :, 2] = np.cumsum(counts) - counts
    step[:, :, 3] = counts
    work = (step[:, :, 1] * step[:, :, 3]).sum(axis=1)
    grids = tuple((w, min(int(sm_budget), int(work[w]))) for w in range(num_classes) if work[w])
    if not grids:
        return CopyLaunch(direction == "store", table, torch.zeros(0, dtype=torch.int64), (),
                          cpu_addr, n, tile_bytes, num_warps)

    # One host buffer, one host-to-device copy per step, whatever the number of launches.
    header = step.size
    host = torch.empty(header + 2 * n, dtype=torch.int64,
                       pin_memory=table.device.type == "cuda")
    host_np = host.numpy()
    host_np[:header] = step.reshape(-1)
    order = np.argsort(grp, kind="stable")
    pairs_np = host_np[header:].reshape(n, 2)
    pairs_np[:, 0] = gpu[order]
    pairs_np[:, 1] = cpu[order]
    dev = host.to(table.device, non_blocking=True)
    return CopyLaunch(direction == "store", table, dev, grids, cpu_addr, n, tile_bytes, num_warps)


def launch_copy(launch: CopyLaunch) -> int:
    """Enqueue the kernel launches of a prepared step on the current stream, one per access
    width present; they may be enqueued again (benchmarks). Returns the number of pairs."""
    table = launch.table
    num_classes, num_groups = table.group_units_host.shape[:2]
    header = num_classes * num_groups * 4
    pairs = launch.step[header:]
    for w, programs in launch.grids:
        width = WIDTHS[w]
        _copy_blocks_kernel[(programs,)](
            pairs, launch.step[w * num_groups * 4:(w + 1) * num_groups * 4], table.rows,
            table.units, launch.cpu_addr, table.cpu_block_bytes, num_groups,
            TO_CPU=launch.to_cpu, WIDTH=width, TILE=tile_bytes_for(width, launch.tile_bytes),
            num_warps=launch.num_warps,
        )
    return launch.num_pairs


def copy_blocks(
    direction: str,
    table: CopyTable,
    cpu_pool: torch.Tensor,
    gpu_blocks,
    cpu_blocks,
    groups,
    *,
    sm_budget: int = DEFAULT_SM_BUDGET,
    cpu_pool_device_ptr: int | None = None,
    tile_bytes: int = TILE_BYTES,
    num_warps: int = NUM_WARPS,
    ids_checked: bool = False,
) -> int:
    """Move blocks between GPU KV tensors and ``cpu_pool`` on the current stream: one launch
    per access width present in the step (one for the shipped presets).

    ``direction`` is ``"store"`` (GPU block ``gpu_blocks[i]`` of group ``groups[i]`` -> CPU block
    ``cpu_blocks[i]``) or ``"load"`` (the reverse). Ids are host sequences (lists, numpy or CPU
    tensors). ``cpu_pool`` is the ``[num_cpu_blocks, cpu_block_bytes]`` uint8 pool; with CUDA it
    must be pinned, and ``cpu_pool_device_ptr`` is its device address when that differs from the
    host one. At most ``sm_budget`` programs run per launch; ``tile_bytes`` is the bytes a program
    moves per loop iteration on the 16-byte path. Everything is validated before the launch
    (``ValueError`` naming the bad value; nothing is written then). ``ids_checked=True`` skips
    the id checks for int64 arrays that ``validate_pairs`` already returned for this table and
    pool (the engine validates a whole step before starting either direction). Returns the
    number of pairs.
    """
    return launch_copy(prepare_copy(
        direction, table, cpu_pool, gpu_blocks, cpu_blocks, groups, sm_budget=sm_budget,
        cpu_pool_device_ptr=cpu_pool_device_ptr, tile_bytes=tile_bytes, num_warps=num_warps,
        ids_checked=ids_checked))
