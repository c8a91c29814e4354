"""How the kernel studies time a copy: ``Case`` (one timed shape), ``Timer`` (CUDA events around
back-to-back launches, or the wall clock on the CPU), the summary of a shape's repetitions as
one result row, and whether the kernel runs in Triton's interpreter (which picks the backend).

Shared by the bandwidth study (``bench.kernels.bandwidth``) and its contention run
(``bench.kernels.contention``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Back-to-back launches per timed repetition: enough for ~20 ms of device time, at most this many.
MAX_BURST = 16
BURST_SECONDS = 0.02


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


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


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
        "gbps_median": pct(gbps, 50),
        "gbps_p10": pct(gbps, 10),
        "gbps_p90": pct(gbps, 90),
        "time_us_median": pct(device_s, 50) * 1e6,
        "time_us_p10": pct(device_s, 10) * 1e6,
        "time_us_p90": pct(device_s, 90) * 1e6,
        "host_us_median": pct(host_s, 50) * 1e6,
    }
    for name, values in parts.items():
        out[f"host_{name}_us_median"] = pct(values, 50) * 1e6
    return out


def time_cases(timer: Timer, cases: list[Case], warmups: int) -> list[dict]:
    for case in cases:  # warm every shape (and compile) before timing any
        for _ in range(warmups):
            case.fn()
    timer._sync()
    return [_summarize(case, *timer.measure(case)) for case in cases]


def interpreted() -> bool:
    from kvtriton.kernels.copy_blocks import INTERPRETED

    return INTERPRETED
