"""Mooncake Store's put and get on loopback TCP, beside a memcpy of the same bytes in the same
run: 2 MiB blocks (a Llama-3-8B KV block of 16 tokens) and 4-64 KiB pieces (one layer's share of
a block), one object per call and batched (``client.MAX_BATCH`` objects per call); then the
tier's own write-through and fetch (``StoreIO``: header, checksum and verification included) beside
the raw client's batched calls for the same blocks."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvtriton.second_tier.client import MAX_BATCH, StoreClient
from kvtriton.second_tier.config import parse_second_tier
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.local_master import join
from kvtriton.second_tier.worker_io import StoreIO

SIZES = (4 << 10, 16 << 10, 64 << 10, 2 << 20)


def _best(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls, seconds (the least disturbed by other work)."""
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def _alternating(a, b, repeats: int, before=None) -> tuple[list[float], list[float]]:
    """Seconds of ``repeats`` timed calls of ``a`` and of ``b``, called in turn (pair ``i`` is
    ``a``'s ``i``-th and ``b``'s ``i``-th); ``before()``, untimed, before each pair."""
    out: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        if before is not None:
            before()
        for times, fn in zip(out, (a, b), strict=True):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return out


def raw_rows(master, total_bytes: int, repeats: int) -> list[dict]:
    """Per object size: put and get GB/s, batched and one object per call, and memcpy GB/s of
    the same bytes; ``total_bytes`` moved per measurement."""
    client = join(master, segment_bytes=0, buffer_bytes=16 << 20)
    try:
        return [_raw_row(client, size, max(1, total_bytes // size), repeats) for size in SIZES]
    finally:
        client.close()


def _raw_row(client, size: int, n: int, repeats: int) -> dict:
    src = torch.randint(0, 256, (n, size), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    for t in (src, dst):
        client.register_buffer(t.data_ptr(), t.numel())
    ptrs = [src[i].data_ptr() for i in range(n)]
    dptrs = [dst[i].data_ptr() for i in range(n)]
    tag = [0]

    def names() -> list[str]:
        return [f"bench/{size}/{tag[0]}/{i}" for i in range(n)]

    def put_batched():
        tag[0] += 1
        keys = names()
        for i in range(0, n, MAX_BATCH):
            j = i + MAX_BATCH
            assert all(rc == 0 for rc in client.batch_put_from(keys[i:j], ptrs[i:j],
                                                               [size] * len(keys[i:j])))

    def put_single():
        tag[0] += 1
        for name, p in zip(names(), ptrs, strict=True):
            assert client.put_from(name, p, size) == 0

    nbytes = n * size
    row = {"object_bytes": size, "objects": n, "bytes": nbytes,
           "put_batched_gb_s": nbytes / _best(put_batched, repeats) / 1e9,
           "put_single_gb_s": nbytes / _best(put_single, repeats) / 1e9}
    keys = names()

    def get_batched():
        for i in range(0, n, MAX_BATCH):
            j = i + MAX_BATCH
            assert all(rc == size for rc in client.batch_get_into(keys[i:j], dptrs[i:j],
                                                                  [size] * len(keys[i:j])))

    def get_single():
        for name, p in zip(keys, dptrs, strict=True):
            assert client.get_into(name, p, size) == size

    row["get_batched_gb_s"] = nbytes / _best(get_batched, repeats) / 1e9
    row["get_single_gb_s"] = nbytes / _best(get_single, repeats) / 1e9
    assert torch.equal(src, dst)
    row["memcpy_gb_s"] = nbytes / _best(lambda: dst.copy_(src), repeats) / 1e9
    client.remove_all(True)
    return row


def tier_rows(master, blocks: int, block_bytes: int, repeats: int) -> dict:
    """The tier's write-through and fetch of ``blocks`` blocks beside the raw client's batched
    put and get of the same blocks (same sizes, same memory)."""
    config = parse_second_tier({"kind": "mooncake",
                                "master_server_address": master.master_server_address,
                                "metadata_server": master.metadata_server})
    pool = np.random.default_rng(0).integers(0, 256, (2 * blocks + 1, block_bytes),
                                             dtype=np.uint8)
    io = StoreIO(StoreClient(config, 0, FaultLog("bench")), "bench0000000000", pool,
                 [block_bytes], background=False)
    raw = join(master, segment_bytes=0, buffer_bytes=16 << 20)
    raw.register_buffer(pool.ctypes.data, pool.nbytes)
    src = list(range(1, blocks + 1))
    dst = list(range(blocks + 1, 2 * blocks + 1))
    row_ptr = [pool.ctypes.data + b * pool.strides[0] for b in range(len(pool))]
    tag = [0]
    try:
        def hashes() -> list[bytes]:
            return [tag[0].to_bytes(4, "big") + i.to_bytes(4, "big") for i in range(blocks)]

        put_blocks = [0]
        last: list[bytes] = []

        def tier_put():
            tag[0] += 1
            last[:] = hashes()
            io.put(src, [0] * blocks, last)
            put_blocks[0] += blocks
            assert io.stats["second_tier_put_blocks"] == put_blocks[0]

        def raw_put():
            tag[0] += 1
            names = [f"raw/{tag[0]}/{i}" for i in range(blocks)]
            assert all(rc == 0 for rc in raw.batch_put_from(names, [row_ptr[b] for b in src],
                                                            [block_bytes] * blocks))

        # Alternating, so that the machine's slow moments fall on both alike.
        # Each pair of puts starts on an empty store: a full one evicts as it puts.
        put_s, raw_put_s = _alternating(tier_put, raw_put, repeats,
                                        before=lambda: raw.remove_all(True))
        names = [f"raw/{tag[0]}/{i}" for i in range(blocks)]

        def tier_fetch():
            io.fetch(0, dst, [0] * blocks, last)
            assert io.take_results() == {0: []}

        def raw_get():
            got = raw.batch_get_into(names, [row_ptr[b] for b in dst], [block_bytes] * blocks)
            assert all(rc == block_bytes for rc in got)

        fetch_s, raw_get_s = _alternating(tier_fetch, raw_get, repeats)
        tier_fetch()
        assert np.array_equal(pool[dst], pool[src])
    finally:
        io.close()
        raw.close()
    nbytes = blocks * block_bytes
    out = {"blocks": blocks, "block_bytes": block_bytes,
           "tier_put_gb_s": nbytes / min(put_s) / 1e9,
           "tier_fetch_gb_s": nbytes / min(fetch_s) / 1e9,
           "raw_put_gb_s": nbytes / min(raw_put_s) / 1e9,
           "raw_get_gb_s": nbytes / min(raw_get_s) / 1e9,
           "seconds": {"tier_put": put_s, "raw_put": raw_put_s, "tier_fetch": fetch_s,
                       "raw_get": raw_get_s}}
    # The share of each pair (the tier's call and the raw call beside it), their median: one
    # run's best-of figures moved by up to 15% apart on this 2-core machine.
    out["put_share"] = float(np.median(np.divide(raw_put_s, put_s)))
    out["fetch_share"] = float(np.median(np.divide(raw_get_s, fetch_s)))
    return out
