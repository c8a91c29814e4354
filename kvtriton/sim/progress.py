"""A dependency-free progress bar on stderr for long simulations."""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``progress(done, total)`` redraws ``label [#####.....] done/total elapsed``.

    On a terminal the line is redrawn in place at most every 0.2 s; otherwise (logs, CI) a line
    is printed at most every 10 s, so long runs still show they are alive.
    """

    def __init__(self, label: str, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        final = done >= total
        if not final and now - self._last < (0.2 if self.tty else 10.0):
            return
        self._last = now
        frac = done / total if total else 1.0
        bar = "#" * int(frac * 24)
        line = f"{self.label} [{bar:<24}] {done}/{total} {now - self.t0:6.1f}s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
