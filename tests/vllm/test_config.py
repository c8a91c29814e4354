"""``kv_connector_extra_config`` parsing: the setup by name, the keys beside it, the per-axis
keys of earlier versions, and one clear error per bad input, contradiction or impossible size.

No vLLM needed: the settings module imports none of it (``test_startup_errors`` in
``tests/vllm/test_engine_signals.py`` shows one of these errors stopping a real engine's start).
"""

from __future__ import annotations

import pytest

from kvtriton.setups import ABLATION, BOUNDS, COMBINED, DEFAULT_SETUP, tier_policy
from kvtriton.vllm.config import (
    DEFAULT_CPU_BYTES_PER_RANK,
    ConnectorConfig,
    check_host_memory,
    extra_config_for,
    parse_extra_config,
)

GOOD = {
    "setup": "lazy+hinted+arc",
    "cpu_bytes_per_rank": 1 << 30,
    "lazy_target_blocks": 128,
    "scan": "loop",
    "scan_idle": True,
}

BAD = [
    ("cpu_bytes_per_rank", 0, "positive int"),
    ("cpu_bytes_per_rank", 1.5e9, "positive int"),
    ("cpu_bytes_per_rank", True, "positive int"),
    ("setup", 3, "a setup string"),
    ("restore", "yes", "true or false"),
    ("restore", 1, "true or false"),
    ("cpu_free_order", "tail", "'tail_first', 'head_first'"),
    ("cpu_eviction", "fifo", "'lru', 'arc', 's3fifo', 'lfu'"),
    ("restore_share", 1.5, "number in [0, 1]"),
    ("restore_share", float("nan"), "number in [0, 1]"),
    ("restore_share", True, "number in [0, 1]"),
    ("max_restores_per_step", -1, "non-negative int"),
    ("max_restores_per_key", 2.0, "non-negative int"),
    ("offload", "background", "'eager', 'lazy'"),
    ("lazy_target_blocks", "8", "positive int"),
    ("lazy_target_blocks", 0, "the lazy tier would store nothing"),
    ("scan", "vectorized", "'fused', 'loop'"),
    ("scan_idle", None, "true or false"),
]


def test_defaults():
    cfg = parse_extra_config({})
    assert cfg == ConnectorConfig()
    assert cfg.cpu_bytes_per_rank == DEFAULT_CPU_BYTES_PER_RANK
    assert cfg.setup == tier_policy(DEFAULT_SETUP).composition
    assert parse_extra_config(None) == cfg


def test_every_key_reaches_the_planner():
    cfg = parse_extra_config(GOOD)
    pc = cfg.planner_config(world_size=4, max_num_batched_tokens=4096)
    assert (pc.restore, pc.lazy, pc.admission, pc.lazy_target_blocks, pc.scan, pc.scan_idle,
            pc.world_size, pc.max_num_batched_tokens) == (
        False, True, "hinted", 128, "loop", True, 4, 4096)
    assert cfg.cpu_eviction == "arc"
    line = cfg.describe()
    assert line.startswith("setup lazy+arc+hinted (") and "1.00 GiB/rank" in line, line


@pytest.mark.parametrize("setup", sorted(set(ABLATION + COMBINED)))
def test_every_online_setup_of_the_study_is_one_key(setup):
    """Each setup the simulator's study runs is accepted as is, in its canonical spelling, and
    gives the planner, eviction and signals the simulator builds from the same string."""
    policy = tier_policy(setup)
    cfg = parse_extra_config({"setup": setup})
    assert cfg.setup == policy.composition and cfg.policy == policy
    pc = cfg.planner_config(world_size=1, max_num_batched_tokens=8192)
    assert pc == policy.planner
    assert parse_extra_config(extra_config_for(policy)) == cfg


@pytest.mark.parametrize("name", ["control", "restore_tail_bounded_arc"])
def test_presets_are_accepted_as_the_simulator_accepts_them(name):
    assert parse_extra_config({"setup": name}).setup == tier_policy(name).composition


@pytest.mark.parametrize(("setup", "named"), [
    ("eager+nextuse", "the eviction 'nextuse' is an oracle"),
    ("lazy+nextuse", "the eviction 'nextuse' is an oracle"),
    ("eager+inf", "the capacity 'inf' is a bound"),
    ("none", "has no CPU tier"),
    ("lazy+restore", "'lazy' with 're-store' means nothing"),
    ("eager+lfru", "unknown axis value 'lfru'"),
])
def test_a_setup_the_connector_cannot_run_is_one_error_naming_the_axis(setup, named):
    with pytest.raises(ValueError) as e:
        parse_extra_config({"setup": setup})
    msg = str(e.value)
    assert msg.startswith(f"KVTritonConnector: kv_connector_extra_config['setup'] = {setup!r}")
    assert named in msg and "\n" not in msg, msg


def test_extra_config_for_is_the_setup_key_and_refuses_the_bounds():
    assert extra_config_for(tier_policy("lazy+hints")) == {"setup": "lazy+hints"}
    for bound in BOUNDS:
        with pytest.raises(ValueError, match=r"oracle|bound"):
            extra_config_for(tier_policy(bound))
    with pytest.raises(ValueError, match="no CPU tier"):
        extra_config_for(tier_policy("none"))


def test_unknown_key_names_it_and_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config key "
                                         r"'cpu_bytes_to_use'; known keys: setup, "
                                         r"cpu_bytes_per_rank"):
        parse_extra_config({"cpu_bytes_to_use": 1 << 30})


