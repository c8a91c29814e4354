"""The connector's statistics (``kvtriton.vllm.stats``) as vLLM's scheduler drains them: counters
since the last call, gauges at their latest value, aggregation across reports, and each name
documented in ``STATS`` for what it counts.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import BS, build, run, tokens
from kvtriton.sim.vllm_scheduler import vllm_request
from kvtriton.vllm.stats import GAUGES, STATS

pytestmark = pytest.mark.scheduler_role


def hashed_cpu_blocks(side) -> int:
    """Blocks of the CPU tier holding a cached block, counted one by one."""
    pool = side.cpu_pool
    return sum(pool.block_hash(b) is not None for b in range(1, pool.num_blocks))


def test_stats_report_counters_since_last_call(model_config_dir):
    s, _side, drv = build(model_config_dir)
    drv.add(vllm_request("a", tokens(58, 3 * BS), 1, BS))
    run(drv)
    st = s.connector.get_kv_connector_stats()
    assert st.data["cpu_blocks_pinned_by_transfers"] == 0
    # The scheduler drains the stats every step, so the run's counters were already reported.
    assert st.is_empty()
    drv.add(vllm_request("b", tokens(59, 2 * BS), 1, BS))
    drv.run(5)
    again = s.connector.get_kv_connector_stats()
    merged = st.aggregate(again)
    for gauge in GAUGES:
        assert merged.reduce()[gauge] == again.data[gauge]


def test_the_fill_gauge_counts_what_the_tier_holds_not_what_transfers_pin(model_config_dir):
    """After stores complete and every transfer finished, the tier holds the prompts' blocks:
    ``cpu_cached_blocks`` reads them while ``cpu_blocks_pinned_by_transfers`` reads 0. (The one
    gauge this replaced, ``cpu_used_blocks``, read 0 here: it counted the pins.) With a store
    held in flight, its destinations are pinned and not yet cached."""
    s, side, drv = build(model_config_dir)
    drv.add(vllm_request("a", tokens(60, 3 * BS), 1, BS))
    run(drv)
    gauges = s.connector.get_kv_connector_stats().data
    assert gauges["cpu_cached_blocks"] == hashed_cpu_blocks(side) == 3
    assert gauges["cpu_blocks_pinned_by_transfers"] == 0 and gauges["pending_store_blocks"] == 0

    drv.hold_stores = True
    drv.add(vllm_request("b", tokens(61, 2 * BS), 20, BS))
    for _ in range(4):
        drv.step()
    held = s.connector.get_kv_connector_stats().data
    in_flight = side.planner.pending_store_blocks()
    assert in_flight == 2 and held["pending_store_blocks"] == in_flight
    assert held["cpu_blocks_pinned_by_transfers"] == in_flight  # the stores' destinations
    assert held["cpu_cached_blocks"] == hashed_cpu_blocks(side) == 3
    drv.release_stores()
    run(drv)
    done = s.connector.get_kv_connector_stats().data
    assert done["cpu_cached_blocks"] == hashed_cpu_blocks(side) >= 5
    assert done["cpu_blocks_pinned_by_transfers"] == 0


def test_every_stat_the_scheduler_role_reports_is_documented_and_nothing_more(model_config_dir):
    _, side, _ = build(model_config_dir, extra_config={"setup": "eager+hints"})
    reported = set(side.counters()) | set(side.gauges())
    # The second tier's stats come with it (tests/store/test_engine_second_tier.py).
    documented = {name for name in STATS if not name.startswith(("worker_", "second_tier_"))}
    assert reported == documented
    assert set(side.gauges()) == set(GAUGES)
    for name, stat in STATS.items():
        assert stat.kind in ("counter", "gauge") and stat.unit and stat.meaning, name
