"""A worker's store traffic (``StoreIO``) against a real ``mooncake_master`` on loopback: blocks
written through by one replica's pool come back bit-exact into another's, the rest of the
destination untouched; a block already stored is not sent again; a corrupted object, a missing
one and a dead master are each a counted fault that never passes for data, and the store is
used again once its master is back."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvtriton.second_tier.client import StoreClient
from kvtriton.second_tier.config import parse_second_tier
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.local_master import join, mooncake_master
from kvtriton.second_tier.naming import object_names
from kvtriton.second_tier.objects import HEADER_BYTES
from kvtriton.second_tier.worker_io import StoreIO

ROW = 64 << 10
GROUP_BYTES = (ROW, ROW // 2)  # group 1 fills half a row
FP = "0123456789abcdef"


@pytest.fixture
def master():
    with mooncake_master() as m:
        holder = join(m, segment_bytes=64 << 20, buffer_bytes=4 << 20)  # a store host
        yield m
        holder.close()


def _io(master, seed: int, *, background: bool = True) -> StoreIO:
    config = parse_second_tier({"kind": "mooncake",
                                "master_server_address": master.master_server_address,
                                "metadata_server": master.metadata_server})
    pool = np.random.default_rng(seed).integers(0, 256, (16, ROW), dtype=np.uint8)
    return StoreIO(StoreClient(config, 0, FaultLog(f"test {seed}")), FP, pool, GROUP_BYTES,
                   background=background)


def _hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 18 for i in range(n)]


def test_blocks_come_back_bit_exact_into_another_replicas_pool(master):
    a, b = _io(master, 1), _io(master, 2)
    try:
        cpu, groups, hashes = [3, 5, 7, 9], [0, 1, 0, 1], _hashes(4)
        a.put(cpu, groups, hashes)
        assert a.drain() and a.stats["second_tier_put_blocks"] == 4
        before = b._pool.copy()
        b.fetch(0, [1, 2, 4, 6], groups, hashes)
        assert b.drain() and b.take_results() == {0: []}
        expect = before.copy()
        for src, dst, g in zip(cpu, [1, 2, 4, 6], groups, strict=True):
            n = GROUP_BYTES[g]
            expect[dst, :n] = a._pool[src, :n]
        assert np.array_equal(b._pool, expect)  # the whole destination, nothing else written
        # Negative control: the comparison sees one byte that did not come back.
        expect[1, 100] ^= 0xFF
        assert not np.array_equal(b._pool, expect)
        # Stored already (by a): not sent again.
        b.put([1, 2], [0, 1], hashes[:2])
        assert b.drain() and b.stats["second_tier_put_skipped"] == 2
        assert b.stats["second_tier_puts"] == 0
    finally:
        a.close()
        b.close()


def test_a_corrupted_object_under_a_real_name_is_caught(master):
    a, b = _io(master, 3), _io(master, 4)
    try:
        a.put([1, 2], [0, 0], _hashes(2, salt=9))
        assert a.drain()
        name = object_names(FP, _hashes(2, salt=9))[1]
        # Plant the same header over a payload with one byte flipped, under the real name.
        header = a._headers[2].copy()
        payload = a._pool[2, :ROW].copy()
        payload[ROW // 3] ^= 0x01
        raw = join(master, segment_bytes=0, buffer_bytes=4 << 20)
        try:
            assert raw.remove(name) == 0
            assert raw.put(name, header.tobytes() + payload.tobytes()) == 0
        finally:
            raw.close()
        b.fetch(7, [5, 6], [0, 0], _hashes(2, salt=9))
        assert b.drain() and b.take_results() == {7: [1]}
        assert b.faults.counts["corrupt"] == 1 and b.stats["second_tier_fetch_blocks"] == 1
        assert np.array_equal(b._pool[5], a._pool[1])  # the good one came through
    finally:
        a.close()
        b.close()


def test_missing_objects_and_a_dead_master_are_faults_then_the_store_is_back(master):
    a = _io(master, 5, background=False)
    try:
        a.fetch(1, [1], [0], _hashes(1, salt=7))  # never put
        assert a.take_results() == {1: [0]} and a.faults.counts["missing"] == 1
        master.kill()
        a.put([2, 3], [0, 0], _hashes(2, salt=8))  # no exception: counted
        a.fetch(2, [4], [0], _hashes(1, salt=8))
        assert a.take_results() == {2: [0]}
        assert a.faults.counts["unreachable"] >= 2 and a.stats["second_tier_put_blocks"] == 0
        master.start()  # same ports: the clients find it again by themselves, and the store
        # host mounts its memory again after its pings fail (a few seconds): until then a put
        # has nowhere to go, and fails as a counted fault.
        deadline = time.monotonic() + 60
        while a.stats["second_tier_put_blocks"] < 2 and time.monotonic() < deadline:
            a.put([2, 3], [0, 0], _hashes(2, salt=8))
            time.sleep(0.5)
        assert a.stats["second_tier_put_blocks"] == 2
        a.fetch(3, [4, 5], [0, 0], _hashes(2, salt=8))
        assert a.take_results() == {3: []}
        assert np.array_equal(a._pool[4:6], a._pool[2:4])
    finally:
        a.close()


def test_a_store_copy_waits_for_the_puts_that_read_its_blocks(master):
    a = _io(master, 6)
    try:
        a.put(list(range(1, 16)), [0] * 15, _hashes(15, salt=1))
        a.wait_unread([3])
        assert not a._reading.get(3)  # its put ran: the block may be overwritten now
        assert a.drain() and a.stats["second_tier_put_blocks"] == 15
    finally:
        a.close()


def test_headers_travel_with_the_payload(master):
    a = _io(master, 8, background=False)
    try:
        a.put([1], [1], _hashes(1, salt=3))
        raw = join(master, segment_bytes=0, buffer_bytes=4 << 20)
        try:
            got = raw.get(object_names(FP, _hashes(1, salt=3))[0])
        finally:
            raw.close()
        assert len(got) == HEADER_BYTES + GROUP_BYTES[1]
        assert got[HEADER_BYTES:] == a._pool[1, :GROUP_BYTES[1]].tobytes()
    finally:
        a.close()
