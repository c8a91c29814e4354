"""The copy kernel compiled ahead of time for a GPU target, and its resources from the artifact.

Triton compiles for a target it is given (``GPUTarget("cuda", 90, 32)``) with no device present,
so a CPU-only machine can check what a GPU will run: registers per thread and stack (from
``cuobjdump -res-usage`` of the cubin), spill bytes (``ptxas -v`` on the same PTX), shared memory,
the PTX and the TTGIR. Both tools ship in the Triton wheel. The signature and divisibility hints
are those a real launch specializes to: 16-byte aligned tables and pool address, a 16-byte
multiple row pitch below 2 GiB, several groups.

Under ``TRITON_INTERPRET=1`` the ``@triton.jit`` functions are interpreter objects that cannot be
compiled, so ``report`` runs the compilation in a fresh interpreter without it when needed::

    python -m kvtriton.kernels.compiled              # a table for sm_90 and sm_80
    python -m kvtriton.kernels.compiled --json       # every case with its PTX and TTGIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtriton.kernels.copy_blocks import (
    INTERPRETED,
    NUM_WARPS,
    TILE_BYTES,
    WIDTHS,
    _copy_blocks_kernel,
    tile_bytes_for,
)

__all__ = ["ARCHS", "SIGNATURE", "compile_copy_kernel", "report"]

ARCHS = (90, 80)
SIGNATURE = {
    "p_pairs": "*i64", "p_step_groups": "*i64", "p_rows": "*i64", "p_units": "*i64",
    "cpu_addr": "i64", "cpu_block_bytes": "i32", "num_groups": "i32",
    "TO_CPU": "constexpr", "WIDTH": "constexpr", "TILE": "constexpr",
}
_DIVISIBLE_16 = ("p_pairs", "p_step_groups", "p_rows", "p_units", "cpu_addr", "cpu_block_bytes")


def _tools() -> tuple[Path, object]:
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump", get_ptxas


def _resources(ptx: str, cubin: bytes, arch: int) -> dict:
    from triton.backends.nvidia.compiler import sm_arch_from_capability

    cuobjdump, get_ptxas = _tools()
    with tempfile.TemporaryDirectory() as d:
        binary, src = Path(d) / "kernel.cubin", Path(d) / "kernel.ptx"
        binary.write_bytes(cubin)
        src.write_text(ptx)
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(binary)], capture_output=True,
                               text=True, check=True, timeout=60).stdout
        # The options Triton's own ptxas call uses, plus -v for the spill report.
        log = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(arch)}", str(src), "-o",
                              str(Path(d) / "again.cubin")], capture_output=True, text=True,
                             check=True, timeout=120).stderr
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    if not m or len(spills) != 2:
        raise RuntimeError(f"unparsed tool output:\n{usage}\n{log}")
    return {"registers": int(m[1]), "stack_bytes": int(m[2]), "spill_bytes": sum(spills)}


def compile_copy_kernel(arch: int, direction: str, width: int, *, num_warps: int = NUM_WARPS,
                        tile_bytes: int = TILE_BYTES) -> dict:
    """Compile ``_copy_blocks_kernel`` for sm_``arch``, ``direction`` (``"store"``/``"load"``)
    and access ``width`` (bytes): its resources, shared memory (bytes), PTX and TTGIR."""
    if INTERPRETED:
        raise RuntimeError("TRITON_INTERPRET=1 replaces the kernel with an interpreter object; "
                           "use report(), which compiles in a fresh interpreter")
    if direction not in ("store", "load") or width not in WIDTHS:
        raise ValueError(f"direction must be 'store' or 'load' and width one of {WIDTHS}, got "
                         f"{direction!r}, {width!r}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(SIGNATURE)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE_16}
    constexprs = {"TO_CPU": direction == "store", "WIDTH": width,
                  "TILE": tile_bytes_for(width, tile_bytes)}
    kernel = triton.compile(ASTSource(_copy_blocks_kernel, SIGNATURE, constexprs, attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return {"arch": arch, "direction": direction, "width": width, "num_warps": num_warps,
            "shared_bytes": kernel.metadata.shared,
            **_resources(kernel.asm["ptx"], kernel.asm["cubin"], arch),
            "ptx": kernel.asm["ptx"], "ttgir": kernel.asm["ttgir"]}


def _report_here(archs, num_warps: int) -> list[dict]:
    return [compile_copy_kernel(a, d, w, num_warps=num_warps) for a in archs
            for d in ("store", "load") for w in WIDTHS]


def report(archs=ARCHS, num_warps: int = NUM_WARPS, *, timeout: float = 600) -> list[dict]:
    """Every (arch, direction, width) case of ``compile_copy_kernel``; in a fresh interpreter
    without ``TRITON_INTERPRET`` when this one interprets kernels."""
    if not INTERPRETED:
        return _report_here(archs, num_warps)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvtriton.kernels.compiled", "--json", "--num-warps",
           str(num_warps), "--arch", *map(str, archs)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=[str(a) for a in ARCHS],
                    help="compute capabilities (90 = sm_90); 'device': the current GPU's, if any")

    ap.add_argument("--num-warps", type=int, default=NUM_WARPS)
    ap.add_argument("--json", action="store_true", help="every case with its PTX and TTGIR")
    args = ap.parse_args(argv)
    archs: list[int] = []
    for a in args.arch:
        if a == "device":
            import torch

            if not torch.cuda.is_available():
                continue
            major, minor = torch.cuda.get_device_capability()
            a = str(major * 10 + minor)
        if not a.isdigit():
            ap.error(f"--arch takes compute capabilities such as 90 or 'device', got {a!r}")
        if int(a) not in archs:
            archs.append(int(a))
    rows = report(tuple(archs), args.num_warps)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'arch':>6} {'direction':>9} {'width':>5} {'warps':>5} {'regs':>4} {'spill B':>7} "
          f"{'stack B':>7} {'shared B':>8}")
    for r in rows:
        print(f"sm_{r['arch']:<3} {r['direction']:>9} {r['width']:>5} {r['num_warps']:>5} "
              f"{r['registers']:>4} {r['spill_bytes']:>7} {r['stack_bytes']:>7} "
              f"{r['shared_bytes']:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
