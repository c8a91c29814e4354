"""The harness's one table of studies: what ``python -m bench`` runs, in order, and what each
writes to ``bench/results/``.

A study is one module's ``main(argv)`` at one of two sizes: *quick* (``make bench`` on a
machine without CUDA; the run's time on 2 cores is in the commit that regenerates the results)
or *full* (a GPU box: the whole traces, the long runs). ``run_in`` names the runs that include
it: ``quick`` and ``full``, only ``full``, or none (a longer run made by name, ``--only``); a
study named by ``--only`` runs at the chosen size whatever its ``run_in``. ``needs`` is what the
machine must have beyond a CPU: ``cuda`` (a CUDA device), ``vllm`` (vLLM importable: ``make
test`` and ``make bench`` install it into ``.venv``) or ``store`` (vLLM and Mooncake Store's
client and master, which both also install); a study whose need is missing is skipped with one
line saying so.
``writes`` are the files (JSON and figures) of the quick size, ``writes_full`` those of the full
size where they differ. ``paper/build.py`` reads this table to tell a results file the quick run
always writes (required) from one it may lack.

This module imports nothing of the studies: listing them loads none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

NEEDS = ("cpu", "cuda", "vllm", "store")
BOTH = ("quick", "full")


@dataclass(frozen=True, slots=True)
class Study:
    name: str
    module: str
    title: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    needs: str
    writes: tuple[str, ...]
    writes_full: tuple[str, ...] | None = None
    run_in: tuple[str, ...] = BOTH
    quiet: bool = False  # takes --quiet

    def args(self, quick: bool, quiet: bool = False, results: str = "bench/results") -> list[str]:
        """The command line of ``module`` at this size; ``{results}`` is the results folder."""
        argv = [a.replace("{results}", results) for a in (self.quick if quick else self.full)]
        return argv + (["--quiet"] if quiet and self.quiet else [])

    def outputs(self, quick: bool) -> tuple[str, ...]:
        return self.writes if quick or self.writes_full is None else self.writes_full

    def command(self, quick: bool) -> str:
        return " ".join(["python", "-m", self.module, *self.args(quick)])


def _with_png(*names: str) -> tuple[str, ...]:
    return tuple(f for n in names for f in (f"{n}.json", f"{n}.png"))


_CROSSCHECK = ("--limit", "mooncake=500", "--limit", "cc_agentic=100", "--json",
               "{results}/crosscheck.json")
_CC_WHOLE = ("--full", "--only", "ablation", "--workloads", "cc_agentic")
_MOONCAKE_ABLATION = ("--only", "ablation", "--workloads", "mooncake")
_MOONCAKE_MAP = ("--only", "map", "--maps", "mooncake")
_HOLE_REWIND = ("--limit", "800", "--json", "{results}/hole_rewind_800.json")
_CONV_GAP = ("--json", "{results}/conversational_gap.json")
_TUNE_SHARES = ("--json", "{results}/tune_shares.json")
_EVICT_SHARE = ("--evict", "0.01", "--sizes", "128", "256", "--variants", "vllm_control",
                "kvt_fused_control", "kvt_fused_restore", "--name", "vs_vllm_evict_share")
_DIFFERENTIAL = ("--seeds", "3000", "--json", "{results}/differential.json")
_MUTATIONS = ("--seeds", "300", "--mutations", "--json", "{results}/differential_mutations.json")
_NATIVE = ("--sequences", "500", "--json", "{results}/native_policies.json")
_CLAIMS = ("--json", "{results}/claims_attack.json")

STUDIES: tuple[Study, ...] = (
    Study("kernel_check", "bench.kernels.check", "kernel correctness", (), (), "cpu",
          ("kernel_check.json",)),
    Study("kernels", "bench.kernels.bandwidth", "kernel bandwidth", ("--quick",), (), "cuda",
          ("bench_kernels_quick.json",), ("bench_kernels.json",)),
    Study("hole_demo", "bench.planner.hole_demo", "the mid-chain hole and re-store", (), (), "cpu",
          ("hole_demo.json",)),
    Study("planner", "bench.planner.scaling", "planner scaling", ("--quick",), (), "cpu",
          ("planner.json",)),
    Study("micro", "bench.planner.micro", "micro-benchmarks (pytest-benchmark)", (), (), "cpu",
          ("micro.json",)),
    Study("sim", "bench.tier_study.capacity",
          "simulation: hit rate, recompute, TTFT vs CPU capacity",
          ("--quick",), ("--mooncake",), "cpu", _with_png("replay_mooncake", "replay_agent"),
          ("sim_mooncake.json", *_with_png("sim_agent", "replay_mooncake", "replay_agent",
                                           "replay_cc_agentic")), quiet=True),
    Study("setups", "bench.tier_study.setups",
          "tier designs: the setup ablation, references and upper bounds, the re-store map", (),
          ("--full",),
          "cpu", ("setups_agent.json", "setups_cc_agentic.json", "setups_glm5.json",
                  *_with_png("restore_map_agent", "restore_map_cc_agentic")),
          ("setups_agent_full.json", "setups_cc_agentic_full.json",
           "setups_mooncake_full.json", "setups_glm5_full.json",
           *_with_png("restore_map_agent", "restore_map_cc_agentic", "restore_map_mooncake")),
          quiet=True),
    Study("default_setup", "bench.tier_study.default_setup",
          "the connector's default, chosen from the setup study's results by its rule", (), (),
          "cpu", ("default_setup.json",)),
    Study("second_tier", "bench.second_tier.study",
          "the second tier on Mooncake Store: transfers beside memcpy, step cost, two replicas",
          (), (), "store", ("second_tier.json",)),
    Study("fleet", "bench.fleet.study",
          "across a fleet: per-replica tiers, a shared store and routers at 1 to 8 replicas",
          (), ("--full",), "cpu", ("fleet.json",), run_in=(), quiet=True),
    Study("soak", "bench.conformance.planner_soak", "soak: 100,000 steps, memory and pool counts",
          (), (), "cpu", ("soak.json",), run_in=("full",)),
    Study("soak_fresh", "bench.conformance.planner_soak",
          "soak with fresh content: distinct blocks unbounded", ("--fresh",), ("--fresh",), "cpu",
          ("soak_fresh.json",), run_in=("full",)),
    Study("vs_vllm", "bench.vllm.vs_vllm", "planner cost beside vLLM's, one process",
          ("--quick",), (), "vllm", ("vs_vllm_quick.json",), ("vs_vllm.json",)),
    # Evictions as a share of the cached blocks (1%), so 4x as many at 8,192 blocks per
    # request as at 2,048: what re-store costs when what it must redo grows with the context.
    Study("vs_vllm_evict_share", "bench.vllm.vs_vllm",
          "planner cost beside vLLM's with evictions growing with the blocks held", _EVICT_SHARE,
          _EVICT_SHARE, "vllm", ("vs_vllm_evict_share.json",), run_in=()),
    Study("connector_soak", "bench.conformance.connector_soak",
          "connector memory over a long run", ("--quick",), (), "vllm", _with_png("vllm_soak"),
          run_in=("full",)),
    Study("vllm", "bench.vllm.engine",
          "the setups in vLLM's real engine, and the simulator's prediction of them",
          (), ("--full",), "vllm", ("vllm_engine.json",), ("vllm_engine_full.json",)),
    Study("vllm_predict", "bench.vllm.engine",
          "the engine prediction out of sample: clocks fitted on no tier, or on the other "
          "workload, at 200 requests per workload, 3 runs each", ("--predict",), ("--predict",),
          "vllm", ("vllm_predict.json",), run_in=()),
    Study("crosscheck", "bench.conformance.crosscheck", "ServingLoop beside vLLM's scheduler",
          _CROSSCHECK, _CROSSCHECK, "vllm", ("crosscheck.json",), run_in=("full",), quiet=True),
    Study("differential", "bench.conformance.differential",
          "kvtriton's scheduler side beside vLLM's manager, step for step, over 3,000 seeds",
          _DIFFERENTIAL, _DIFFERENTIAL, "vllm", ("differential.json",), run_in=()),
    Study("differential_mutations", "bench.conformance.differential",
          "the differential's negative control: every known bug class planted from the start "
          "and at the first recognised difference, over 300 seeds", _MUTATIONS, _MUTATIONS,
          "vllm", ("differential_mutations.json",), run_in=()),
    Study("claims_attack", "bench.vllm.claims_attack",
          "one client claiming every request (fresh session ids, continue hints) in vLLM's "
          "engine: what the other clients lose", _CLAIMS, _CLAIMS, "vllm",
          ("claims_attack.json",), run_in=()),
    Study("native_policies", "bench.conformance.native_policies",
          "reqlru and reqarc against vLLM 0.33's own OffloadingConnector policy classes, eviction "
          "order over 500 random sequences each", _NATIVE, _NATIVE, "vllm",
          ("native_policies.json",), run_in=()),
    Study("hole_rewind", "bench.tier_study.hole_rewind",
          "the allocation hole: hit rates with and without keeping the cursor at it",
          _HOLE_REWIND, _HOLE_REWIND, "cpu", ("hole_rewind_800.json",), run_in=()),
    Study("integrity", "bench.tier_study.integrity", "what integrity mode costs over the plain run",
          (), (), "cpu", ("integrity.json",), run_in=()),
    Study("conversational_gap", "bench.tier_study.conversational_gap",
          "the conversational gap: candidates chosen on Mooncake's train half, judged on its "
          "test half and on the other workloads' test parts", _CONV_GAP, _CONV_GAP, "cpu",
          ("conversational_gap.json",), run_in=()),
    Study("lfu_recency", "bench.tier_study.lfu_recency",
          "where frequency-first eviction loses: the sequential-chat shape on held-out seeds, "
          "and the sketch's two changes on the tier study's workloads by part", (), (), "cpu",
          ("lfu_recency.json",), run_in=(), quiet=True),
    Study("tune_shares", "bench.tier_study.tune_shares",
          "the protected shares of hints and lookahead, tuned on train, judged on test",
          _TUNE_SHARES, _TUNE_SHARES, "cpu", ("tune_shares.json",), run_in=(), quiet=True),
    Study("sync_loads", "bench.tier_study.sync_loads",
          "same-step loads: a per-step byte budget for CPU hits, chosen on train by TTFT p50, "
          "judged on test", (), ("--full",), "cpu", ("sync_loads.json",), run_in=(),
          quiet=True),
    # The longer runs behind the paper's optional sections (11, 1 and 1.5 minutes on 2 cores).
    Study("cc_agentic_whole", "bench.tier_study.setups",
          "the whole coding-agent traces, every setup", _CC_WHOLE, _CC_WHOLE, "cpu",
          ("setups_cc_agentic_full.json",), run_in=(), quiet=True),
    Study("mooncake_ablation", "bench.tier_study.setups",
          "the Mooncake trace's ablation at the quick size (every setup of its quick set)",
          _MOONCAKE_ABLATION, _MOONCAKE_ABLATION, "cpu", ("setups_mooncake.json",), run_in=(),
          quiet=True),
    Study("mooncake_map", "bench.tier_study.setups", "the Mooncake re-store map", _MOONCAKE_MAP,
          _MOONCAKE_MAP, "cpu", _with_png("restore_map_mooncake"), run_in=(), quiet=True),
)

BY_NAME = {s.name: s for s in STUDIES}


def writers(name: str) -> list[tuple[Study, bool]]:
    """The studies and sizes (``True``: quick) that write results file ``name``."""
    return [(s, q) for s in STUDIES for q in (True, False) if name in s.outputs(q)]


def always_written(name: str) -> bool:
    """Whether the quick run writes ``name`` on any machine (a CPU study of the quick run)."""
    return any(q and "quick" in s.run_in and s.needs == "cpu" for s, q in writers(name))


def table() -> str:
    """The registry as text (``python -m bench --list``): a line per study, then its command and
    the files it writes at each size."""
    width = max(len(s.name) for s in STUDIES)
    mod = max(len(s.module) for s in STUDIES)
    lines = [f"{'study':{width}s}  {'module':{mod}s}  needs  runs in"]
    for s in STUDIES:
        runs = (" and ".join(s.run_in) + (" runs" if len(s.run_in) > 1 else " run")
                if s.run_in else "by name (--only)")
        lines.append(f"{s.name:{width}s}  {s.module:{mod}s}  {s.needs:5s}  {runs}")
        sizes = (("quick", True), ("full", False)) if s.quick != s.full or s.writes_full \
            else (("both", True),)
        for label, quick in sizes:
            lines.append(f"    {label + ':':6s} {s.command(quick)}  ->  "
                         + ", ".join(s.outputs(quick)))
    return "\n".join(lines)
