"""A fleet in the serving loop (``kvtriton.sim.fleet``): one replica is today's simulator to
the last figure, each router picks what its signal says, and a store shared by the replicas
serves one replica what another computed."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.fleet import PrefixAware, make_router
from kvtriton.sim.fleet_run import simulate_fleet

# Modeled figures only: the measured ones (wall time, planner time) differ run to run.
_MEASURED = {"wall_s", "build_meta_ms_mean", "build_meta_ms_p99", "planner_ms_per_step"}


def _wl(n: int = 10, seed: int = 5):
    return agent_workload(num_conversations=n, min_turns=3, max_turns=6, seed=seed)


@pytest.mark.parametrize(("setup", "router"), [("eager", "round_robin"),
                                               ("eager+restore+s3fifo+hints", "prefix"),
                                               ("eager+shared", "session")])
def test_one_replica_gives_the_simulators_figures_exactly(setup, router):
    wl = _wl()
    sizes = _blocks(wl, dict(gpu_tokens=8_192, cpu_tokens=8_192))
    store = 200 if "shared" in setup else None
    alone = simulate(wl, setups=[setup], bound=False, store_blocks=store, **sizes).rows[0]
    fleet = simulate_fleet(wl, replicas=1, router=router, setup=setup, store_blocks=store,
                           **sizes)
    for k, v in alone.items():
        if k in _MEASURED or k not in fleet or k.startswith("second_tier_"):
            continue
        assert fleet[k] == v, k
    assert fleet["routed"] == [len(wl)]


def _blocks(wl, kw) -> dict:
    c = simulate(wl, setups=["eager"], bound=False, check_only=True, **kw).conditions
    return {"gpu_blocks": c["gpu_blocks"], "cpu_blocks": c["cpu_blocks"]}


def test_every_request_is_served_once_whatever_the_router():
    wl = _wl(10, seed=2)
    sizes = _blocks(wl, dict(gpu_tokens=8_192, cpu_tokens=8_192))
    for router in ("round_robin", "least_loaded", "session", "prefix"):
        row = simulate_fleet(wl, replicas=3, router=router, setup="eager", **sizes)
        assert row["finished"] + row["rejected"] == len(wl) == sum(row["routed"]), router
        assert len(row["replica_queue_delay_mean_s"]) == 3


def test_session_affinity_keeps_a_session_on_one_replica_and_round_robin_spreads_it():
    wl = _wl(12, seed=4)
    sizes = _blocks(wl, dict(gpu_tokens=16_384, cpu_tokens=16_384))
    sticky = simulate_fleet(wl, replicas=4, router="session", setup="eager", **sizes)
    spread = simulate_fleet(wl, replicas=4, router="round_robin", setup="eager", **sizes)
    # A session's later turns find its prefix where its first ran.
    assert sticky["token_hit_rate"] > spread["token_hit_rate"]
    # Round-robin sends turns away from their prefix; the sticky router leaves less there.
    assert spread["prefix_left_elsewhere"] > sticky["prefix_left_elsewhere"] >= 0


def test_the_prefix_router_picks_the_longest_cached_prefix_within_its_load_cap():
    class _Pool(set):
        pass

    class _Replica:
        def __init__(self, held, seqs):
            self.gpu, self.cpu = _Pool(held), None
            self.sched = type("S", (), {"seqs": dict.fromkeys(range(seqs))})()
            self.num_not_admitted = 0

    keys = np.array([[1, 2, 3, 4]])
    replicas = [_Replica({1}, 0), _Replica({1, 2, 3}, 1), _Replica({1, 2, 3, 4}, 30)]
    assert PrefixAware.cached_prefix(replicas[1], keys) == 3
    # The third holds the whole prompt but is far past the mean load: the second wins.
    assert PrefixAware(1.5).pick(None, keys, replicas) == 1
    assert PrefixAware(100.0).pick(None, keys, replicas) == 2


def test_a_shared_store_serves_one_replica_what_another_computed():
    """Round-robin spreads a session's turns over replicas; with a shared store the replica
    a later turn lands on fetches the prefix the earlier turns' replica wrote through."""
    wl = _wl(12, seed=6)
    sizes = _blocks(wl, dict(gpu_tokens=16_384, cpu_tokens=16_384))
    alone = simulate_fleet(wl, replicas=3, router="round_robin", setup="eager", **sizes)
    shared = simulate_fleet(wl, replicas=3, router="round_robin", setup="eager+shared",
                            store_blocks=100_000, **sizes)
    assert shared["token_hit_rate"] > alone["token_hit_rate"]
    assert shared["store"]["bytes_fetched"] > 0 and shared["store"]["bytes_put"] > 0


def test_bad_fleet_arguments_name_the_value():
    wl = _wl(2)
    with pytest.raises(ValueError, match="unknown router 'nearest'"):
        simulate_fleet(wl, replicas=2, router="nearest", setup="eager")
    with pytest.raises(ValueError, match="replicas must be a positive int, got 0"):
        simulate_fleet(wl, replicas=0, router="round_robin", setup="eager")
    with pytest.raises(ValueError, match="load_cap"):
        make_router("prefix:0.5")
    with pytest.raises(ValueError, match="store_blocks"):
        simulate_fleet(wl, replicas=2, router="round_robin", setup="eager+shared")
