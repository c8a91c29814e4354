"""``kv_connector_extra_config`` parsing: the setup by name, the keys beside it, the per-axis
keys of earlier versions, and one clear error per bad input, contradiction or impossible size.

No vLLM needed: the settings module imports none of it (``test_startup_errors`` in
``tests/vllm/test_engine_signals.py`` shows one of these errors stopping a real engine's start).
"""

from __future__ import annotations

import pytest

from bench.tier_study.study import ABLATION, COMBINED
from kvtriton.setups import DEFAULT_SETUP, REFERENCES, tier_setup
from kvtriton.tier_signals import book_bytes, claim_bytes
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
    ("max_restores_per_step", -1, "non-negative int"),
    ("max_restores_per_key", 2.0, "non-negative int"),
    ("lazy_target_blocks", "8", "positive int"),
    ("lazy_target_blocks", 0, "the lazy tier would store nothing"),
    ("scan", "vectorized", "'fused', 'loop'"),
    ("scan_idle", None, "true or false"),
    ("sync_load_budget_bytes", -1, "non-negative int (bytes per scheduler step"),
    ("sync_load_budget_bytes", 1.5e6, "non-negative int (bytes per scheduler step"),
    ("sync_load_budget_bytes", True, "non-negative int (bytes per scheduler step"),
]


def test_defaults():
    cfg = parse_extra_config({})
    assert cfg == ConnectorConfig()
    assert cfg.cpu_bytes_per_rank == DEFAULT_CPU_BYTES_PER_RANK
    assert cfg.setup == tier_setup(DEFAULT_SETUP).composition
    assert parse_extra_config(None) == cfg


def test_every_key_reaches_the_planner():
    cfg = parse_extra_config(GOOD)
    pc = cfg.planner_config(world_size=4, max_num_batched_tokens=4096)
    assert (pc.restore, pc.lazy, pc.admission, pc.lazy_target_blocks, pc.scan, pc.scan_idle,
            pc.world_size, pc.max_num_batched_tokens) == (
        False, True, "hinted", 128, "loop", True, 4, 4096)
    assert cfg.tier.cpu_eviction == "arc"
    line = cfg.describe()
    assert line.startswith("setup lazy+arc+hinted (") and "1.00 GiB/rank" in line, line


@pytest.mark.parametrize("setup", sorted(set(ABLATION + COMBINED)))
def test_every_online_setup_of_the_study_is_one_key(setup):
    """Each setup the simulator's study runs is accepted as is, in its canonical spelling, and
    gives the planner, eviction and signals the simulator builds from the same string."""
    tier = tier_setup(setup)
    cfg = parse_extra_config({"setup": setup})
    assert cfg.setup == tier.composition and cfg.tier == tier
    pc = cfg.planner_config(world_size=1, max_num_batched_tokens=8192)
    assert pc == tier.planner
    assert parse_extra_config(extra_config_for(tier)) == cfg


@pytest.mark.parametrize(("name", "composition"), [
    ("control", "eager"), ("restore_tail_bounded_arc", "eager+restore:0.5+tail+arc")])
def test_a_removed_preset_name_is_one_error_naming_the_composition(name, composition):
    with pytest.raises(ValueError) as e:
        parse_extra_config({"setup": name})
    msg = str(e.value)
    assert msg.startswith(f"KVTritonConnector: kv_connector_extra_config['setup'] = {name!r}: ")
    assert msg.endswith(f"write {composition!r}"), msg


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
    assert extra_config_for(tier_setup("lazy+hints")) == {"setup": "lazy+hints"}
    for bound in REFERENCES:
        with pytest.raises(ValueError, match=r"oracle|bound"):
            extra_config_for(tier_setup(bound))
    with pytest.raises(ValueError, match="no CPU tier"):
        extra_config_for(tier_setup("none"))


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


@pytest.mark.parametrize(("extra", "named"), [
    ({"cpu_eviction": "lru"}, "['cpu_eviction']"),
    ({"restore": True, "cpu_free_order": "head_first"}, "['restore', 'cpu_free_order']"),
    ({"offload": "lazy", "lazy_target_blocks": 64}, "['offload']"),
    ({"restore_share": 0.5}, "['restore_share']"),
    ({"restore": "yes"}, "['restore']"),  # no value of a removed key is read
    ({"setup": "eager", "cpu_eviction": "arc"}, "['cpu_eviction']"),  # beside a setup too
])
def test_a_removed_per_axis_key_is_one_error_naming_it_and_asking_for_setup(extra, named):
    """A setup has one spelling: the per-axis keys of earlier versions are refused at start-up,
    in one line that names them and asks for ``setup``, with the defaults they had (which are
    not today's: ``{}`` and ``{"cpu_eviction": "lru"}`` meant different setups)."""
    with pytest.raises(ValueError) as e:
        parse_extra_config(extra)
    msg = str(e.value)
    assert msg.startswith(f"KVTritonConnector: kv_connector_extra_config{named}: the per-axis "
                          "keys") and "\n" not in msg, msg
    assert "no longer read" in msg and "one key, 'setup'" in msg, msg
    assert "defaults were eager+restore+tail" in msg, msg


