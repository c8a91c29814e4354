"""``second_tier`` settings: every key checked, each error naming the key and the value, at
engine start; an unreachable master refused before Mooncake's client retries in its log."""

from __future__ import annotations

import pytest

from kvtriton.second_tier.config import check_master_reachable, parse_second_tier
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
