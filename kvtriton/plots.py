"""Figures for the command line and the paper (matplotlib, the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["plot_simulation", "plot_sweep"]


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'kvtriton[plot]'") from None
    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    return path


def plot_simulation(result, path: str | Path) -> Path:
    """Two panels: token hit rate per policy (GPU and CPU parts, Belady bound as a line) and the
    TTFT distribution per policy (empirical CDF, log time)."""
    plt = _pyplot()
    rows = result.rows if hasattr(result, "rows") else result["rows"]
    bound = result.bound if hasattr(result, "bound") else result.get("bound")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["policy"] for r in rows]
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
            ax2.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=r["policy"])
    ax2.set_xscale("log")
    ax2.set_xlabel("modeled TTFT (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_title("TTFT distribution")
    ax2.legend(fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_sweep(sweep, path: str | Path) -> Path:
    """Hit rate versus capacity, one line per policy, and the infinite-cache maximum."""
    plt = _pyplot()
    d = sweep.to_dict() if hasattr(sweep, "to_dict") else sweep
    fig, ax = plt.subplots(figsize=(6.5, 4))
    caps = np.asarray(d["capacities_tokens"], dtype=float)
    for policy, rates in d["hit_rate"].items():
        ax.plot(caps, 100 * np.asarray(rates), marker="o", label=policy,
                ls="--" if policy == "belady" else "-")
    ax.axhline(100 * d["max_hit_rate"], color="k", lw=1, ls=":", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prompt tokens hit (%)")
    ax.set_title(f"{d['name']}: hit rate vs capacity")
    ax.legend(fontsize=8)
    out = _save(fig, path)
    plt.close(fig)
    return out
