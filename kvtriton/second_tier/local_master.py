"""A ``mooncake_master`` on this machine's loopback, for tests, benchmarks and experiments:
started on free ports with its built-in HTTP metadata server (no etcd), waited for, stopped;
and a client joined to it over TCP (a store host, when it contributes memory)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Master:
    """A ``mooncake_master`` on two loopback ports: where it listens, in Mooncake's own names
    (``master_server_address``, ``metadata_server``), and ``kill``/``start`` to take it down
    and bring it back on the same ports (what a restarted master looks like to its clients)."""

    def __init__(self, timeout_s: float = 20.0, *, ipv6: bool = False) -> None:
        # The metrics port too: its default (9003) is one per machine, and a second master
        # there (a test beside a benchmark, two test workers) exits at start.
        self.port, self.metadata_port, self.metrics_port = free_port(), free_port(), free_port()
        self.timeout_s = timeout_s
        self.ipv6 = ipv6  # the RPC port on every address, IPv6 too, named by [::1]
        self.process: subprocess.Popen | None = None

    @property
    def master_server_address(self) -> str:
        return f"[::1]:{self.port}" if self.ipv6 else f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def start(self) -> None:
        """Start it and return once both ports accept connections."""
        exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        self.process = subprocess.Popen(
            [exe, f"--port={self.port}", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={self.metadata_port}",
             f"--metrics_port={self.metrics_port}", *(["--rpc_address=::"] * self.ipv6)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.timeout_s
        while not (_listening(self.port) and _listening(self.metadata_port)):
            if self.process.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.process.returncode} "
                                   "at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master did not listen on {self.port}/"
                                   f"{self.metadata_port} in {self.timeout_s:g} s")
            time.sleep(0.05)

    def kill(self) -> None:
        """Stop it at once (SIGKILL), as a crash would."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextmanager
def mooncake_master(timeout_s: float = 20.0, *, ipv6: bool = False) -> Iterator[Master]:
    """Start ``mooncake_master`` (the venv's, beside this interpreter) on two free loopback
    ports (``ipv6``: its RPC port reached at ``[::1]``); yield it once both accept
    connections; stop it on exit."""
    master = Master(timeout_s, ipv6=ipv6)
    try:
        master.start()
        yield master
    finally:
        master.stop()


def join(master: Master, segment_bytes: int, buffer_bytes: int):
    """A ``MooncakeDistributedStore`` client on loopback TCP that contributes ``segment_bytes``
    of its memory to the store; raises if ``setup`` fails."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", master.metadata_server, segment_bytes, buffer_bytes, "tcp", "",
                     master.master_server_address)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store
