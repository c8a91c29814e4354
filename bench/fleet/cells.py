"""The fleet study's cells: one fleet simulation each, described by plain data so that any
executor (local processes, Ray) runs the same function on it and gets the same row.

A cell names a workload at its serving setting, a fleet size N, a per-replica tier setup, a
router and whether the replicas share a store. The per-replica load is held fixed: the N-replica
fleet serves the workload's trace N times faster (arrivals and think times divided by N), so
each replica meets about the arrival rate one replica meets at N = 1; every replica has the
workload's per-replica GPU and CPU capacity. Two references run beside the combinations:

- ``pooled``: one replica with N times the memory (GPU and CPU blocks), N times the batch and N
  times the compute and host links (``PooledCost``): the fleet's memory as one cache;
- ``unbounded``: every replica's CPU tier is one fleet-wide tier without a capacity limit or a
  transfer cost (a shared store of every block, free to reach), round-robin;
- ``nextuse``: per-replica CPU tiers evicting by the trace's next use, an oracle reference.

None of them is claimed as a bound here: ``pooled`` schedules differently (one batch of N
times the size), and the others' hit rates can be passed by routing that raises GPU hits.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from kvtriton.sim.cost import CostModel
from kvtriton.sim.fleet_run import simulate_fleet
from kvtriton.sim.second_tier import LOOPBACK_TCP, StoreCost
from kvtriton.sim.splits import split_named
from kvtriton.sim.workloads import WORKLOADS, load_workload

__all__ = ["Cell", "PooledCost", "run_cell"]

#: Each workload's train/test split (``kvtriton.sim.splits``).
SPLITS = {"cc_agentic": "sessions", "agent": "sessions", "mooncake": "time"}
#: Base per-replica batch of a replica (as ``simulate``'s defaults).
TOKEN_BUDGET, MAX_RUNNING = 8192, 256
#: The store of a shared cell holds this many times the fleet's CPU blocks: memory on top of
#: the replicas' own tiers (each row says its memory; ``pooled`` has none of it).
STORE_PER_FLEET_CPU = 1
#: A store nobody pays to reach (the ``unbounded`` reference).
FREE_STORE = StoreCost(float("inf"), 0.0, "reference: no transfer cost")
#: Figures of a row the study keeps (modeled; the run's wall time is kept apart).
KEPT = ("requests", "finished", "rejected", "prompt_tokens", "gpu_hit_tokens", "cpu_hit_tokens",
        "token_hit_rate", "ttft_p50_s", "ttft_p90_s", "queue_delay_mean_s",
        "queue_delay_p90_s", "bytes_d2h", "bytes_h2d", "makespan_s", "routed",
        "replica_queue_delay_mean_s", "busiest_queue_delay_ratio", "replica_bytes_host",
        "store", "parts", "prefix_left_elsewhere")
# (``unbounded``'s store holds every key: its memory is the workload's, not a capacity.)


@dataclass(frozen=True)
class Cell:
    """One simulation. ``kind``: ``"fleet"``, ``"pooled"``, ``"unbounded"`` or ``"nextuse"``;
    ``limit``: the workload's first requests (closed loop kept), None for all."""

    workload: str
    replicas: int
    setup: str
    router: str
    kind: str = "fleet"
    limit: int | None = None

    @property
    def key(self) -> str:
        return f"{self.workload}/N={self.replicas}/{self.kind}/{self.setup}/{self.router}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PooledCost:
    """``base`` on ``n`` GPUs as one: every step's compute and every host transfer ``n`` times
    faster; the step's fixed overhead (the scheduler's) as it is."""

    base: CostModel
    n: int

    @property
    def step_overhead_s(self) -> float:
        return self.base.step_overhead_s

    def prefill_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        return self.base.prefill_s(num_tokens, context_tokens) / self.n

    def decode_step_s(self, context_tokens) -> float:
        return self.base.decode_step_s(context_tokens) / self.n

    def h2d_s(self, nbytes: int, num_pieces: int = 0) -> float:
        return self.base.h2d_s(nbytes, num_pieces) / self.n

    def d2h_s(self, nbytes: int, num_pieces: int = 0) -> float:
        return self.base.d2h_s(nbytes, num_pieces) / self.n

    def conditions(self) -> dict:
        return {**self.base.conditions(), "pooled_gpus": self.n}


def run_cell(cell: Cell) -> dict[str, Any]:
    """The row of ``cell``: ``KEPT`` figures of the whole fleet and, under ``parts``, of its
    train and test requests; ``wall_s`` apart (measured)."""
    spec = WORKLOADS[cell.workload]
    s = spec.serving
    wl = load_workload(cell.workload, block_size=s["block_size"], limit=cell.limit,
                       time_scale=s["time_scale"] / cell.replicas)
    parts = split_named(SPLITS[cell.workload], wl)
    caps = spec.capacities()
    checked = _sizes(wl, caps)
    n_gpu, n_cpu = checked["gpu_blocks"], checked["cpu_blocks"]
    kw: dict[str, Any] = dict(gpu_blocks=n_gpu, cpu_blocks=n_cpu, parts=parts,
                              token_budget=TOKEN_BUDGET, max_running=MAX_RUNNING)
    replicas, setup, router = cell.replicas, cell.setup, cell.router
    if cell.kind == "pooled":
        kw.update(gpu_blocks=n_gpu * replicas, cpu_blocks=n_cpu * replicas,
                  token_budget=TOKEN_BUDGET * replicas, max_running=MAX_RUNNING * replicas,
                  cost=PooledCost(CostModel.named(), replicas))
        replicas = 1
    elif cell.kind == "unbounded":
        setup = f"{setup}+shared"
        kw.update(store_blocks=checked["distinct_keys"] + 1, store_cost=FREE_STORE)
    elif "shared" in setup:
        kw.update(store_blocks=STORE_PER_FLEET_CPU * n_cpu * replicas, store_cost=LOOPBACK_TCP)
    row = simulate_fleet(wl, replicas=replicas, router=router, setup=setup, **kw)
    out = {k: row[k] for k in KEPT if k in row}
    out["memory_blocks"] = {"gpu": kw["gpu_blocks"] * replicas,
                            "cpu": kw["cpu_blocks"] * replicas,
                            "store": kw.get("store_blocks", 0)}
    out["cell"] = cell.as_dict()
    out["wall_s"] = row["wall_s"]
    return out


def _sizes(wl, caps: dict[str, Any]) -> dict[str, int]:
    """The workload's per-replica GPU and CPU blocks at ``caps`` and its distinct keys."""
    from kvtriton.sim import simulate
    from kvtriton.sim.keys import workload_keys
    from kvtriton.specs import preset

    c = simulate(wl, setups=["eager"], bound=False, check_only=True, **caps).conditions
    _, n_keys = workload_keys(preset("llama3-8b", block_size=wl.hash_block_size), wl)
    return {"gpu_blocks": c["gpu_blocks"], "cpu_blocks": c["cpu_blocks"],
            "distinct_keys": n_keys}
