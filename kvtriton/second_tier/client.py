"""Mooncake Store's client, as the tier uses it: batched existence, put and get, every failure
a ``FaultLog`` kind rather than an exception, so a store that is down costs hits, never a
request."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtriton.second_tier.config import _PREFIX, SecondTierConfig
from kvtriton.second_tier.faults import FaultLog

__all__ = ["StoreClient", "fault_kind"]

#: Objects per batched call: Mooncake 0.3.13's TCP transport failed every transfer of a
#: 4,096-object batch here (2,048 passed), so larger batches go in slices of this many.
MAX_BATCH = 1024

# Mooncake's error codes (mooncake-store/include/types.h) the tier tells apart.
_OBJECT_NOT_FOUND = -704
_RPC_FAIL = -900


def fault_kind(rc: int) -> str:
    """The ``FaultLog`` kind of Mooncake's (negative) return code ``rc``."""
    if rc == _OBJECT_NOT_FOUND:
        return "missing"
    if rc == _RPC_FAIL:
        return "unreachable"
    return "error"


class StoreClient:
    """One ``MooncakeDistributedStore`` joined to the master of ``config``, contributing
    ``segment_bytes`` of this process's memory. ``ValueError`` naming ``second_tier`` when
    Mooncake is not installed or the client cannot join."""

    def __init__(self, config: SecondTierConfig, segment_bytes: int, faults: FaultLog) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ValueError(f"{_PREFIX} needs Mooncake Store's client: pip install "
                             "mooncake-transfer-engine (GPU hosts) or "
                             f"mooncake-transfer-engine-non-cuda ({e})") from None
        self.faults = faults
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(config.hostname, config.metadata_server, segment_bytes,
                               config.local_buffer_bytes, config.protocol, config.device_name,
                               config.master_server_address)
        if rc != 0:
            raise ValueError(f"{_PREFIX}: Mooncake's client could not join the master at "
                             f"{config.master_server_address!r} with metadata_server "
                             f"{config.metadata_server!r} (setup returned {rc}); check both "
                             "and local_hostname")

    def register(self, ptr: int, nbytes: int) -> None:
        """Register host memory that puts read from and gets write into."""
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer({nbytes} bytes) returned {rc}")

    def exists(self, names: Sequence[str]) -> np.ndarray | None:
        """Which of ``names`` the store holds (bool array), or None on a fault (counted)."""
        if not names:
            return np.zeros(0, dtype=bool)
        try:
            rcs = [rc for i in range(0, len(names), MAX_BATCH)
                   for rc in self._store.batch_is_exist(list(names[i:i + MAX_BATCH]))]
        except Exception as e:  # a binding error is a fault like any other
            self.faults.fault("error", detail=str(e))
            return None
        out = np.asarray(rcs, dtype=np.int64)
        if (out < 0).any():
            self.faults.fault(fault_kind(int(out[out < 0][0])))
            return None
        self.faults.ok()
        return out == 1

    def put(self, names: Sequence[str], buffers: Sequence[list[int]],
            sizes: Sequence[list[int]]) -> np.ndarray:
        """Put each object ``names[i]`` gathered from the registered ``buffers[i]`` (pointers)
        of ``sizes[i]`` bytes; which succeeded (bool array; failures counted)."""
        try:
            rcs = self._sliced(self._store.batch_put_from_multi_buffers, names, buffers, sizes)
        except Exception as e:
            self.faults.fault("error", len(names), str(e))
            return np.zeros(len(names), dtype=bool)
        return self._outcome(rcs, ok=lambda rc: rc == 0)

    def get(self, names: Sequence[str], buffers: Sequence[list[int]],
            sizes: Sequence[list[int]]) -> np.ndarray:
        """Read each object ``names[i]`` scattered into the registered ``buffers[i]``; the bytes
        each read returned (int64; negative: a fault, counted)."""
        try:
            rcs = self._sliced(self._store.batch_get_into_multi_buffers, names, buffers, sizes)
        except Exception as e:
            self.faults.fault("error", len(names), str(e))
            return np.full(len(names), -1, dtype=np.int64)
        out = np.asarray(rcs, dtype=np.int64)
        self._outcome(rcs, ok=lambda rc: rc >= 0)
        return out

    @staticmethod
    def _sliced(call, names, buffers, sizes) -> list[int]:
        out: list[int] = []
        for i in range(0, len(names), MAX_BATCH):
            j = i + MAX_BATCH
            out += call(list(names[i:j]), list(buffers[i:j]), list(sizes[i:j]))
        return out

    def _outcome(self, rcs: Sequence[int], ok) -> np.ndarray:
        good = np.fromiter((ok(rc) for rc in rcs), dtype=bool, count=len(rcs))
        for rc in (rc for rc, g in zip(rcs, good, strict=True) if not g):
            self.faults.fault(fault_kind(int(rc)))
        if good.any():
            self.faults.ok()
        return good

    def close(self) -> None:
        self._store.close()
