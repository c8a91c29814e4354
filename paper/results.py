"""What the paper reads: the results folder, the files it takes (``INPUTS``) and the
workloads' names in the paper's words; ``load`` reads one file, ``None`` when it was not run."""

from __future__ import annotations

import json
from pathlib import Path

from bench.studies import always_written, writers

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "bench" / "results"

PAPER = ROOT / "paper"

FIGURES = PAPER / "figures"

# The setup study's workloads, by the tag of their results files.
WORKLOAD_TAGS = ("agent", "cc_agentic", "mooncake", "glm5")

# The workloads with a re-store map (``bench.tier_study.setups.FULL_MAPS``).
MAP_TAGS = ("agent", "cc_agentic", "mooncake")

# Every results file the paper reads, by name (``bench/results/<name>.json``).
INPUTS = ("hole_demo", "planner", "vs_vllm", "vs_vllm_quick", "vs_vllm_evict_share",
          *(f"setups_{key}" for tag in WORKLOAD_TAGS for key in (tag, f"{tag}_full")),
          *(f"restore_map_{tag}" for tag in MAP_TAGS),
          "replay_mooncake", "replay_agent", "replay_cc_agentic", "kernel_check", "bench_kernels",
          "vllm_engine", "tune_shares", "conversational_gap", "lfu_recency", "default_setup",
          "second_tier", "fleet", "vllm_predict", "sync_loads")


def load(name: str) -> dict | None:
    if name not in INPUTS:
        raise KeyError(f"{name!r} is not in INPUTS, the list of the paper's results files")
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def missing_inputs() -> list[str]:
    """The inputs the quick run always writes that are not in ``bench/results/``."""
    return [n for n in INPUTS
            if always_written(f"{n}.json") and not (RESULTS / f"{n}.json").exists()]


def vs_vllm_doc() -> dict | None:
    """The planner beside vLLM: the full run (every size) when there is one, else the quick
    run's (``make bench``: R = 128 only)."""
    return load("vs_vllm") or load("vs_vllm_quick")


def setup_docs() -> dict[str, dict]:
    """Per tag (``_full`` for a ``--full`` run), the setup study's results."""
    return {key: doc for tag in WORKLOAD_TAGS for key in (tag, f"{tag}_full")
            if (doc := load(f"setups_{key}")) is not None}


def not_run(file: str) -> str:
    """Why input ``file`` is absent, from the studies that write it."""
    options = writers(file)
    if not options:
        return "no study writes it"
    # The quick run's study if one writes it, else a longer run by name, else a full-size run.
    study, quick = max(options, key=lambda o: (o[1] and "quick" in o[0].run_in,
                                               not o[0].run_in, o[1]))
    run = f"`python -m bench{'' if quick else ' --full'} --only {study.name}`"
    if study.needs == "cuda":
        return f"not run: needs a CUDA device ({run} on a GPU box)"
    if study.needs == "vllm":
        return f"not run: needs vLLM ({run})"
    if quick and "quick" in study.run_in:
        return f"missing ({run} writes it)"
    if not study.run_in:
        return f"not run: a longer run ({run})"
    return f"not run: full size only ({run})"
