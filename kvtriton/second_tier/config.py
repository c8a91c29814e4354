"""The ``"second_tier"`` object of ``kv_connector_extra_config``, in Mooncake Store's own names.

Example (a master on ``store-host``, this replica contributing 4 GiB to the store)::

    {"kind": "mooncake", "master_server_address": "store-host:50051",
     "metadata_server": "http://store-host:8080/metadata", "protocol": "tcp",
     "segment_bytes": 4294967296}

Keys (``kind``, ``master_server_address`` and ``metadata_server`` are required):

- ``kind``: ``"mooncake"``, the one store kind;
- ``master_server_address``: ``HOST:PORT`` of ``mooncake_master`` (an IPv6 address in brackets,
  ``[::1]:50051``; the master then listens there with ``--rpc_address=::``);
- ``metadata_server``: the transfer engine's metadata service: ``http://HOST:PORT/metadata``
  (the master's built-in one with ``--enable_http_metadata_server=true``),
  ``etcd://HOST:PORT`` (more endpoints after ``;``), ``redis://HOST:PORT`` or ``P2PHANDSHAKE``;
- ``protocol``: ``"tcp"`` (default) or ``"rdma"``;
- ``device_name``: the RDMA device(s) for ``"rdma"`` (Mooncake's ``device_name``; default ``""``);
- ``local_hostname``: the address other hosts reach this replica's transfer engine at (default:
  ``127.0.0.1`` when the master is on loopback, else this host's name);
- ``segment_bytes``: memory each worker of this replica contributes to the store, bytes
  (Mooncake's ``global_segment_size``): 0 (the default: the replica only uses memory that store
  hosts, ``mooncake_client``, or other replicas contribute) or from Mooncake's minimum, 16 MiB,
  up to this host's memory;
- ``local_buffer_bytes``: the client's transfer buffer, bytes (Mooncake's
  ``local_buffer_size``; default 16 MiB), from 1 up to this host's memory;
- ``fetch_timeout_s``: how long a request waits for its blocks from the store before it runs
  without them (default 5.0, at most ``MAX_FETCH_TIMEOUT_S``; the fetch still completes into
  the CPU tier).

Every check raises ``ValueError`` naming the key and the value, at engine start: the sizes are
bounded here because past the bounds Mooncake's ``setup`` fails without naming them (a
``TypeError`` past 2^64, ``MemoryError`` for a buffer larger than the host, -600 for a segment
under 16 MiB or larger than the host can map).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtriton.validation import host_memory_bytes, is_finite_number, is_int

__all__ = ["MAX_FETCH_TIMEOUT_S", "MIN_SEGMENT_BYTES", "SecondTierConfig", "host_memory_bytes",
           "parse_second_tier"]

_PREFIX = "KVTritonConnector: kv_connector_extra_config['second_tier']"
_KINDS = ("mooncake",)
_PROTOCOLS = ("tcp", "rdma")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: Mooncake's smallest segment (``client_buffer_allocation.cpp``: "Total size must be at least
#: 16777216"; ``setup`` returns -600 below it).
MIN_SEGMENT_BYTES = 16 << 20
#: The longest a request may wait for its blocks from the store (ten minutes, far past the time
#: any prefix takes to recompute): a larger value is a slip (1e300 passed, and meant never).
MAX_FETCH_TIMEOUT_S = 600.0
# A host name or IPv4 address: ASCII labels (no space, no other script's letters or digits).
_HOSTNAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?")
_PORT = re.compile(r"[0-9]{1,5}")


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
        """The master's host (an IPv6 address without its brackets) and port."""
        host, port = _split_host_port(self.master_server_address)
        return host.strip("[]"), int(port)

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


def _split_host_port(text: str) -> tuple[str, str]:
    """``HOST:PORT`` or ``[IPV6]:PORT`` as (host, port), the brackets kept; ("", "") when it is
    neither (an IPv6 address without brackets among them)."""
    if text.startswith("["):
        host, sep, port = text.partition("]:")
        return (host + "]", port) if sep else ("", "")
    host, sep, port = text.rpartition(":")
    return (host, port) if sep and ":" not in host else ("", "")


def _host_ok(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return _HOSTNAME.fullmatch(host) is not None


def _host_port_ok(text: str) -> bool:
    host, port = _split_host_port(text)
    return (_host_ok(host) and _PORT.fullmatch(port) is not None
            and 0 < int(port) < 65536)


def _check_address(value: Any) -> None:
    if not isinstance(value, str) or not _host_port_ok(value):
        raise _bad("master_server_address", value, "'HOST:PORT' (an IPv6 address in brackets, "
                                                   "'[::1]:50051') with a port in 1..65535")


def _metadata_ok(value: str) -> bool:
    if value == "P2PHANDSHAKE":
        return True
    scheme, sep, rest = value.partition("://")
    if not sep:
        return False
    if scheme in ("http", "https"):
        netloc, slash, _ = rest.partition("/")
        if not slash or not value.isascii() or any(c.isspace() for c in value):
            return False
        if not _split_host_port(netloc)[0]:  # no port: the scheme's own
            return _host_ok(netloc)
        return _host_port_ok(netloc)
    if scheme == "etcd":
        return all(_host_port_ok(e) for e in rest.split(";"))
    if scheme == "redis":
        return _host_port_ok(rest)
    return False


def _check_metadata(value: Any) -> None:
    if not isinstance(value, str) or not _metadata_ok(value):
        raise _bad("metadata_server", value, "'http://HOST:PORT/metadata', 'etcd://HOST:PORT', "
                                             "'redis://HOST:PORT' or 'P2PHANDSHAKE'")


def _check_bytes(key: str, value: Any, least: int, host_bytes: int) -> None:
    """``value`` in ``[least, host_bytes]`` (0 too for ``segment_bytes``)."""
    if key == "segment_bytes" and is_int(value) and value == 0:
        return
    if not is_int(value) or not least <= value <= host_bytes:
        zero = "0 or " if key == "segment_bytes" else ""
        least_said = (f"{least} (Mooncake's smallest segment, 16 MiB)" if least > 1
                      else str(least))
        raise _bad(key, value, f"{zero}an int of bytes from {least_said} up to this host's "
                               f"memory, {host_bytes} ({host_bytes / 2**30:.1f} GiB)")


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
        if key == "segment_bytes":
            _check_bytes(key, v, MIN_SEGMENT_BYTES, host_memory_bytes())
        if key == "local_buffer_bytes":
            _check_bytes(key, v, 1, host_memory_bytes())
        if key == "fetch_timeout_s" and (not is_finite_number(v)
                                         or not 0 < v <= MAX_FETCH_TIMEOUT_S):
            raise _bad(key, v, f"a number of seconds above 0, at most {MAX_FETCH_TIMEOUT_S:g}")
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
