"""One fleet run: ``simulate_fleet`` builds N replicas of one tier setup, a router and (for a
setup with ``shared``) the store they share, serves a workload and returns one row.

Capacities are per replica and mean what ``simulate``'s do; ``simulate`` checks every argument
(``check_only``), so a fleet refuses what one replica refuses, with the same message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvtriton.setups import tier_setup
from kvtriton.sim.cost import CostModel, ServingCost
from kvtriton.sim.fleet import Fleet, make_router
from kvtriton.sim.keys import workload_keys
from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.progress import Progress
from kvtriton.sim.second_tier import LOOPBACK_TCP, SimStore, StoreCost, StoreTier
from kvtriton.sim.simulate import simulate
from kvtriton.sim.workload import Workload
from kvtriton.specs import preset
from kvtriton.validation import is_int

__all__ = ["simulate_fleet"]


def simulate_fleet(workload: Workload, *, replicas: int, router: str, setup: str,
                   model: str = "llama3-8b", gpu: str = "H100",
                   gpu_blocks: int | None = None, cpu_blocks: int | None = None,
                   token_budget: int = 8192, max_running: int = 256,
                   store_blocks: int | None = None, store_cost: StoreCost | None = None,
                   cost: ServingCost | None = None, parts: Mapping[str, str] | None = None,
                   progress: bool = False) -> dict[str, Any]:
    """Serve ``workload`` on ``replicas`` replicas of ``setup`` (each with ``gpu_blocks`` and
    ``cpu_blocks``) behind ``router`` (``kvtriton.sim.fleet.ROUTERS``); ``store_blocks``: the
    shared store's capacity (setups with ``shared``). The row is ``simulate``'s for the whole
    fleet (hit rate, TTFTs, queueing delay over every request) with ``replicas``, ``router``
    and, per replica, requests routed, queueing delay and bytes over its host link; ``store``:
    bytes put and fetched through the shared store's links. ``parts`` as in ``simulate``."""
    if not is_int(replicas) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    route = make_router(router)
    checked = simulate(workload, model=model, gpu=gpu, gpu_blocks=gpu_blocks,
                       cpu_blocks=cpu_blocks, setups=[setup], token_budget=token_budget,
                       max_running=max_running, bound=False, cost=cost, parts=parts,
                       store_blocks=store_blocks, store_cost=store_cost, check_only=True)
    cond = checked.conditions
    pol = tier_setup(setup)
    layout = preset(model, block_size=workload.hash_block_size)
    cost = cost or CostModel.named(model, gpu)
    keys, _ = workload_keys(layout, workload)
    store_cost = store_cost or LOOPBACK_TCP
    shared = StoreTier(SimStore(store_blocks), store_cost) if pol.second_tier else None
    loops = [ServingLoop(workload, keys, layout, pol, cost, gpu_blocks=cond["gpu_blocks"],
                         cpu_blocks=cond["cpu_blocks"], token_budget=token_budget,
                         max_running=max_running, store_tier=shared)
             for _ in range(replicas)]
    fleet = Fleet(workload, keys, loops, route,
                  progress=Progress(f"{pol.name}x{replicas} {router}", enabled=progress))
    run = fleet.run()
    row: dict[str, Any] = run.merged.summary()
    row.update(setup=pol.name, composition=pol.composition, oracle=pol.oracle,
               replicas=replicas, router=route.name, router_signal=route.signal,
               routed=run.routed,
               prefix_left_elsewhere=run.prefix_left_elsewhere)
    queue = [float(np.mean(list(m.queue_by_request.values()))) if m.queue_by_request
             else 0.0 for m in run.replicas]
    row["replica_queue_delay_mean_s"] = queue
    row["busiest_queue_delay_ratio"] = (max(queue) / row["queue_delay_mean_s"]
                                        if row["queue_delay_mean_s"] else 1.0)
    row["replica_bytes_host"] = [m.bytes_d2h + m.bytes_h2d for m in run.replicas]
    if shared is not None:
        row["store"] = {"bytes_put": shared.puts.bytes, "bytes_fetched": shared.gets.bytes,
                        "blocks_written": shared.store.blocks_written,
                        "evicted": shared.store.evicted}
    if parts is not None:
        row["parts"] = run.merged.part_rows(parts)
    row["conditions"] = {**cond, "replicas": replicas, "router": route.name}
    return row
