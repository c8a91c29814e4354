"""Mooncake's client at engine start, against a real ``mooncake_master`` on loopback: a size
that only Mooncake refuses is one error naming its key and value (setup's -600 is a segment
Mooncake could not allocate, not a bad address; ``std::bad_alloc`` is the transfer buffer), and
a master named by a bracketed IPv6 address is reached and joined (issue 50, item 3).

The sizes here get past ``parse_second_tier`` only by building ``SecondTierConfig`` directly: a
host whose memory the parse allowed may still fail to map it."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("mooncake.store")

from kvtriton.second_tier.client import StoreClient
from kvtriton.second_tier.config import (
    MIN_SEGMENT_BYTES,
    SecondTierConfig,
    check_master_reachable,
    parse_second_tier,
)
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.local_master import mooncake_master


@pytest.fixture(scope="module")
def master():
    with mooncake_master() as m:
        yield m


def _config(master, **kw) -> SecondTierConfig:
    return SecondTierConfig("mooncake", master.master_server_address, master.metadata_server,
                            **kw)


def _one_line_naming(e: pytest.ExceptionInfo, key: str, value: int) -> None:
    msg = str(e.value)
    assert f"['second_tier'][{key!r}] = {value}" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("segment_bytes", [1 << 20, MIN_SEGMENT_BYTES - 1],
                         ids=["1MiB", "16MiB_less_1"])
def test_setup_refusing_a_segment_names_segment_bytes(master, segment_bytes):
    """Mooncake returns -600 for a segment it cannot allocate (under 16 MiB here; past what the
    host can map alike); kvtriton once read it as a bad master or metadata address."""
    config = _config(master, segment_bytes=segment_bytes)
    with pytest.raises(ValueError) as e:
        StoreClient(config, segment_bytes, FaultLog("test"))
    _one_line_naming(e, "segment_bytes", segment_bytes)
    assert "-600" in str(e.value)


def test_a_transfer_buffer_mooncake_cannot_allocate_names_local_buffer_bytes(master):
    """``std::bad_alloc`` reached the caller as a bare ``MemoryError``."""
    config = _config(master, local_buffer_bytes=2**62)
    with pytest.raises(ValueError) as e:
        StoreClient(config, 0, FaultLog("test"))
    _one_line_naming(e, "local_buffer_bytes", 2**62)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_master_at_a_bracketed_ipv6_address_is_reached_and_joined():
    """``[::1]:PORT`` was refused at start as unreachable (the brackets went to the socket)."""
    with mooncake_master(ipv6=True) as m:
        assert m.master_server_address.startswith("[::1]:")
        config = parse_second_tier({"kind": "mooncake",
                                    "master_server_address": m.master_server_address,
                                    "metadata_server": m.metadata_server})
        check_master_reachable(config, timeout_s=2.0)
        client = StoreClient(config, 0, FaultLog("test"))
        try:
            assert client.exists(["kvt-test/ipv6"]).tolist() == [False]
        finally:
            client.close()