@pytest.mark.parametrize(("key", "value", "allowed"), BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_value_names_key_and_allowed_values(key, value, allowed):
    with pytest.raises(ValueError) as e:
        parse_extra_config({key: value})
    msg = str(e.value)
    assert f"[{key!r}] = {value!r}" in msg and allowed in msg, msg


# ---- the per-axis keys of earlier versions -----------------------------------------------------


@pytest.mark.parametrize(("extra", "setup"), [
    ({"restore": True}, "eager+restore+tail"),  # the defaults they always had
    ({"restore": False, "cpu_free_order": "head_first"}, "eager"),  # vLLM's connector
    ({"cpu_eviction": "arc", "restore_share": 0.5}, "eager+restore:0.5+tail+arc"),
    ({"offload": "lazy", "lazy_target_blocks": 64}, "lazy+tail"),  # lazy drops the re-store
])
def test_per_axis_keys_spell_a_setup(extra, setup):
    assert parse_extra_config(extra).setup == setup


@pytest.mark.parametrize(("extra", "setup"), [
    ({"setup": "eager+restore+tail", "restore": True, "cpu_eviction": "lru"},
     "eager+restore+tail"),
    ({"setup": "lazy", "offload": "lazy", "restore": False}, "lazy"),
])
def test_a_per_axis_key_that_agrees_with_the_setup_is_accepted(extra, setup):
    assert parse_extra_config(extra).setup == setup


# Contradictions: each one error at start-up naming the key (issue 24, item 5, and the keys the
# setup makes meaningless).
CONTRADICTIONS = [
    ({"offload": "lazy", "restore": True}, "'offload' = \"lazy\", 'restore' = true]: 'lazy' "
                                           "with 're-store' means nothing"),
    ({"setup": "lazy", "restore": True}, "['restore'] = true contradicts setup 'lazy'"),
    ({"setup": "eager+restore", "offload": "lazy"},
     "['offload'] = \"lazy\" contradicts setup 'eager+restore'"),
    ({"setup": "eager", "cpu_eviction": "arc"}, "['cpu_eviction'] = \"arc\" contradicts"),
    ({"setup": "eager+arc", "lazy_target_blocks": 64},
     "['lazy_target_blocks'] = 64 with the eager setup 'eager+arc'"),
    ({"lazy_target_blocks": 64}, "['lazy_target_blocks'] = 64 with the eager setup"),
    ({"restore": False, "restore_share": 0.5}, "['restore_share'] = 0.5 with re-store off"),
    ({"setup": "eager", "restore_share": 0.5}, "['restore_share'] = 0.5 contradicts setup"),
    ({"setup": "eager", "max_restores_per_step": 4},
     "['max_restores_per_step'] = 4 with the setup 'eager', which never re-stores"),
    ({"setup": "lazy", "max_restores_per_key": 2}, "['max_restores_per_key'] = 2 with the setup"),
]


@pytest.mark.parametrize(("extra", "named"), CONTRADICTIONS,
                         ids=[",".join(e) for e, _ in CONTRADICTIONS])
def test_contradictions_are_one_error_naming_the_key(extra, named):
    with pytest.raises(ValueError) as e:
        parse_extra_config(extra)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config[")
    assert named in msg and "\n" not in msg, msg


def test_re_store_caps_are_accepted_with_re_store():
    cfg = parse_extra_config({"setup": "eager+restore", "max_restores_per_step": 4,
                              "max_restores_per_key": 2})
    pc = cfg.planner_config(world_size=1, max_num_batched_tokens=8192)
    assert (pc.max_restores_per_step, pc.max_restores_per_key) == (4, 2)


@pytest.mark.parametrize(("extra", "named"), [
    ('{"setup": "lazy+hints"}', "got a str '{\"setup\": \"lazy+hints\"}': it is JSON text; "
                                "pass the object itself"),
    ("lazy+hints", "got a str 'lazy+hints'"),
    ([("setup", "lazy")], "got a list"),
])
def test_the_whole_config_given_as_something_else_than_an_object(extra, named):
    with pytest.raises(ValueError) as e:
        parse_extra_config(extra)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config must be a JSON object")
    assert named in msg, msg


# ---- sizes the machine cannot hold ---------------------------------------------------------------


@pytest.mark.parametrize(("nbytes", "ranks", "total", "shown"), [
    (2**70, 1, 23 << 30, "1180591620717411303424 (1.1e+12 GiB) exceeds this machine's memory "
                         "(23.0 GiB)"),
    (64 << 30, 1, 23 << 30, "68719476736 (64 GiB) exceeds this machine's memory (23.0 GiB)"),
    (8 << 30, 4, 23 << 30, "(8 GiB) x 4 ranks on this host exceeds"),
])
def test_a_tier_larger_than_the_machine_is_refused_before_allocating(nbytes, ranks, total,
                                                                    shown):
    cfg = parse_extra_config({"cpu_bytes_per_rank": nbytes})
    with pytest.raises(ValueError) as e:
        check_host_memory(cfg, ranks, total_bytes=total)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config['cpu_bytes_per_rank'] = ")
    assert shown in msg, msg


def test_a_tier_that_fits_passes_and_the_real_machine_is_read():
    check_host_memory(parse_extra_config({"cpu_bytes_per_rank": 2 << 30}), 2,
                      total_bytes=23 << 30)
    check_host_memory(parse_extra_config({"cpu_bytes_per_rank": 1 << 20}))  # this machine
    with pytest.raises(ValueError, match="exceeds this machine's memory"):
        check_host_memory(parse_extra_config({"cpu_bytes_per_rank": 2**70}))


def test_lfu_runs_in_the_connector_by_name():
    cfg = parse_extra_config({"setup": "eager+lfu:4+waiting"})
    assert cfg.setup == "eager+lfu:4+waiting" and cfg.cpu_eviction == "lfu:4"
    assert extra_config_for(tier_policy("eager+lfu")) == {"setup": "eager+lfu"}
