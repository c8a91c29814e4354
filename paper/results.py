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

WORKLOADS = (("agent", "agent generator"), ("cc_agentic", "coding-agent traces"),
             ("mooncake", "Mooncake trace"), ("glm5", "GLM-5 prefill trace"))

# The workloads with a re-store map (``bench.tier_study.setups.FULL_MAPS``).
MAP_TAGS = ("agent", "cc_agentic", "mooncake")

# Every results file the paper reads, by name (``bench/results/<name>.json``).
INPUTS = ("hole_demo", "planner", "vs_vllm", "vs_vllm_quick", "vs_vllm_evict_share",
          *(f"setups_{key}" for tag, _ in WORKLOADS for key in (tag, f"{tag}_full")),
          *(f"restore_map_{tag}" for tag in MAP_TAGS),
          "replay_mooncake", "replay_agent", "replay_cc_agentic", "kernel_check", "bench_kernels",
          "vllm_engine", "tune_shares", "conversational_gap", "lfu_recency")


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


# ``bench.tier_study.setups --full`` writes ``setups_<tag>_full``: the whole traces, a larger
# generator.
SETUP_LABELS = {**dict(WORKLOADS), "cc_agentic": "coding-agent traces (first turns)",
                 "agent_full": "agent generator (full size)",
                 "cc_agentic_full": "coding-agent traces (whole)",
                 "mooncake_full": "Mooncake trace (every setup)",
                 "glm5_full": "GLM-5 prefill trace (every setup)"}


def setup_docs() -> dict[str, dict]:
    """Per tag (``_full`` for a ``--full`` run), the setup benchmark's results; a file written
    before hints were split into causal and oracle ones is read as what it was
    (``legacy_hints``)."""
    docs = {key: doc for tag, _ in WORKLOADS for key in (tag, f"{tag}_full")
            if (doc := load(f"setups_{key}")) is not None}
    for doc in docs.values():
        legacy_hints(doc)
    return docs


def legacy_hints(doc: dict) -> None:
    """Before ``hint_source``, every hinted setup ran on a workload with each session's last
    turn marked ``close`` (an oracle). Such rows are renamed ``[oracle closes]`` and each
    target's best setup is chosen again without them, by the benchmark's own rule."""
    from bench.tier_study.setups import ORACLE_CLOSES, best_online, reads_hints

    for run, t in zip(doc["runs"], doc["targets"], strict=True):
        rows = run["rows"]
        if any("hint_source" in r for r in rows):
            return
        legacy = [r for r in rows if reads_hints(r["composition"])]
        if not legacy:
            continue
        for r in legacy:
            r["hint_source"] = "oracle closes"
            r["setup"] = r["composition"] + ORACLE_CLOSES
        best = best_online(rows)
        t.update(best=best["setup"] if best else None,
                 gap_closed=best["gap_closed"] if best else None)
        if not t.get("no_gap"):
            t["met"] = bool(best and best["gap_closed"] >= t["target"])
        doc["legacy_hints"] = True


SHORT_LABELS = {"agent": "agent", "cc_agentic": "coding agent", "mooncake": "Mooncake",
                "glm5": "GLM-5"}


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
