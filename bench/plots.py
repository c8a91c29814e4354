"""Every figure the harness and the paper draw from bench results (matplotlib, the ``plot``
extra). Each function takes a result (its JSON dict) and a path, writes one PNG and returns the
path. The command line's own figures stay in ``kvtriton.plots``, whose ``pyplot`` and
``save_figure`` these use."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvtriton.plots import pyplot, save_figure
from kvtriton.setups import CONTROL, NEXT_USE_REFERENCES, UPPER_BOUND_SETUPS

__all__ = ["PLANNER_VARIANTS", "plot_connector_soak", "plot_decision_map",
           "plot_fleet", "plot_gain_over_control", "plot_hole", "plot_kernels", "plot_planner",
           "plot_restore_map", "plot_second_tier", "plot_vs_vllm"]

# Planner benchmark variants in the order the paper's table and figure show them.
PLANNER_VARIANTS = {"loop_control": "loop, control", "loop_restore": "loop, re-store",
                    "fused_control": "fused, control", "fused_restore": "fused, re-store"}


def plot_hole(doc: dict, path: str | Path) -> Path:
    """CPU presence of one request's blocks (stored, after an eviction, one step later), for
    the cursor-only control and for re-store (``bench/results/hole_demo.json``)."""
    plt = pyplot()
    by = {r["restore"]: r for r in doc["rows"]}
    n = doc["blocks"]
    fig, axes = plt.subplots(2, 1, figsize=(7, 2.6))
    for ax, restore in zip(axes, (False, True), strict=True):
        phases = by[restore]["phases"]
        rows = [("stored", phases["stored"]["present"]),
                ("evicted", phases["evicted"]["present"]),
                ("next step", phases["next_step"]["present"])]
        for y, (_, present) in enumerate(rows):
            for x, p in enumerate(present):
                ax.add_patch(plt.Rectangle((x, -y), 0.9, 0.8,
                                           color="#55a868" if p else "#dddddd"))
        ax.set_xlim(-0.1, n)
        ax.set_ylim(-len(rows) + 0.8, 0.9)
        ax.set_yticks([-y + 0.4 for y in range(len(rows))], [r[0] for r in rows], fontsize=8)
        ax.set_xticks([x + 0.45 for x in range(n)], [str(x + 1) for x in range(n)], fontsize=7)
        hit = by[restore]["probe_hit_blocks"]
        ax.set_title(f"{'re-store' if restore else 'control (cursor)'}: next lookup hits "
                     f"{hit} of {n} blocks", fontsize=9)
        for spine in ax.spines.values():
            spine.set_visible(False)
    return save_figure(fig, path, dpi=140)


def plot_planner(doc: dict, path: str | Path, vs_vllm: dict | None = None) -> Path:
    """Selection time per step versus running requests, one line per planner variant
    (``bench/results/planner.json``); with ``vs_vllm`` (``bench/results/vs_vllm.json``), vLLM's
    control and re-scan whole steps measured beside kvtriton, at the same blocks per request."""
    plt = pyplot()
    c = doc["conditions"]
    rows = [r for r in doc["rows"] if r["evict_fraction"] == c["evict_fraction"]]
    sizes = sorted({r["requests"] for r in rows})
    by = {(r["variant"], r["requests"]): r for r in rows}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for k, label in PLANNER_VARIANTS.items():
        pts = [(n, by[(k, n)]["select_median_ms"]) for n in sizes if (k, n) in by]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=label)
    for variant, ls, label in (("vllm_control", ":", "vLLM control (whole step)"),
                               ("vllm_rescan_restore", "--", "vLLM re-scan re-store (whole step)")):
        pts = sorted((r["requests"], r["median_ms"]) for r in (vs_vllm or {}).get("rows", ())
                     if r["variant"] == variant
                     and r["blocks_per_request"] == c["blocks_per_request"])
        if pts:
            ax.plot(*zip(*pts, strict=True), ls=ls, color="gray", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"running requests ({c['blocks_per_request']:,} blocks each)")
    ax.set_ylabel("ms per step (selection)")
    ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=140)


def plot_vs_vllm(doc: dict, path: str | Path) -> Path:
    """Whole-step time versus running requests, one line per variant and one panel per block
    count (``bench/results/vs_vllm.json``, every variant measured in one process)."""
    plt = pyplot()
    counts = sorted({r["blocks_per_request"] for r in doc["rows"]})
    variants = list(dict.fromkeys(r["variant"] for r in doc["rows"]))
    fig, axes = plt.subplots(1, len(counts), figsize=(5.2 * len(counts), 3.8), sharey=True,
                             squeeze=False)
    for ax, blocks in zip(axes[0], counts, strict=True):
        for v in variants:
            pts = sorted((r["requests"], r["median_ms"]) for r in doc["rows"]
                         if r["variant"] == v and r["blocks_per_request"] == blocks)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", ms=3,
                        ls="--" if v.startswith("vllm") else "-", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r["requests"] for r in doc["rows"] if r["blocks_per_request"] == blocks})
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.set_xlabel(f"running requests ({blocks:,} blocks each)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("ms per step (whole build)")
    # Upper left: above every line but the re-scan's, which starts lower at small sizes.
    axes[0][0].legend(fontsize=7, loc="upper left")
    return save_figure(fig, path, dpi=140)


def plot_kernels(doc: dict, path: str | Path) -> Path:
    """GB/s per copy method versus blocks per launch, D2H and H2D
    (``bench/results/bench_kernels.json``, a GPU run)."""
    plt = pyplot()
    res = doc["results"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, direction in zip(axes, ("d2h", "h2d"), strict=True):
        for method in ("kernel", "batched", "loop", "ceiling"):
            pts = sorted((r["blocks_per_launch"], r["gbps_median"]) for r in res
                         if r["scenario"] == "llama3-8b" and r["method"] == method
                         and r["direction"] == direction)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("blocks per launch (Llama-3-8B, 2 MiB each)")
        ax.set_title(direction.upper())
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=7)
    return save_figure(fig, path, dpi=140)


def plot_second_tier(doc: dict, path: str | Path) -> Path:
    """Mooncake Store's GB/s by object size beside memcpy, and replica B's hit rate and batch
    seconds by way of serving (``bench/results/second_tier.json``)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    raw = doc["raw"]
    x = [r["object_bytes"] / 1024 for r in raw]
    for key, label in (("put_batched_gb_s", "put, batched"), ("get_batched_gb_s", "get, batched"),
                       ("put_single_gb_s", "put, one per call"),
                       ("get_single_gb_s", "get, one per call"), ("memcpy_gb_s", "memcpy")):
        axes[0].plot(x, [r[key] for r in raw], marker="o", label=label,
                     ls=":" if key == "memcpy_gb_s" else "-")
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("object size (KiB)")
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=7)
    rep = doc["replicas"]
    ways = [w for w in ("one_replica", "shared_store", "one_replica_cpu", "no_store") if w in rep]
    labels = [w.replace("_", " ") for w in ways]
    axes[1].bar(labels, [100 * rep[w]["b"]["hit_rate"] for w in ways], color="tab:blue")
    axes[1].set_ylabel("replica B's hit rate (%)")
    axes[2].bar(labels, [rep[w]["b"]["seconds"] for w in ways], color="tab:orange")
    axes[2].set_ylabel("B's batches to first token (s)")
    for ax in axes[1:]:
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    return save_figure(fig, path, dpi=140)


