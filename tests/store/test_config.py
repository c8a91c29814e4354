"""``second_tier`` settings: every key checked, each error naming the key and the value, at
engine start; an unreachable master refused before Mooncake's client retries in its log; every
size bounded where Mooncake's own failure would name no key (issue 50, item 3)."""

from __future__ import annotations

import pytest

from kvtriton.second_tier import config as second_config
from kvtriton.second_tier.config import (
    MAX_FETCH_TIMEOUT_S,
    MIN_SEGMENT_BYTES,
    check_master_reachable,
    parse_second_tier,
)
from kvtriton.second_tier.local_master import free_port
from kvtriton.vllm.config import parse_extra_config

GOOD = {"kind": "mooncake", "master_server_address": "127.0.0.1:50051",
        "metadata_server": "http://127.0.0.1:8080/metadata"}


def test_defaults_and_mooncake_names():
    c = parse_second_tier({**GOOD, "segment_bytes": 1 << 30, "protocol": "tcp"})
    assert (c.segment_bytes, c.protocol, c.local_buffer_bytes, c.fetch_timeout_s) == (
        1 << 30, "tcp", 16 << 20, 5.0)
    assert c.hostname == "127.0.0.1"  # a loopback master: a loopback transfer engine
    assert parse_second_tier(None) is None
    assert parse_extra_config({}).second_tier is None
    assert parse_extra_config({"second_tier": GOOD}).second_tier == parse_second_tier(GOOD)


@pytest.mark.parametrize("key, value, needle", [
    ("kind", "redis", "'kind'"),
    ("master_server_address", "127.0.0.1", "'master_server_address'"),
    ("master_server_address", "host:99999", "'master_server_address'"),
    ("metadata_server", "127.0.0.1:8080", "'metadata_server'"),
    ("protocol", "udp", "'protocol'"),
    ("segment_bytes", -1, "'segment_bytes'"),
    ("segment_bytes", 1.5, "'segment_bytes'"),
    ("local_buffer_bytes", 0, "'local_buffer_bytes'"),
    ("fetch_timeout_s", 0, "'fetch_timeout_s'"),
    ("fetch_timeout_s", True, "'fetch_timeout_s'"),
    ("local_hostname", 7, "'local_hostname'"),
    ("segmentbytes", 1, "unknown key 'segmentbytes'"),
])
def test_a_bad_value_names_its_key(key, value, needle):
    with pytest.raises(ValueError, match="second_tier") as e:
        parse_extra_config({"second_tier": {**GOOD, key: value}})
    assert needle in str(e.value)
    if not needle.startswith("unknown"):
        assert repr(value) in str(e.value)


@pytest.mark.parametrize("missing", ["kind", "master_server_address", "metadata_server"])
def test_a_required_key_missing_is_named(missing):
    with pytest.raises(ValueError, match=f"'{missing}' is required"):
        parse_second_tier({k: v for k, v in GOOD.items() if k != missing})


def test_not_an_object_and_rdma_without_a_device():
    with pytest.raises(ValueError, match="must be an object"):
        parse_second_tier("mooncake")
    with pytest.raises(ValueError, match="'device_name'\\] is required"):
        parse_second_tier({**GOOD, "protocol": "rdma"})


def test_an_unreachable_master_is_named_at_start():
    port = free_port()  # nothing listens there
    c = parse_second_tier({**GOOD, "master_server_address": f"127.0.0.1:{port}"})
    with pytest.raises(ValueError, match=f"'master_server_address'\\] = '127.0.0.1:{port}'"):
        check_master_reachable(c, timeout_s=1.0)


HOST_BYTES = 64 << 30  # the host's memory these cases assume, whatever this machine has


@pytest.fixture
def host_64g(monkeypatch):
    monkeypatch.setattr(second_config, "host_memory_bytes", lambda: HOST_BYTES)


