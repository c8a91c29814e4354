"""``kv_connector_extra_config`` parsing: defaults, every key, and one clear error per bad input.

No vLLM needed: the settings module imports none of it.
"""

from __future__ import annotations

import pytest

from kvtriton.vllm.config import DEFAULT_CPU_BYTES_PER_RANK, ConnectorConfig, parse_extra_config

GOOD = {
    "cpu_bytes_per_rank": 1 << 30,
    "restore": False,
    "cpu_free_order": "head_first",
    "cpu_eviction": "arc",
    "restore_share": 0.5,
    "max_restores_per_step": 64,
    "max_restores_per_key": 2,
    "offload": "lazy",
    "lazy_target_blocks": 128,
    "scan": "loop",
    "scan_idle": True,
}

BAD = [
    ("cpu_bytes_per_rank", 0, "positive int"),
    ("cpu_bytes_per_rank", 1.5e9, "positive int"),
    ("cpu_bytes_per_rank", True, "positive int"),
    ("restore", "yes", "true or false"),
    ("restore", 1, "true or false"),
    ("cpu_free_order", "tail", "'tail_first', 'head_first'"),
    ("cpu_eviction", "lfu", "'lru', 'arc', 's3fifo'"),
    ("restore_share", 1.5, "number in [0, 1]"),
    ("restore_share", float("nan"), "number in [0, 1]"),
    ("restore_share", True, "number in [0, 1]"),
    ("max_restores_per_step", -1, "non-negative int"),
    ("max_restores_per_key", 2.0, "non-negative int"),
    ("offload", "background", "'eager', 'lazy'"),
    ("lazy_target_blocks", "8", "non-negative int"),
    ("scan", "vectorized", "'fused', 'loop'"),
    ("scan_idle", None, "true or false"),
]


def test_defaults():
    cfg = parse_extra_config({})
    assert cfg == ConnectorConfig()
    assert cfg.cpu_bytes_per_rank == DEFAULT_CPU_BYTES_PER_RANK
    assert (cfg.restore, cfg.cpu_free_order, cfg.cpu_eviction, cfg.offload) == (
        True, "tail_first", "lru", "eager")
    assert parse_extra_config(None) == cfg


def test_every_key_reaches_the_planner():
    cfg = parse_extra_config(GOOD)
    pc = cfg.planner_config(world_size=4, max_num_batched_tokens=4096)
    assert (pc.restore, pc.cpu_free_order, pc.restore_share, pc.max_restores_per_step,
            pc.max_restores_per_key, pc.lazy, pc.lazy_target_blocks, pc.scan, pc.scan_idle,
            pc.world_size, pc.max_num_batched_tokens) == (
        False, "head_first", 0.5, 64, 2, True, 128, "loop", True, 4, 4096)
    assert cfg.cpu_eviction == "arc"
    assert "1.00 GiB/rank" in cfg.describe() and "lazy" in cfg.describe()


def test_unknown_key_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key "
                                         r"'cpu_bytes_to_use'; known keys: cpu_bytes_per_rank"):
        parse_extra_config({"cpu_bytes_to_use": 1 << 30})


@pytest.mark.parametrize(("key", "value", "allowed"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_names_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ValueError) as e:
        parse_extra_config({key: value})
    msg = str(e.value)
    assert f"[{key!r}] = {value!r}" in msg and allowed in msg, msg


@pytest.mark.parametrize("setup", ["eager", "eager+restore", "eager+restore:0.5+tail+arc",
                                   "eager+s3fifo", "eager+tail", "lazy", "lazy+arc"])
def test_extra_config_for_a_setup_gives_back_its_planner(setup):
    # The simulator's vLLM loop configures the connector through extra_config_for: parsing it
    # must give the planner the setup itself has, field for field.
    from kvtriton.setups import tier_policy
    from kvtriton.vllm.config import extra_config_for

    policy = tier_policy(setup)
    cfg = parse_extra_config(extra_config_for(policy))
    assert cfg.cpu_eviction == policy.cpu_eviction
    assert cfg.planner_config(world_size=1, max_num_batched_tokens=8192) == policy.planner


@pytest.mark.parametrize("setup", ["none", "eager+hints", "eager+second", "eager+refresh",
                                   "eager+nextuse", "eager+inf", "lazy+hinted", "eager+waiting"])
def test_extra_config_for_refuses_what_the_connector_cannot_take(setup):
    from kvtriton.setups import tier_policy
    from kvtriton.vllm.config import extra_config_for

    with pytest.raises(ValueError, match="setup"):
        extra_config_for(tier_policy(setup))
