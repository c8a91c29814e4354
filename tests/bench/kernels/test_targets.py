"""The kernel bandwidth study's verdict (``bench/kernels/targets.py``): each target judged over
the launches it covers, printed as a table with a summary line, and a missed target in the exit
code of ``bench/kernels/bandwidth.py`` (``EXIT_TARGET_MISSED``), so ``make gpu-check`` can tell it
from a crash. The dry run computes every target on the CPU through the same code and judges none.
"""

from __future__ import annotations

import json

import pytest

from bench.kernels import bandwidth, targets

SMALL, LARGE = 4 * 1024, 24 * 1024  # the small-piece regime's ends (vLLM PR #42212)


def _row(scenario, blocks, method, direction, gbps, host_us=10.0, **extra):
    return {"scenario": scenario, "blocks_per_launch": blocks, "method": method,
            "direction": direction, "gbps_median": gbps, "host_us_median": host_us, **extra}


def _results(h2d_kernel_at_256: float = 40.0) -> list[dict]:
    """Ceiling 50 GB/s both ways at the largest size; the kernel poor at 16 blocks (below
    TARGET_FROM_BLOCKS, so not judged), good from 64 up except where the caller says."""
    rows = []
    for d in ("d2h", "h2d"):
        rows.append(_row("llama3-8b", 256, "ceiling", d, 50.0))
        rows.append(_row("llama3-8b", 16, "kernel", d, 5.0))
        rows.append(_row("llama3-8b", 64, "kernel", d, 47.0))
        rows.append(_row("llama3-8b", 256, "kernel", d, h2d_kernel_at_256 if d == "h2d" else 48))
        rows.extend(_row("llama3-8b", n, "loop", d, 4.0) for n in (16, 64, 256))
    rows += [_row(f"layers-{n}", 256, "kernel", "d2h", 1.0, host_us=us)
             for n, us in ((8, 20.0), (32, 21.0), (64, 22.0))]
    return rows


def _sweep(kernel: dict[int, float], engine: dict[int, float]) -> dict:
    rows = [{"method": m, "direction": d, "piece_bytes": p, "gbps_median": g}
            for m, per in (("kernel", kernel), ("copy_engine", engine)) for p, g in per.items()
            for d in ("d2h", "h2d")]
    return {"blocks": targets.SWEEP_BLOCKS, "layers": 2, "rows": rows}


CONTENTION = {"kernel": {"slowdown": 0.02}}
SWEEP_OK = _sweep({SMALL: 20.0, LARGE: 30.0, 64 * 1024: 30.0},
                  {SMALL: 2.0, LARGE: 10.0, 64 * 1024: 45.0})


def test_every_target_met_from_target_from_blocks_up():
    t = targets.evaluate_targets(_results(), evaluate=True, contention=CONTENTION, sweep=SWEEP_OK)
    assert set(t) == set(targets.TARGETS)
    assert {k: v["status"] for k, v in t.items()} == dict.fromkeys(targets.TARGETS, "met")
    # The 16-block launches (0.1 x the ceiling) are below TARGET_FROM_BLOCKS.
    assert t["d2h_vs_ceiling"]["value"] == pytest.approx(47 / 50)
    assert t["d2h_vs_loop"]["value"] == pytest.approx(47 / 4)
    assert t["host_time_vs_layers"]["value"] == pytest.approx(22 / 20)
    assert targets.exit_code(t) == 0
    n = len(targets.TARGETS)
    assert targets.targets_summary(t) == f"targets: {n} of {n} met"


def test_a_missed_target_is_named_in_the_table_and_the_exit_code():
    t = targets.evaluate_targets(_results(h2d_kernel_at_256=30.0), evaluate=True,
                                 contention=CONTENTION, sweep=SWEEP_OK)
    missed = t["h2d_vs_ceiling"]
    assert (missed["status"], missed["met"], missed["op"], missed["bound"]) == \
        ("missed", False, ">=", 0.7)
    assert missed["value"] == pytest.approx(30 / 50)
    assert targets.exit_code(t) == targets.EXIT_TARGET_MISSED != 0
    table = targets.target_table(t)
    assert table[0].split() == ["target", "measured", "bound", "met"]
    assert table[1:-1] == [line for line in table[1:-1] if line.split()[0] in targets.TARGETS]
    row = next(line for line in table if line.startswith("h2d_vs_ceiling"))
    assert row.split() == ["h2d_vs_ceiling", "0.6", ">=", "0.7", "NO"]
    assert table[-1] == (f"targets: {len(targets.TARGETS) - 1} of {len(targets.TARGETS)} met; "
                         "MISSED: h2d_vs_ceiling")