# Each passed the parse before issue 50 and failed later without naming its key: Mooncake's
# TypeError (past 2^64), MemoryError (std::bad_alloc), setup's -600 read as a bad address, a
# master or metadata service never reached, a timeout that meant never.
BOUNDS = {
    "segment_2^70": ("segment_bytes", 2**70),
    "segment_1TiB": ("segment_bytes", 1 << 40),
    "segment_1MiB": ("segment_bytes", 1 << 20),
    "segment_under_16MiB": ("segment_bytes", MIN_SEGMENT_BYTES - 1),
    "segment_over_host": ("segment_bytes", HOST_BYTES + 1),
    "buffer_2^62": ("local_buffer_bytes", 2**62),
    "buffer_over_host": ("local_buffer_bytes", HOST_BYTES + 1),
    # int() reads both as 50051; Mooncake reads neither.
    "address_arabic_digits": ("master_server_address", "h:\u0665\u0660\u0660\u0665\u0661"),
    "address_fullwidth_digits": ("master_server_address", "h:\uff15\uff10\uff10\uff15\uff11"),
    "address_space": ("master_server_address", "store host:50051"),
    "address_space_before_port": ("master_server_address", "127.0.0.1 :50051"),
    "address_non_ascii_host": ("master_server_address", "st\u00f6re:50051"),
    "address_ipv6_unbracketed": ("master_server_address", "::1:50051"),
    "address_ipv6_bad": ("master_server_address", "[::g]:50051"),
    "metadata_no_host": ("metadata_server", "http:///x"),
    "metadata_no_path": ("metadata_server", "http://127.0.0.1:8080"),
    "metadata_etcd_empty": ("metadata_server", "etcd://"),
    "metadata_redis_empty": ("metadata_server", "redis://"),
    "metadata_non_ascii_port": ("metadata_server", "http://127.0.0.1:\u0668\u0660/metadata"),
    "metadata_space": ("metadata_server", "http://127.0.0.1:8080/meta data"),
    "timeout_1e300": ("fetch_timeout_s", 1e300),
    "timeout_over_max": ("fetch_timeout_s", MAX_FETCH_TIMEOUT_S + 1),
    "timeout_nan": ("fetch_timeout_s", float("nan")),
}


@pytest.mark.parametrize("key, value", BOUNDS.values(), ids=BOUNDS.keys())
def test_a_value_past_its_bound_is_one_error_naming_key_and_value(host_64g, key, value):
    with pytest.raises(ValueError) as e:
        parse_extra_config({"second_tier": {**GOOD, key: value}})
    msg = str(e.value)
    assert f"['second_tier'][{key!r}] = {value!r} is not allowed" in msg
    assert "\n" not in msg


def test_sync_load_budget_is_bounded_by_the_host(monkeypatch):
    """``sync_load_budget_bytes: 2**70`` was accepted and served as no budget at all."""
    from kvtriton.vllm import config as connector_config

    monkeypatch.setattr(connector_config, "host_memory_bytes", lambda: HOST_BYTES)
    assert parse_extra_config({"sync_load_budget_bytes": HOST_BYTES}).sync_load_budget_bytes \
        == HOST_BYTES
    for value in (2**70, HOST_BYTES + 1):
        with pytest.raises(ValueError) as e:
            parse_extra_config({"sync_load_budget_bytes": value})
        assert f"['sync_load_budget_bytes'] = {value} is not allowed" in str(e.value)
        assert "\n" not in str(e.value)


WITHIN = {
    "segment_0": ("segment_bytes", 0),
    "segment_16MiB": ("segment_bytes", MIN_SEGMENT_BYTES),
    "segment_host": ("segment_bytes", HOST_BYTES),
    "buffer_1": ("local_buffer_bytes", 1),
    "buffer_host": ("local_buffer_bytes", HOST_BYTES),
    "address_ipv6": ("master_server_address", "[::1]:50051"),
    "address_name": ("master_server_address", "store-host.example.com:50051"),
    "metadata_ipv6": ("metadata_server", "http://[::1]:8080/metadata"),
    "metadata_default_port": ("metadata_server", "http://store-host/metadata"),
    "metadata_etcd": ("metadata_server", "etcd://10.0.0.1:2379;10.0.0.2:2379"),
    "metadata_redis": ("metadata_server", "redis://10.0.0.1:6379"),
    "metadata_p2p": ("metadata_server", "P2PHANDSHAKE"),
    "timeout_max": ("fetch_timeout_s", MAX_FETCH_TIMEOUT_S),
}


@pytest.mark.parametrize("key, value", WITHIN.values(), ids=WITHIN.keys())
def test_values_within_their_bounds_pass(host_64g, key, value):
    assert getattr(parse_second_tier({**GOOD, key: value}), key) == value


def test_a_bracketed_ipv6_master_is_reached_without_its_brackets():
    c = parse_second_tier({**GOOD, "master_server_address": "[::1]:50051"})
    assert c.master_host_port == ("::1", 50051)
    assert c.hostname == "127.0.0.1"  # a loopback master: a loopback transfer engine
