"""Mooncake Store as the second tier will use it (issue 38), against its real master on
loopback TCP: blocks of a KV block's size go in and come back byte for byte, a second client
(another replica) reads what the first wrote, and the existence query answers per key. The
negative control: one flipped byte in what comes back is seen as different."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.second_tier.local_master import join, mooncake_master

BLOCK = 2 << 20  # Llama-3-8B's KV block of 16 tokens, bytes


@pytest.fixture(scope="module")
def master():
    with mooncake_master() as m:
        yield m


def _blocks(n: int, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    return {f"kvt-test/{seed}/{i}": rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
            for i in range(n)}


def test_blocks_round_trip_byte_for_byte_and_across_clients(master):
    writer = join(master, segment_bytes=64 << 20, buffer_bytes=16 << 20)
    reader = join(master, segment_bytes=16 << 20, buffer_bytes=16 << 20)
    try:
        blocks = _blocks(6, seed=1)
        for key, data in blocks.items():
            assert writer.put(key, data) == 0
        for key, data in blocks.items():
            got = reader.get(key)  # another client: another replica's view of the store
            assert len(got) == BLOCK and got == data, key
        keys = [*blocks, "kvt-test/never-written"]
        assert [int(x) for x in reader.batch_is_exist(keys)] == [1] * len(blocks) + [0]
        # Negative control: a single flipped byte is a different block.
        key, data = next(iter(blocks.items()))
        flipped = bytearray(reader.get(key))
        flipped[BLOCK // 2] ^= 0xFF
        assert bytes(flipped) != data
    finally:
        reader.close()
        writer.close()