# Contradictions: each one error at start-up naming the key (issue 24, item 5, and the keys the
# setup makes meaningless).
CONTRADICTIONS = [
    ({"setup": "eager+arc", "lazy_target_blocks": 64},
     "['lazy_target_blocks'] = 64 with the eager setup 'eager+arc'"),
    ({"lazy_target_blocks": 64}, "['lazy_target_blocks'] = 64 with the eager setup"),
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
    assert cfg.setup == "eager+lfu:4+waiting" and cfg.tier.cpu_eviction == "lfu:4"
    assert extra_config_for(tier_setup("eager+lfu")) == {"setup": "eager+lfu"}


# ---- setups whose numbers a general format writes with an exponent (issue 36, item 6) -----------


@pytest.mark.parametrize("setup", ["eager+restore:0.00001", "eager+lfu:1000000",
                                   "lazy+hints:0.0000001", "eager+restore:0.1234567"])
def test_a_setup_with_tiny_or_huge_numbers_runs_as_written(setup):
    """The stored setup is the canonical name, which must parse again wherever the connector
    reads it (planner switches, the start-up line) and name the same numbers."""
    cfg = parse_extra_config({"setup": setup})
    assert cfg.setup == setup and cfg.tier == tier_setup(setup)
    assert cfg.planner_config(world_size=1, max_num_batched_tokens=8192) == cfg.tier.planner
    assert cfg.describe().startswith(f"setup {setup} (")
    assert parse_extra_config(extra_config_for(cfg.tier)) == cfg


# ---- the lfu sketch is counted at start-up (issue 36, item 7) ---------------------------------


TIER = 1 << 30  # bytes per rank
BLOCKS = 3001  # the tier's blocks, the null block included


def _sketch(setup: str) -> int:
    return tier_setup(setup).eviction_bytes(BLOCKS)


def test_a_sketch_that_does_not_fit_beside_the_tier_names_the_setup_as_written():
    written = "lfu:64+eager"  # not the canonical spelling: the error names what the user wrote
    cfg = parse_extra_config({"setup": written, "cpu_bytes_per_rank": TIER})
    sketch = _sketch(written)
    assert sketch == 4 << 18  # 4 rows of 64 x 3,000 counters, rounded up to 2^18
    check_host_memory(cfg, 1, total_bytes=TIER + sketch, cpu_blocks=BLOCKS)  # counted, fits
    with pytest.raises(ValueError) as e:
        check_host_memory(cfg, 1, total_bytes=TIER + sketch - 1, cpu_blocks=BLOCKS,
                          setup_as_written=written)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config['setup'] = "
                          "'lfu:64+eager': its LFU sketch for the 3,000-block CPU tier takes "
                          f"{sketch} bytes"), msg
    assert f"with the tier's {TIER} bytes" in msg and "\n" not in msg, msg
    assert "use a smaller window W" in msg, msg


def test_the_sketch_of_lfu_1000000_is_one_error_not_a_memory_error():
    # The default 8 GiB tier of a small model: 262,143 blocks of 32 KiB, a 1 TiB sketch.
    cfg = parse_extra_config({"setup": "eager+lfu:1000000"})
    with pytest.raises(ValueError) as e:
        check_host_memory(cfg, 1, total_bytes=64 << 30, cpu_blocks=262_144)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config['setup'] = "
                          "'eager+lfu:1000000': its LFU sketch for the 262,143-block CPU tier "
                          f"takes {1 << 40} bytes (1024 GiB)"), msg


def test_other_evictions_and_the_tier_alone_count_no_sketch():
    for setup in ("eager", "eager+arc", "lazy+s3fifo+hints"):
        assert _sketch(setup) == 0
        cfg = parse_extra_config({"setup": setup, "cpu_bytes_per_rank": TIER})
        claims = claim_bytes(tier_setup(setup), BLOCKS)  # hints: counted as claims
        check_host_memory(cfg, 1, total_bytes=TIER + claims, cpu_blocks=BLOCKS)
        assert "sketch" not in cfg.describe(BLOCKS)
    # Without the tier's blocks the check is the tier's bytes alone, as before.
    check_host_memory(parse_extra_config({"setup": "eager+lfu:64", "cpu_bytes_per_rank": TIER}),
                      1, total_bytes=TIER)


def test_the_claims_of_sessions_are_counted_at_start_up_and_name_the_setup():
    """``sessions`` and ``hints`` keep claims bounded by the protected segment
    (``kvtriton.tier_signals.book_bytes``): counted beside the tier, named in the error, given
    on the start-up line; a setup without either counts none."""
    blocks = 1_000_001
    cfg = parse_extra_config({"setup": "eager+sessions", "cpu_bytes_per_rank": TIER})
    claims = claim_bytes(tier_setup("eager+sessions"), blocks)
    assert claims == book_bytes(500_000) > 500_000 * 1024  # about 1 KiB per protected block
    check_host_memory(cfg, 1, total_bytes=TIER + claims, cpu_blocks=blocks)
    with pytest.raises(ValueError) as e:
        check_host_memory(cfg, 1, total_bytes=TIER + claims - 1, cpu_blocks=blocks)
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config['setup'] = "
                          "'eager+sessions': its session and hint claims for the "
                          f"1,000,000-block CPU tier take up to {claims} bytes"), msg
    assert "drop 'sessions'" in msg and "\n" not in msg, msg
    assert f"claims <= {claims / 2**20:.1f} MiB" in cfg.describe(blocks)
    assert claim_bytes(tier_setup("eager+waiting"), blocks) == 0
    both = tier_setup("eager+lfu:64+hints")
    with pytest.raises(ValueError, match="its LFU sketch and session and hint claims for the "):
        check_host_memory(parse_extra_config({"setup": "eager+lfu:64+hints"}), 1,
                          total_bytes=8 << 30, cpu_blocks=blocks)
    assert both.eviction_bytes(blocks) > 0 and claim_bytes(both, blocks) > 0


def test_the_start_up_line_gives_the_sketch_size():
    cfg = parse_extra_config({"setup": "eager+lfu:64", "cpu_bytes_per_rank": TIER})
    line = cfg.describe(BLOCKS)
    assert "CPU 1.00 GiB/rank + LFU sketch 1.0 MiB, scan fused" in line, line
    assert "sketch" not in cfg.describe()