def plot_fleet(doc: dict, path: str | Path) -> Path:
    """Per workload, test-part hit rate and TTFT p90 against the number of replicas, one line
    per combination and reference (``bench/results/fleet.json``)."""
    plt = pyplot()
    scaling = doc["findings"]["scaling"]
    workloads = list(scaling)
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.2 * len(workloads) + 2.4, 6.6),
                             squeeze=False)
    for col, w in enumerate(workloads):
        for label, s in sorted(scaling[w].items()):
            ref = label in ("pooled", "unbounded", "nextuse")
            style = dict(marker="o", ms=3, lw=1.6 if ref else 1.0, ls="--" if ref else "-")
            axes[0][col].plot(s["replicas"], [100 * h for h in s["hit_rate"]], label=label,
                              **style)
            axes[1][col].plot(s["replicas"], s["ttft_p90_s"], label=label, **style)
        axes[0][col].set_title(w)
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel("replicas (per-replica load fixed)")
        for row in (0, 1):
            axes[row][col].set_xscale("log", base=2)
    axes[0][0].set_ylabel("test hit rate (%)")
    axes[1][0].set_ylabel("test TTFT p90 (s)")
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                       frameon=False)
    return save_figure(fig, path, dpi=140)


def plot_connector_soak(doc: dict, path: str | Path) -> Path:
    """Key ids bound, planner key slots and RSS versus distinct blocks seen, recycling on and
    off (``bench/results/vllm_soak.json``)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    pools = doc["conditions"]["gpu_blocks"] + doc["conditions"]["cpu_blocks"]
    for run in doc["runs"]:
        label = "recycling" if run["recycle"] else "no recycling (control)"
        s = run["samples"]
        x = [p["distinct_blocks"] for p in s]
        axes[0].plot(x, [p["key_id_capacity"] for p in s], marker=".", label=f"{label}: key ids")
        axes[0].plot(x, [p["planner_key_slots"] for p in s], ls="--",
                     label=f"{label}: planner slots")
        axes[1].plot(x, [p["rss_mib"] - s[0]["rss_mib"] for p in s], marker=".", label=label)
    axes[0].axhline(pools, color="gray", ls=":", label="GPU + CPU pool blocks")
    axes[0].set_ylabel("entries")
    axes[1].set_ylabel("RSS growth since the first sample (MiB)")
    for ax in axes:
        ax.set_xlabel("distinct blocks seen")
        ax.legend(fontsize=7)
    return save_figure(fig, path, dpi=140)


def plot_restore_map(doc: dict, path: str | Path) -> Path:
    """Heat maps of re-store's gain over eager stores, in token hit-rate points, one panel per
    re-store form: CPU/GPU capacity ratio across, running requests (``max_running``) down.
    ``doc``: ``bench.tier_study.setups.restore_map``'s result (``ratios``, ``max_running``,
    ``gain[form][i_running][i_ratio]``)."""
    plt = pyplot()
    forms = list(doc["gain"])
    ratios, running = doc["ratios"], doc["max_running"]
    grids = {f: np.array(doc["gain"][f], dtype=float) * 100 for f in forms}
    lim = max(1e-9, max(float(np.nanmax(np.abs(g))) for g in grids.values()))
    fig, axes = plt.subplots(1, len(forms), figsize=(4.6 * len(forms), 3.6), squeeze=False)
    for ax, f in zip(axes[0], forms, strict=True):
        g = grids[f]
        im = ax.imshow(g, cmap="RdBu", vmin=-lim, vmax=lim, origin="lower", aspect="auto")
        for i in range(g.shape[0]):
            for j in range(g.shape[1]):
                ax.text(j, i, f"{g[i, j]:+.1f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(ratios)), [f"{r:g}x" for r in ratios])
        ax.set_yticks(range(len(running)), [str(r) for r in running])
        ax.set_xlabel("CPU tier / GPU capacity")
        ax.set_ylabel("max running requests")
        ax.set_title(f"{f} minus eager (points)")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.suptitle(doc.get("workload", ""), fontsize=9)
    return save_figure(fig, path, layout=False)


def plot_gain_over_control(runs: list[dict], path: str | Path, title: str = "") -> Path:
    """Points of token hit rate each setup gains over the control (``eager``), one group of bars
    per capacity, with the gain of the oracle reference (the better next-use row) drawn as a
    dashed line over each group and the upper bound's (the unbounded tier) as a dotted one where
    it fits the axis: a loss of a point reads as a point whatever the size of the headroom.
    ``runs``: ``[{"label": ..., "rows": [...]}]``, rows with ``composition``, ``setup``,
    ``oracle`` and ``token_hit_rate``; oracle rows are drawn only as those lines."""
    plt = pyplot()
    names = [r["setup"] for r in runs[0]["rows"]
             if not r.get("oracle") and r["composition"] != CONTROL]
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(names) + 2), 3.8))
    x = np.arange(len(names))
    uppers = []
    for k, run in enumerate(runs):
        rows = run["rows"]
        base = next((r["token_hit_rate"] for r in rows if r["composition"] == CONTROL), None)
        if base is None:
            raise ValueError(f"plot_gain_over_control: run {run['label']!r} has no 'eager' "
                             "row (the control every gain is measured from)")
        by = {r["setup"]: r["token_hit_rate"] for r in rows}
        vals = [100 * (by[n] - base) if n in by else np.nan for n in names]
        offset = (k - (len(runs) - 1) / 2) * width
        bars = ax.bar(x + offset, vals, width, label=run["label"])
        oracle = max((r["token_hit_rate"] for r in rows
                      if r["composition"] in NEXT_USE_REFERENCES), default=None)
        if oracle is not None:
            ax.hlines(100 * (oracle - base), x[0] + offset - width / 2,
                      x[-1] + offset + width / 2, colors=bars.patches[0].get_facecolor(),
                      linestyles="--", lw=1)
        upper = min((r["token_hit_rate"] for r in rows
                     if r["composition"] in UPPER_BOUND_SETUPS), default=None)
        if upper is not None:
            uppers.append((100 * (upper - base), offset, bars.patches[0].get_facecolor()))
    top = ax.get_ylim()[1]
    for gain, offset, color in uppers:
        if gain <= 2 * top:
            ax.hlines(gain, x[0] + offset - width / 2, x[-1] + offset + width / 2,
                      colors=color, linestyles=":", lw=1)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("hit rate over the control (points)")
    ax.set_title(title + " (dashed: next-use oracle reference; dotted: upper bound)",
                 fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def plot_decision_map(cells: list[dict], path: str | Path) -> Path:
    """The decision map: one point per study cell (workload x CPU capacity) at its share of
    reuses within the GPU + CPU capacity (x, %) and the control's queueing delay p50 (y,
    seconds, log scale), labelled with the setup chosen on the train part and its test-part
    gain in points; a hollow marker where the workload has no continue hints. ``cells``: dicts
    with ``label``, ``within_tier``, ``queue_p50_s``, ``winner`` (None: no setup gains),
    ``test_points`` and ``hinted``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    winners = sorted({c["winner"] or "control (nothing gains)" for c in cells})
    colors = {w: f"C{i}" for i, w in enumerate(winners)}
    for c in cells:
        w = c["winner"] or "control (nothing gains)"
        y = max(c["queue_p50_s"], 1e-3)
        ax.scatter(100 * c["within_tier"], y, s=60, color=colors[w],
                   facecolors=colors[w] if c["hinted"] else "none", label=w)
        gain = "" if c["test_points"] is None else f" {c['test_points']:+.1f}"
        ax.annotate(f"{c['label']}{gain}", (100 * c["within_tier"], y), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="best")
    ax.set_yscale("log")
    ax.set_xlabel("reuses within GPU + CPU capacity (% of prompt-block reuses)")
    ax.set_ylabel("control's queueing delay p50, test part (s)")
    ax.set_title("setup chosen on train; test-part gain in points (hollow: no hints)",
                 fontsize=9)
    return save_figure(fig, path)
