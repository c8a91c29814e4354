"""The ``"second_tier"`` object of ``kv_connector_extra_config``, in Mooncake Store's own names.

Example (a master on ``store-host``, this replica contributing 4 GiB to the store)::

    {"kind": "mooncake", "master_server_address": "store-host:50051",
     "metadata_server": "http://store-host:8080/metadata", "protocol": "tcp",
     "segment_bytes": 4294967296}

Keys (``kind``, ``master_server_address`` and ``metadata_server`` are required):

- ``kind``: ``"mooncake"``, the one store kind;
- ``master_server_address``: ``HOST:PORT`` of ``mooncake_master``;
- ``metadata_server``: the transfer engine's metadata service: ``http://HOST:PORT/metadata``
  (the master's built-in one with ``--enable_http_metadata_server=true``), ``etcd://...`` or
  ``P2PHANDSHAKE``;
- ``protocol``: ``"tcp"`` (default) or ``"rdma"``;
- ``device_name``: the RDMA device(s) for ``"rdma"`` (Mooncake's ``device_name``; default ``""``);
- ``local_hostname``: the address other hosts reach this replica's transfer engine at (default:
  ``127.0.0.1`` when the master is on loopback, else this host's name);
- ``segment_bytes``: memory each worker of this replica contributes to the store, bytes
  (Mooncake's ``global_segment_size``; default 0: the replica only uses memory that store hosts,
  ``mooncake_client``, or other replicas contribute);
- ``local_buffer_bytes``: the client's transfer buffer, bytes (Mooncake's
  ``local_buffer_size``; default 16 MiB);
- ``fetch_timeout_s``: how long a request waits for its blocks from the store before it runs
  without them (default 5.0; the fetch still completes into the CPU tier).

Every check raises ``ValueError`` naming the key and the value, at engine start.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtriton.validation import is_int

__all__ = ["SecondTierConfig", "parse_second_tier"]

_PREFIX = "KVTritonConnector: kv_connector_extra_config['second_tier']"
_KINDS = ("mooncake",)
_PROTOCOLS = ("tcp", "rdma")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class SecondTierConfig:
    """The checked ``second_tier`` settings (the module docstring says what each is)."""

    kind: str
    master_server_address: str
    metadata_server: str
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = ""
    segment_bytes: int = 0
    local_buffer_bytes: int = 16 << 20
    fetch_timeout_s: float = 5.0

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master_server_address.rpartition(":")
        return host, int(port)

    @property
    def hostname(self) -> str:
        """``local_hostname``, or its default."""
        if self.local_hostname:
            return self.local_hostname
        return "127.0.0.1" if self.master_host_port[0] in _LOOPBACK else socket.gethostname()

    def describe(self) -> str:
        return (f"second tier: Mooncake Store at {self.master_server_address} over "
                f"{self.protocol}, {self.segment_bytes / 2**30:.2f} GiB contributed per worker")


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_PREFIX}[{key!r}] = {value!r} is not allowed; expected {allowed}")


def _check_address(value: Any) -> None:
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise _bad("master_server_address", value, "'HOST:PORT' with a port in 1..65535")


def _check_metadata(value: Any) -> None:
    ok = isinstance(value, str) and (
        value == "P2PHANDSHAKE"
        or (value.startswith(("http://", "https://")) and len(value.split("/", 3)) == 4)
        or value.startswith("etcd://") or value.startswith("redis://"))
    if not ok:
        raise _bad("metadata_server", value, "'http://HOST:PORT/metadata', 'etcd://HOST:PORT', "
                                             "'redis://HOST:PORT' or 'P2PHANDSHAKE'")


def parse_second_tier(value: Any) -> SecondTierConfig | None:
    """The checked settings of ``value`` (None: no second tier); ``ValueError`` naming the first
    unknown key, missing key or bad value."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{_PREFIX} must be an object such as {{\"kind\": \"mooncake\", "
                         f"\"master_server_address\": \"HOST:PORT\", ...}}, got "
                         f"{type(value).__name__} {value!r:.80}")
    known = SecondTierConfig.__dataclass_fields__
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ValueError(f"{_PREFIX}: unknown key {unknown[0]!r}; known keys: "
                         f"{', '.join(known)}")
    for key in ("kind", "master_server_address", "metadata_server"):
        if key not in value:
            raise ValueError(f"{_PREFIX}: the key {key!r} is required")
    if value["kind"] not in _KINDS:
        raise _bad("kind", value["kind"], " or ".join(map(repr, _KINDS)))
    _check_address(value["master_server_address"])
    _check_metadata(value["metadata_server"])
    for key, v in value.items():
        if key == "protocol" and v not in _PROTOCOLS:
            raise _bad(key, v, " or ".join(map(repr, _PROTOCOLS)))
        if key in ("device_name", "local_hostname") and not isinstance(v, str):
            raise _bad(key, v, "a string")
        if key == "segment_bytes" and (not is_int(v) or v < 0):
            raise _bad(key, v, "a non-negative int (bytes)")
        if key == "local_buffer_bytes" and (not is_int(v) or v <= 0):
            raise _bad(key, v, "a positive int (bytes)")
        if key == "fetch_timeout_s" and (isinstance(v, bool) or not isinstance(v, int | float)
                                         or not math.isfinite(v) or v <= 0):
            raise _bad(key, v, "a positive number of seconds")
    if value.get("protocol") == "rdma" and not value.get("device_name"):
        raise ValueError(f"{_PREFIX}['device_name'] is required with protocol 'rdma' (the RDMA "
                         "device, e.g. 'mlx5_0')")
    return SecondTierConfig(**dict(value))


def check_master_reachable(config: SecondTierConfig, timeout_s: float = 3.0) -> None:
    """``ValueError`` naming ``master_server_address`` when nothing accepts a TCP connection
    there: at engine start, before Mooncake's client retries in its own log."""
    host, port = config.master_host_port
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"{_PREFIX}['master_server_address'] = "
                         f"{config.master_server_address!r}: no mooncake_master answers there "
                         f"({e.strerror or e}); start one (mooncake_master --port={port} "
                         "--enable_http_metadata_server=true) or fix the address") from None
