"""The protected shares, tuned on a train part and judged on a test part.

``hints:F`` and ``waiting:F`` protect blocks in up to a share F of the CPU tier; the study
runs F = 0.5 (``kvtriton.setups.DEFAULT_PROTECT_SHARE``), a value fixed before any result.
This study asks what tuning F would give, without letting the tuned figure be its own
evidence: every setup runs at each share of ``SHARES`` on each workload of ``bench_setups``
(with its split, ``bench.tier_study.study.SPLITS``), F is chosen by the train part's hit rate (among
the shares whose train TTFT p50 and p90 are within the study's tolerance of the control's),
and the choice is reported on the test part beside the fixed 0.5.

Run: ``python -m bench.tier_study.tune_shares [--workloads agent,cc_agentic,mooncake] [--json
PATH]`` (``bench/results/tune_shares.json``). The agent generator and the coding-agent cut take
about two minutes on 2 cores; Mooncake's lookahead adds about eight.
"""

from __future__ import annotations

import time

from bench.common import OneLineParser, write_result
from bench.tier_study.study import SPLITS, run_all, slim, ttft_ok, ttft_tolerance_s, workloads
from kvtriton.setups import CONTROL, DEFAULT_PROTECT_SHARE, canonical_number
from kvtriton.sim.splits import TEST, TRAIN, split_named

SHARES = (0.25, 0.5, 0.75)
#: Per workload, the setups whose share is tuned (the hinted ones only where hints exist).
TUNED = {"agent": ("eager+hints", "lazy+hints", "eager+waiting"),
         "cc_agentic": ("lazy+hints", "eager+waiting"),
         "mooncake": ("eager+waiting",)}


def _with_share(setup: str, share: float) -> str:
    axis = "hints" if "hints" in setup.split("+") else "waiting"
    return setup.replace(axis, f"{axis}:{canonical_number(share)}")


def tune(tag: str, progress: bool = False) -> dict:
    """Every setup of ``TUNED[tag]`` at every share of ``SHARES`` beside the control, at CPU =
    GPU; the share chosen on the train part and both parts' figures."""
    wl, gpu, _ = workloads(quick=True)[tag]
    parts = split_named(SPLITS[tag], wl)
    kw = {"gpu_tokens": gpu, "cpu_tokens": gpu, "parts": parts, "bound": False,
          "references": ()}
    names = [CONTROL] + [_with_share(s, f) for s in TUNED[tag] for f in SHARES]
    results = run_all([(n, wl, {**kw, "setups": [n]}) for n in names], progress, tag)
    rows = {n: slim(results[n]["rows"][0]) for n in names}
    control = rows[CONTROL]
    tolerance = ttft_tolerance_s(results[CONTROL]["conditions"])

    def gain(row: dict, part: str) -> float:
        return 100 * (row["parts"][part]["token_hit_rate"]
                      - control["parts"][part]["token_hit_rate"])

    out = []
    for setup in TUNED[tag]:
        grid = [{"share": f, "setup": _with_share(setup, f),
                 "train_points": gain(rows[_with_share(setup, f)], TRAIN),
                 "test_points": gain(rows[_with_share(setup, f)], TEST),
                 "ttft_ok_train": ttft_ok(rows[_with_share(setup, f)], control, tolerance,
                                           TRAIN)} for f in SHARES]
        fair = [g for g in grid if g["ttft_ok_train"]] or grid
        chosen = max(fair, key=lambda g: (g["train_points"], -abs(g["share"] - 0.5)))
        fixed = next(g for g in grid if g["share"] == DEFAULT_PROTECT_SHARE)
        out.append({"setup": setup, "grid": grid, "chosen_share": chosen["share"],
                    "chosen_test_points": chosen["test_points"],
                    "fixed_share": DEFAULT_PROTECT_SHARE,
                    "fixed_test_points": fixed["test_points"],
                    "tuning_gain_test_points": chosen["test_points"] - fixed["test_points"]})
        print(f"{tag} {setup}: chosen F={chosen['share']:g} on train "
              f"({chosen['train_points']:+.2f} points); on test {chosen['test_points']:+.2f} "
              f"against {fixed['test_points']:+.2f} at F={DEFAULT_PROTECT_SHARE:g}")
    return {"workload": wl.name, "split": SPLITS[tag], "gpu_tokens": gpu, "cpu_ratio": 1,
            "ttft_tolerance_s": tolerance, "setups": out,
            "control": {p: control["parts"][p]["token_hit_rate"] for p in (TRAIN, TEST)}}


def findings(name: str, doc: dict) -> dict:
    """The workloads in the paper's words (as the setup study names them)."""
    from bench.tier_study.setup_findings import LABELS

    return {"labels": {tag: LABELS.get(tag, (tag,))[0] for tag in doc["workloads"]}}


def main(argv: list[str] | None = None) -> dict:
    ap = OneLineParser(prog="python -m bench.tier_study.tune_shares",
                       description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default="agent,cc_agentic,mooncake")
    ap.add_argument("--json", default=None, help="output path (default bench/results/"
                                                 "tune_shares.json)")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    tags = [t.strip() for t in args.workloads.split(",") if t.strip()]
    if bad := [t for t in tags if t not in TUNED]:
        ap.error(f"--workloads: unknown {', '.join(map(repr, bad))}; known: {', '.join(TUNED)}")
    t0 = time.perf_counter()
    payload = {"shares": list(SHARES), "rule": "the share with the best train-part hit rate "
               "among those whose train TTFT p50 and p90 are within the tolerance of the "
               "control's; reported on the test part beside the fixed share",
               "workloads": {t: tune(t, not args.quiet) for t in tags}}
    payload["wall_s"] = time.perf_counter() - t0
    if args.json:
        from pathlib import Path

        path = Path(args.json)
        print(f"wrote {write_result(path.stem, payload, path.parent, findings)}")
    else:
        print(f"wrote {write_result('tune_shares', payload, findings=findings)}")
    return payload


if __name__ == "__main__":
    main()
