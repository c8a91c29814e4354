"""A real ``mooncake_master`` on loopback for tests: started on free ports with its built-in HTTP
metadata server (no etcd), waited for, and stopped; and a client joined to it over TCP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@dataclass(frozen=True)
class Master:
    """Where a running master listens: ``master_server_address`` and ``metadata_server`` in
    Mooncake's own names."""

    port: int
    metadata_port: int
    process: subprocess.Popen

    @property
    def master_server_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"


@contextmanager
def mooncake_master(timeout_s: float = 20.0) -> Iterator[Master]:
    """Start ``mooncake_master`` (the venv's, beside this interpreter) on two free loopback
    ports; yield it once both accept connections; terminate it on exit."""
    exe = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    port, meta = _free_port(), _free_port()
    proc = subprocess.Popen([exe, f"--port={port}", "--enable_http_metadata_server=true",
                             "--http_metadata_server_host=127.0.0.1",
                             f"--http_metadata_server_port={meta}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not (_listening(port) and _listening(meta)):
            if proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {proc.returncode} at start")
            if time.monotonic() > deadline:
                raise TimeoutError(f"mooncake_master did not listen on {port}/{meta} in "
                                   f"{timeout_s:g} s")
            time.sleep(0.05)
        yield Master(port, meta, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


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
