"""The connector's statistics (``kvtriton.vllm.stats``) as vLLM's scheduler drains them: counters
since the last call, gauges at their latest value, and aggregation across reports.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import BS, build, run, tokens
from kvtriton.sim.vllm_scheduler import tiny_model_dir, vllm_request


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), 8192)


def test_stats_report_counters_since_last_call(model_dir):
    s, _side, drv = build(model_dir)
    drv.add(vllm_request("a", tokens(58, 3 * BS), 1, BS))
    run(drv)
    st = s.connector.get_kv_connector_stats()
    assert st.data["cpu_used_blocks"] == 0
    # The scheduler drains the stats every step, so the run's counters were already reported.
    assert st.is_empty()
    drv.add(vllm_request("b", tokens(59, 2 * BS), 1, BS))
    drv.run(5)
    again = s.connector.get_kv_connector_stats()
    merged = st.aggregate(again)
    assert merged.reduce()["cpu_used_blocks"] == again.data["cpu_used_blocks"]