def test_a_target_not_measured_is_no_miss():
    t = targets.evaluate_targets(_results(), evaluate=True, contention=None, sweep=None)
    assert t["gemm_slowdown"]["status"] == "not measured"
    assert t["small_pieces_vs_copy_engine"]["status"] == "not measured"
    assert targets.exit_code(t) == 0
    assert targets.targets_summary(t).endswith(
        "not measured: gemm_slowdown, small_pieces_vs_copy_engine")


def test_small_pieces_compare_the_kernel_with_the_copy_engine_per_piece_size():
    # The kernel wins at 4 KiB, loses at 24 KiB; at 64 KiB (outside the regime) its loss is the
    # copy engine's crossover, not a miss.
    sweep = _sweep({SMALL: 20.0, LARGE: 8.0, 64 * 1024: 30.0},
                   {SMALL: 2.0, LARGE: 10.0, 64 * 1024: 45.0})
    assert targets.SMALL_PIECES == (SMALL, LARGE)
    t = targets.evaluate_targets(_results(), evaluate=True, contention=CONTENTION, sweep=sweep)
    small = t["small_pieces_vs_copy_engine"]
    assert small["status"] == "missed" and small["value"] == pytest.approx(0.8)
    assert "5-7 GB/s" in small["target"] and "#42212" in small["target"]
    table = targets.piece_table(sweep)
    rows = {tuple(line.split()[:3]): line.split()[3:] for line in table[3:]}
    assert rows[("4", "KiB", "d2h")] == ["20", "2", "10", "small"]
    assert rows[("24", "KiB", "h2d")] == ["8", "10", "0.8", "small"]
    assert rows[("64", "KiB", "d2h")] == ["30", "45", "0.667"]


def test_main_exits_with_the_verdict(monkeypatch, tmp_path, capsys):
    for h2d, rc in ((30.0, targets.EXIT_TARGET_MISSED), (40.0, 0)):
        judged = targets.evaluate_targets(_results(h2d), evaluate=True, contention=CONTENTION,
                                          sweep=SWEEP_OK)
        payload = {"results": [], "targets": judged,
                   "report": [*targets.piece_table(SWEEP_OK), "",
                              *targets.target_table(judged)]}
        monkeypatch.setattr(bandwidth, "run", lambda *args, p=payload, **kw: p)
        assert bandwidth.main(["--dry-run", "--results-dir", str(tmp_path)]) == rc
        out = capsys.readouterr().out
        assert "\n".join(targets.target_table(judged)) in out
        assert out.rstrip().endswith(targets.targets_summary(judged))


def test_the_dry_run_computes_every_target_and_judges_none(tmp_path, capsys):
    assert bandwidth.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "bench_kernels_cpu_dryrun.json").read_text())
    for name, t in doc["targets"].items():
        assert t["value"] is not None, f"{name}: the dry run did not reach its code"
        assert t["met"] is None and t["status"] == "not evaluated", name
    assert (doc["target_from_blocks"] == max(bandwidth.LLAMA_SIZES_DRY)
            < targets.TARGET_FROM_BLOCKS)
    pieces = {r["piece_bytes"] for r in doc["piece_sweep"]["rows"]}
    assert pieces == set(targets.SMALL_PIECES)
    out = capsys.readouterr().out
    for name in targets.TARGETS:
        assert any(line.startswith(name) and line.endswith("n/a (dry run)")
                   for line in out.splitlines()), name
    assert out.rstrip().endswith(
        f"targets: not judged (CPU dry run), {len(targets.TARGETS)} of "
        f"{len(targets.TARGETS)} computed")
    assert doc["report"] == out.split("\n\n", 1)[1].rstrip().split("\n")
