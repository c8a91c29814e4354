"""The copy kernel's compiled resources, checked from the artifact on a machine without a GPU.

Triton compiles ahead of time for a target it is given (``GPUTarget("cuda", 90, 32)``) with no
device present (``kvtriton.kernels.compiled``). For sm_90 and sm_80, each direction and each
access width, the compiled kernel must keep to its contract: no spills and at most
``MAX_REGISTERS`` registers per thread at the launcher's warps (so the persistent programs leave
most of each SM's register file to the model), 128-bit global loads and stores on the 16-byte
path, streaming stores (``st.global.cs``) into the host pool, and no shared-memory round trip
(``convert_layout`` / ``local_alloc``) between load and store. These limits refuse a kernel that
branches over the widths at run time, which takes 255 registers with spills on sm_90 and two
``convert_layout`` through 4 KiB of shared memory.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import triton

from kvtriton.kernels.copy_blocks import NUM_WARPS, WIDTHS

try:
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401 - needed by report()

    from kvtriton.kernels.compiled import ARCHS, report
except ImportError as exc:  # pragma: no cover - a Triton without the NVIDIA backend
    pytest.skip(f"Triton's NVIDIA backend is not importable: {exc}", allow_module_level=True)

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
if not CUOBJDUMP.exists():  # pragma: no cover - every Linux x86-64 wheel ships it
    pytest.skip(f"no cuobjdump in the Triton wheel ({CUOBJDUMP})", allow_module_level=True)

MAX_REGISTERS = 64


@cache
def _compiled() -> dict:
    # One compilation pass for every case (a fresh interpreter here, where the tests interpret).
    return {(r["arch"], r["direction"], r["width"]): r for r in report(ARCHS, NUM_WARPS)}


def compiled(arch: int, direction: str, width: int) -> dict:
    return _compiled()[arch, direction, width]


CASES = [(arch, direction, width) for arch in ARCHS for direction in ("store", "load")
         for width in WIDTHS]


def _data_accesses(ptx: str, op: str) -> list[str]:
    """Global ``op`` (``ld`` / ``st``) instructions moving KV bytes: the table reads are scalar
    64-bit loads (``ld.global.b64``) without a cache hint, the copy's loads carry evict_first."""
    lines = [ln.strip() for ln in ptx.splitlines() if f"{op}.global" in ln]
    if op == "ld":
        lines = [ln for ln in lines if "evict_first" in ln]
    return lines


@pytest.mark.parametrize(("arch", "direction", "width"), CASES,
                         ids=[f"sm{a}-{d}-w{w}" for a, d, w in CASES])
def test_no_spills_and_few_registers(arch, direction, width):
    k = compiled(arch, direction, width)
    assert k["spill_bytes"] == 0 and k["stack_bytes"] == 0, {
        key: v for key, v in k.items() if key not in ("ptx", "ttgir")}
    assert k["registers"] <= MAX_REGISTERS, (
        f"sm_{arch} {direction} width {width}: {k['registers']} registers per thread at "
        f"{NUM_WARPS} warps (limit {MAX_REGISTERS})")


@pytest.mark.parametrize(("arch", "direction", "width"), CASES,
                         ids=[f"sm{a}-{d}-w{w}" for a, d, w in CASES])
def test_no_shared_memory_between_load_and_store(arch, direction, width):
    k = compiled(arch, direction, width)
    for op in ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load", "ttg.local_store",
               "async_copy"):
        assert op not in k["ttgir"], f"{op} in the TTGIR of sm_{arch} {direction} w{width}"
    assert k["shared_bytes"] == 0


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("direction", ["store", "load"])
def test_16_byte_path_moves_128_bit_vectors(arch, direction):
    ptx = compiled(arch, direction, 16)["ptx"]
    loads, stores = _data_accesses(ptx, "ld"), _data_accesses(ptx, "st")
    assert loads and stores
    assert all(".v4.b32" in ln for ln in loads), loads
    assert all(".v4.b32" in ln for ln in stores), stores


@pytest.mark.parametrize("arch", ARCHS)
def test_stores_into_the_host_pool_stream(arch):
    """Stores write the pool once and the GPU never reads it back: ``st.global.cs`` (evict
    first); loads write GPU blocks the model reads next, with the default setup."""
    for width in WIDTHS:
        store = _data_accesses(compiled(arch, "store", width)["ptx"], "st")
        load = _data_accesses(compiled(arch, "load", width)["ptx"], "st")
        assert store and all(ln.split()[0].startswith("st.global.cs") or
                             ln.split()[1].startswith("st.global.cs") for ln in store), store
        assert load and not any(".cs" in ln for ln in load), load


def test_narrow_paths_are_not_vectorized_past_their_alignment():
    """The negative control of the vector check: 4- and 1-byte rows must not use v4."""
    for width in (4, 1):
        ptx = compiled(90, "store", width)["ptx"]
        assert not any(".v4" in ln for ln in _data_accesses(ptx, "st"))
