"""The second tier in the serving loop (``kvtriton.sim.second_tier``): the store's capacity,
its place under a CPU tier too small for the workload, and the setup ``shared`` meaning in the
simulator what it means to the connector."""

from __future__ import annotations

import pytest

from kvtriton.setups import DEFAULT_SETUP, tier_setup
from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.second_tier import LOOPBACK_TCP, SimStore, StoreCost
from kvtriton.vllm.config import parse_extra_config

STORE = {"kind": "mooncake", "master_server_address": "127.0.0.1:50051",
         "metadata_server": "http://127.0.0.1:8080/metadata"}


def test_the_store_forgets_its_least_recently_used_block_when_full():
    s = SimStore(3)
    s.write([1, 2, 3])
    assert s.query([1]).tolist() == [True]  # 1 is used: 2 is now the oldest
    s.write([4])
    assert s.query([1, 2, 3, 4]).tolist() == [True, False, True, True]
    assert (s.blocks_written, s.evicted) == (4, 1)
    s.write([4, 3])  # held already: used, not written again
    assert s.blocks_written == 4
    with pytest.raises(ValueError, match="capacity_blocks"):
        SimStore(0)


def test_a_fetch_costs_the_links_latency_and_bytes():
    cost = StoreCost(1e9, 1e-3, "test")
    assert cost.fetch_s(2_000_000) == pytest.approx(3e-3)
    assert LOOPBACK_TCP.bandwidth_bytes_per_s > 0 and "measured" in LOOPBACK_TCP.source


def _run(store_blocks: int):
    wl = agent_workload(num_conversations=6, min_turns=3, max_turns=5, seed=3)
    return simulate(wl, gpu_tokens=8_192, cpu_tokens=8_192, bound=False,
                    setups=["eager", "eager+shared"], store_blocks=store_blocks)


def test_a_store_under_a_small_cpu_tier_serves_what_it_evicted():
    """Both runs end clean (every pool free, every fetch reported): the loop checks it. With a
    store that holds the workload, recompute falls; with a one-block store it cannot help."""
    big = {r["setup"]: r for r in _run(1_000_000).rows}
    assert big["eager+shared"]["recomputed_tokens"] < big["eager"]["recomputed_tokens"]
    assert big["eager+shared"]["second_tier_blocks_fetched"] > 0
    assert big["eager+shared"]["token_hit_rate"] > big["eager"]["token_hit_rate"]
    tiny = {r["setup"]: r for r in _run(1).rows}
    assert tiny["eager+shared"]["token_hit_rate"] <= big["eager+shared"]["token_hit_rate"]


def test_shared_needs_a_capacity_and_the_kvtriton_engine():
    wl = agent_workload(num_conversations=2, min_turns=2, max_turns=2, seed=0)
    with pytest.raises(ValueError, match="store_blocks"):
        simulate(wl, setups=["eager+shared"], bound=False)
    with pytest.raises(ValueError, match="engine='vllm' does not run the second tier"):
        simulate(wl, setups=["eager+shared"], bound=False, store_blocks=10, engine="vllm",
                 check_only=True)


def test_shared_means_the_same_setup_in_the_connector():
    assert tier_setup("eager+shared").second_tier and not tier_setup("eager").second_tier
    # No setup named: the default's, with the store's tier on.
    assert parse_extra_config({"second_tier": STORE}).setup == \
        tier_setup(f"{DEFAULT_SETUP}+shared").composition
    assert parse_extra_config({"setup": "lazy+hints", "second_tier": STORE}).setup == \
        "lazy+hints+shared"
    with pytest.raises(ValueError, match="'second_tier' is not set"):
        parse_extra_config({"setup": "eager+shared"})


def test_the_loopback_profile_is_what_the_benchmark_measures():
    """``LOOPBACK_TCP`` carries what ``bench/results/second_tier.json`` measured (two digits, at
    the commit its source names); a rerun moves the figures with the machine's noise, so this
    holds it to within a factor of two of the file there now."""
    import json
    from pathlib import Path

    doc = json.loads((Path(__file__).resolve().parents[2] / "bench" / "results"
                      / "second_tier.json").read_text())
    measured = StoreCost.from_results(doc, "")
    for got, want in ((LOOPBACK_TCP.bandwidth_bytes_per_s, measured.bandwidth_bytes_per_s),
                      (LOOPBACK_TCP.latency_s, measured.latency_s)):
        assert want / 2 <= got <= want * 2
