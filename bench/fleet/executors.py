"""Where the fleet study's cells run: local processes by default, a Ray cluster when given its
address. Either returns the rows in the order of the cells, each ``run_cell``'s own, so the
study's JSON does not depend on the executor (its test checks it)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

from bench.fleet.cells import Cell, run_cell

__all__ = ["run_cells"]


def _say(done: int, total: int, cell: Cell, quiet: bool) -> None:
    if not quiet:
        print(f"fleet: {done}/{total} {cell.key}", file=sys.stderr, flush=True)


def run_cells(cells: Sequence[Cell], *, ray_address: str | None = None, jobs: int | None = None,
              quiet: bool = False, fn: Callable[[Cell], dict[str, Any]] = run_cell
              ) -> list[dict[str, Any]]:
    """``fn`` of every cell, in the cells' order. ``ray_address``: a Ray cluster's address
    (``"local"``: start a Ray instance on this machine for the run); otherwise ``jobs``
    processes here (default: the CPU count)."""
    if ray_address is not None:
        return _on_ray(cells, ray_address, quiet, fn)
    out: list[dict[str, Any] | None] = [None] * len(cells)
    with ProcessPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        futures = {pool.submit(fn, c): i for i, c in enumerate(cells)}
        for done, f in enumerate(as_completed(futures), 1):
            i = futures[f]
            out[i] = f.result()
            _say(done, len(cells), cells[i], quiet)
    return out  # type: ignore[return-value]


def _on_ray(cells: Sequence[Cell], address: str, quiet: bool,
            fn: Callable[[Cell], dict[str, Any]]) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray (pip install 'kvtriton[fleet]'; make test and make "
                         "bench install it)") from None
    started = not ray.is_initialized()
    if started:
        # The workers import bench/ and kvtriton/ from this checkout.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}}
        ray.init(address=None if address == "local" else address, runtime_env=env,
                 include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        remote = ray.remote(fn)
        refs = [remote.remote(c) for c in cells]
        index = {r: i for i, r in enumerate(refs)}
        out: list[dict[str, Any] | None] = [None] * len(cells)
        pending, done = list(refs), 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for r in ready:
                out[index[r]] = ray.get(r)
                done += 1
                _say(done, len(cells), cells[index[r]], quiet)
        return out  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()
