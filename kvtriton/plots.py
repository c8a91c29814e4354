"""The figures the command line draws (matplotlib, the ``plot`` extra): a simulation's setups side
by side and a capacity sweep. Each function takes a result and a path, writes one PNG and
returns the path. The figures of the harness and the paper are ``bench.plots``'s, on the same
``pyplot`` and ``save_figure``."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

__all__ = ["plot_simulation", "plot_sweep", "pyplot", "save_figure"]


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvtriton[plot]'") from None
    return plt


def save_figure(fig, path: str | Path, dpi: int = 130, *, layout: bool = True) -> Path:
    """Write ``fig`` as PNG to ``path`` (parents created) and close it. The image is rendered in
    memory and written with one plain write, so a full disk or a device that refuses the bytes
    (``/dev/full``) raises ``OSError`` instead of passing silently inside the image encoder.
    ``layout``: fit the axes with ``tight_layout`` (False: crop to what is drawn instead, for a
    figure whose colorbar ``tight_layout`` cannot place)."""
    path = Path(path)
    if layout:
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches=None if layout else "tight")
    pyplot().close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(buf.getvalue())
    return path


def plot_simulation(result, path: str | Path) -> Path:
    """Two panels: token hit rate per setup (GPU and CPU parts, Belady bound as a line) and the
    TTFT distribution per setup (empirical CDF, log time)."""
    plt = pyplot()
    rows = result.rows if hasattr(result, "rows") else result["rows"]
    bound = result.bound if hasattr(result, "bound") else result.get("bound")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["setup"] for r in rows]
    gpu = np.array([r["gpu_hit_tokens"] / max(r["prompt_tokens"], 1) for r in rows])
    cpu = np.array([r["cpu_hit_tokens"] / max(r["prompt_tokens"], 1) for r in rows])
    x = np.arange(len(rows))
    ax1.bar(x, 100 * gpu, label="GPU prefix cache", color="#4c72b0")
    ax1.bar(x, 100 * cpu, bottom=100 * gpu, label="CPU tier", color="#dd8452")
    if bound:
        ax1.axhline(100 * bound["hit_rate"], color="k", ls="--", lw=1,
                    label="Belady bound (cache-only)")
    ax1.set_xticks(x, names, rotation=30, ha="right")
    ax1.set_ylabel("prompt tokens hit (%)")
    ax1.set_title("token hit rate")
    ax1.legend(fontsize=8, loc="lower right")
    for r in rows:
        ttft = np.sort(np.asarray(r.get("ttft_all_s", []), dtype=float))
        if len(ttft):
            ax2.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=r["setup"])
    ax2.set_xscale("log")
    ax2.set_xlabel("modeled TTFT (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT distribution")
    ax2.legend(fontsize=8)
    return save_figure(fig, path)


def plot_sweep(sweep, path: str | Path) -> Path:
    """Hit rate versus capacity, one line per setup, and the infinite-cache maximum."""
    plt = pyplot()
    d = sweep.to_dict() if hasattr(sweep, "to_dict") else sweep
    fig, ax = plt.subplots(figsize=(6.5, 4))
    caps = np.asarray(d["capacities_tokens"], dtype=float)
    for setup, rates in d["hit_rate"].items():
        ax.plot(caps, 100 * np.asarray(rates), marker="o", label=setup,
                ls="--" if setup == "belady" else "-")
    ax.axhline(100 * d["max_hit_rate"], color="k", lw=1, ls=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_title(f"{d['name']}: hit rate vs capacity")
    ax.legend(fontsize=8)
    return save_figure(fig, path)
