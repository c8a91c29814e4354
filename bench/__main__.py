"""The benchmark harness: ``python -m bench`` (``make bench``).

Runs the studies of ``bench/studies.py`` in their order, each through its module's
``main(argv)``: kernel correctness (Triton interpreter without CUDA), kernel bandwidth (CUDA
only), the mid-chain hole, planner scaling and micro-benchmarks, the cache-only replays of the
shipped traces, the tier-design study (setup ablation, references, re-store map), and outside
the quick run the soaks, the vLLM comparisons (which need vLLM) and the scheduler cross-check.
``--list`` prints the table; ``--only STUDY[,STUDY]`` runs those studies only. Every part writes
JSON with the machine's description, and its figures, to ``bench/results/``, and records each
file in ``bench/results/MANIFEST.json``. ``--quick`` (the default without CUDA) is the size for 2
cores (each study's time is printed, and the run's in the commit that regenerates the results);
``--full`` is the size for a GPU box: the whole traces through every setup,
the preset sweeps, the whole-trace Mooncake simulation and the 100,000-step soak. The longer
runs behind the paper run by name only. A study this run leaves out is one line, ``skipped:
STUDY: why``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import time
from pathlib import Path

import torch

from bench import common
from bench.common import OneLineParser, writing_as
from bench.studies import BY_NAME, STUDIES, Study, table


def _skip_reason(study: Study, quick: bool, named: bool, cuda: bool, vllm: bool,
                 store: bool = False) -> str | None:
    if study.needs == "cuda" and not cuda:
        return "needs CUDA (no CUDA device on this machine)"
    if study.needs in ("vllm", "store") and not vllm:
        return "needs vLLM (not installed here; `make test` installs it into .venv)"
    if study.needs == "store" and not store:
        return ("needs Mooncake Store (not installed here; `make bench` installs it into .venv "
                "with tools/install_store.sh)")
    if named or ("quick" if quick else "full") in study.run_in:
        return None
    if "full" in study.run_in:
        return f"not in the quick run (`python -m bench --full`, or `--only {study.name}`)"
    return f"a longer run, made by name (`python -m bench --only {study.name}`)"


def _shown(path: Path) -> Path:
    """``path`` relative to the working directory where it lies under it: the command recorded
    in the manifest is then one a user can run again from their own clone."""
    try:
        return path.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench", description=__doc__.splitlines()[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="CPU-sized (default without CUDA)")
    size.add_argument("--full", action="store_true", help="GPU-box size (default with CUDA)")
    ap.add_argument("--only", default=None, metavar="STUDY[,STUDY]",
                    help="run these studies only (--list names them)")
    ap.add_argument("--list", action="store_true", help="print the studies and exit")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--findings", action="store_true",
                    help="run no study: derive every results file's findings again from its rows")
    args = ap.parse_args(argv)
    if args.list:
        print(table())
        return 0
    if args.findings:
        done = common.derive_findings()
        print(f"findings derived again for {len(done)} files: {', '.join(done)}")
        return 0
    chosen = None
    if args.only is not None:
        chosen = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(chosen - set(BY_NAME))
        if unknown or not chosen:
            ap.error(f"--only: unknown study {', '.join(map(repr, unknown)) or repr(args.only)}"
                     f"; known: {', '.join(BY_NAME)}")
    cuda = torch.cuda.is_available()
    vllm = importlib.util.find_spec("vllm") is not None
    store = importlib.util.find_spec("mooncake") is not None
    quick = args.quick or (not args.full and not cuda)
    via = " ".join(["python -m bench", *(sys.argv[1:] if argv is None else argv)])
    results = _shown(common.RESULTS_DIR)
    t0 = time.perf_counter()
    print(f"kvtriton benchmark harness ({'quick' if quick else 'full'} size, "
          f"{'CUDA: ' + torch.cuda.get_device_name(0) if cuda else 'no CUDA device'})")
    failed, took = [], []
    for study in STUDIES:
        if chosen is not None and study.name not in chosen:
            continue
        why = _skip_reason(study, quick, chosen is not None, cuda, vllm, store)
        if why is not None:
            print(f"skipped: {study.name}: {why}")
            continue
        print(f"\n== {study.name}: {study.title} ==", flush=True)
        study_argv = study.args(quick, args.quiet, str(results))
        module = importlib.import_module(study.module)
        started = time.perf_counter()
        with writing_as(study.module, study_argv, via):
            rc = module.main(study_argv)
        took.append((study.name, time.perf_counter() - started))
        print(f"{study.name}: {took[-1][1]:.0f} s", flush=True)
        if isinstance(rc, int) and rc != 0:
            failed.append(f"{study.name} (exit code {rc})")
    print(f"\nresults (JSON, figures, MANIFEST.json) in {results}/")
    if failed:
        print(f"failed: {', '.join(failed)}")
    # Where the run's time went, longest first: what to shorten when the quick run grows.
    print("time per study: " + ", ".join(f"{name} {s:.0f} s" for name, s in
                                          sorted(took, key=lambda t: -t[1])))
    print(f"harness finished in {time.perf_counter() - t0:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
