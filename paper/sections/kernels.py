"""The copy kernel: correctness (``kernel_check.json``) and bandwidth (``bench_kernels.json``)."""

from __future__ import annotations

from bench.plots import plot_kernels
from paper.format import machine_line, md_table
from paper.results import FIGURES, load


def hybrid_waste(v: dict) -> None:
    """The share of a CPU block a hybrid preset's smallest group's block uses."""
    chk = load("kernel_check")
    fill = {} if chk is None else chk["findings"]["smallest_group_fill"]
    v["hybrid_waste"] = ("; ".join(f"`{name}`'s smallest group block fills {share:.1%} of its "
                                   "CPU block" for name, share in fill.items()) + "."
                         if fill else "no preset has groups of different block bytes.")


def kernel_section(v: dict) -> None:
    chk = load("kernel_check")
    if chk is None:
        v["kernel_check_table"] = "*Pending: `python -m bench.kernels.check` has not been run.*"
    else:
        rows = [[r["preset"], r["layout"], str(r["pairs"]),
                 "yes" if r["store_bit_exact"] else "**no**",
                 "yes" if r["load_bit_exact"] else "**no**"] for r in chk["rows"]]
        v["kernel_check_table"] = (f"Mode: {chk['mode']}; {machine_line(chk)}.\n\n"
                                   + md_table(["preset", "layout", "pairs", "store bit-exact",
                                             "load bit-exact"], rows))
    bw = load("bench_kernels")
    if bw is None or bw.get("mode") == "cpu-dry-run":
        v["kernel_bw_text"] = ("**Pending.** No GPU was available to any run behind this "
                               "paper, so the kernel's bandwidth, its ratio to the link's "
                               "ceiling and the comparison with per-block and batched copies "
                               "are not reported. `python -m bench.kernels.bandwidth` measures "
                               "them "
                               "on a CUDA machine, and this section fills in from its JSON.")
        v["fig_kernels"] = ""
        return
    plot_kernels(bw, FIGURES / "kernels.png")
    targets = [f"- {t['target']}: {t['value']:.3g}, {'met' if t['met'] else '**missed**'}"
               if t.get("value") is not None else f"- {t['target']}: not measured"
               for t in bw["targets"].values()]
    v["kernel_bw_text"] = f"Machine: {machine_line(bw)}.\n\n" + "\n".join(targets)
    v["fig_kernels"] = "![kernel bandwidth](figures/kernels.png)"
