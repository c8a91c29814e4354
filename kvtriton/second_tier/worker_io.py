"""A worker's traffic with the store, on one background thread: write-through puts of the blocks
the CPU tier stored, and fetches of store blocks into the CPU tier's pool.

Jobs run in the order they were queued. A put reads its CPU blocks after their store copy
completed; the scheduler may evict such a block and hand it to a later store, so before a store
copy writes CPU blocks the worker waits until no queued put still reads them
(``wait_unread``). A fetch writes blocks the scheduler allocated to it alone, and reports which
of them failed (missing, short, corrupt, store down): those are never cached, so never loaded.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtriton.second_tier.client import StoreClient
from kvtriton.second_tier.naming import object_names
from kvtriton.second_tier.objects import HEADER_BYTES, check, checksums, write_header

__all__ = ["StoreIO"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    kind: str  # "put" or "fetch"
    event: int  # the fetch's event (-1 for a put)
    cpu: np.ndarray
    groups: np.ndarray
    hashes: list[bytes]


class StoreIO:
    """The store traffic of one worker: ``pool`` is its CPU tier (``[num_blocks, row_bytes]``
    uint8, a block's group ``g`` payload its first ``group_bytes[g]`` bytes), ``fp`` its rank's
    fingerprint (``naming``). ``background=False`` runs every job in the caller's thread as it
    is queued, as the CPU platform runs its copies: there the model's OpenMP threads hold every
    core between steps, and a background thread waited seconds for its turn (measured in
    vLLM's CPU engine on 2 cores: a 9-block fetch took 2 to 4 s in a thread, 10 ms inline)."""

    def __init__(self, client: StoreClient, fp: str, pool, group_bytes: Sequence[int], *,
                 background: bool = True) -> None:
        self.client = client
        self.faults = client.faults
        self.fp = fp
        self._pool = pool.numpy() if hasattr(pool, "numpy") else pool
        self._group_bytes = np.asarray(group_bytes, dtype=np.int64)
        n = self._pool.shape[0]
        self._headers = np.zeros((n, HEADER_BYTES), dtype=np.uint8)
        client.register(self._pool.ctypes.data, self._pool.nbytes)
        client.register(self._headers.ctypes.data, self._headers.nbytes)
        self._row = self._pool.strides[0]
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._cond = threading.Condition()
        self._reading: Counter[int] = Counter()
        self._results: dict[int, list[int]] = {}
        self.stats: dict[str, int | float] = {
            f"second_tier_{k}": 0 for k in ("puts", "put_blocks", "put_bytes", "put_skipped",
                                            "put_already_present", "fetches", "fetch_blocks",
                                            "fetch_bytes", "fetch_failed")}
        self.stats.update(second_tier_put_s=0.0, second_tier_fetch_s=0.0)
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="kvtriton-store-io",
                                            daemon=True)
            self._thread.start()

    # ---- called by the worker ----------------------------------------------------------------

    def put(self, cpu: Sequence[int], groups: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Queue the write-through of CPU blocks ``cpu`` (their store copy has completed)."""
        if not len(cpu):
            return
        cpu = np.asarray(cpu, dtype=np.int64)
        with self._cond:
            self._reading.update(cpu.tolist())
        self._queue(_Job("put", -1, cpu, np.asarray(groups, dtype=np.int64), list(hashes)))

    def fetch(self, event: int, cpu: Sequence[int], groups: Sequence[int],
              hashes: Sequence[bytes]) -> None:
        """Queue the read of the objects of ``hashes`` into CPU blocks ``cpu``."""
        self._queue(_Job("fetch", event, np.asarray(cpu, dtype=np.int64),
                         np.asarray(groups, dtype=np.int64), list(hashes)))

    def _queue(self, job: _Job) -> None:
        self._jobs.put(job)
        if self._thread is None:
            self._run_one(self._jobs.get())

    def wait_unread(self, cpu: Sequence[int]) -> None:
        """Return once no queued put reads any of CPU blocks ``cpu``."""
        with self._cond:
            if not self._reading:
                return
            blocks = set(map(int, cpu))
            self._cond.wait_for(lambda: not blocks.intersection(self._reading))

    def take_results(self) -> dict[int, list[int]]:
        """Fetch events completed since the last call -> the indices of their failed blocks."""
        with self._cond:
            out, self._results = self._results, {}
        return out

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued job ran; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self) -> None:
        self.drain()
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
        self.client.close()

    # ---- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run_one(job)
        self._jobs.task_done()

    def _run_one(self, job: _Job) -> None:
        try:
            if job.kind == "put":
                self._put(job)
            else:
                self._fetch(job)
        except Exception:  # the thread must outlive any one job
            logger.exception("KVTritonConnector: a second tier %s failed", job.kind)
            if job.kind == "fetch":
                with self._cond:
                    self._results[job.event] = list(range(len(job.cpu)))
        finally:
            if job.kind == "put":
                with self._cond:
                    self._reading.subtract(job.cpu.tolist())
                    self._reading += Counter()  # drop the zeros
                    self._cond.notify_all()
            self._jobs.task_done()

    def _buffers(self, cpu: np.ndarray, groups: np.ndarray) -> tuple[list, list]:
        base, hbase = self._pool.ctypes.data, self._headers.ctypes.data
        sizes = self._group_bytes[groups].tolist()
        ptrs = [[hbase + b * HEADER_BYTES, base + b * self._row] for b in cpu.tolist()]
        return ptrs, [[HEADER_BYTES, s] for s in sizes]

    def _put(self, job: _Job) -> None:
        t0 = time.perf_counter()
        names = object_names(self.fp, job.hashes)
        present = self.client.exists(names)
        if present is None:  # the store is down: nothing to put into (counted)
            return
        todo = np.flatnonzero(~present)
        self.stats["second_tier_put_skipped"] += len(names) - len(todo)
        if not len(todo):
            return
        cpu, groups = job.cpu[todo], job.groups[todo]
        names = [names[i] for i in todo.tolist()]
        payloads = [self._pool[b, :self._group_bytes[g]]
                    for b, g in zip(cpu.tolist(), groups.tolist(), strict=True)]
        for b, name, p, x in zip(cpu.tolist(), names, payloads, checksums(payloads),
                                 strict=True):
            write_header(self._headers[b], name, p, x)
        ptrs, sizes = self._buffers(cpu, groups)
        ok, present = self.client.put(names, ptrs, sizes)
        self.stats["second_tier_puts"] += 1
        # Absent at the query, then written first by another writer: theirs is kept.
        self.stats["second_tier_put_already_present"] += int(present.sum())
        self.stats["second_tier_put_blocks"] += int(ok.sum())
        self.stats["second_tier_put_bytes"] += int(self._group_bytes[groups][ok].sum())
        self.stats["second_tier_put_s"] += time.perf_counter() - t0

    def _fetch(self, job: _Job) -> None:
        t0 = time.perf_counter()
        names = object_names(self.fp, job.hashes)
        ptrs, sizes = self._buffers(job.cpu, job.groups)
        nread = self.client.get(names, ptrs, sizes)
        bad = np.flatnonzero(nread < 0).tolist()  # the client counted their faults
        read = np.flatnonzero(nread >= 0).tolist()
        cpu, groups = job.cpu.tolist(), job.groups.tolist()
        payloads = [self._pool[cpu[i], :self._group_bytes[groups[i]]] for i in read]
        for i, p, x in zip(read, payloads, checksums(payloads), strict=True):
            name = names[i]
            why = check(self._headers[cpu[i]], name, p, int(nread[i]), x)
            if why is not None:
                self.faults.fault(why, detail=f"object {name}")
                bad.append(i)
        bad.sort()
        self.stats["second_tier_fetches"] += 1
        good = len(job.cpu) - len(bad)
        self.stats["second_tier_fetch_blocks"] += good
        self.stats["second_tier_fetch_failed"] += len(bad)
        self.stats["second_tier_fetch_bytes"] += int(np.delete(self._group_bytes[job.groups],
                                                         bad).sum())
        self.stats["second_tier_fetch_s"] += time.perf_counter() - t0
        with self._cond:
            self._results[job.event] = bad
