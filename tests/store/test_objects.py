"""An object's header: what it accepts and what it refuses, on random payloads (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.second_tier import objects
from kvtriton.second_tier.objects import HEADER_BYTES, check, write_header


@pytest.fixture(scope="module")
def split_every_batch():
    """Split every batch (the real threshold needs megabytes per example)."""
    old, objects.SPLIT_BYTES = objects.SPLIT_BYTES, 1
    yield
    objects.SPLIT_BYTES = old


def _object(seed: int, n: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    header = np.empty(HEADER_BYTES, dtype=np.uint8)
    write_header(header, name, payload)
    return header, payload


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4096), flip=st.integers(0, 10**6),
       bit=st.integers(0, 7))
def test_a_true_object_passes_and_any_flipped_bit_fails(seed, n, flip, bit):
    header, payload = _object(seed, n, "kvt1-abc-00")
    assert check(header, "kvt1-abc-00", payload, HEADER_BYTES + n) is None
    bad = payload.copy()
    bad[flip % n] ^= 1 << bit  # a 64-bit checksum: a miss has a 2^-64 chance
    assert check(header, "kvt1-abc-00", bad, HEADER_BYTES + n) == "corrupt"
    hbad = header.copy()
    hbad[flip % HEADER_BYTES] ^= 1 << bit
    assert check(hbad, "kvt1-abc-00", payload, HEADER_BYTES + n) is not None


def test_another_name_a_short_read_and_a_foreign_header_fail():
    header, payload = _object(1, 1000, "kvt1-abc-01")
    assert check(header, "kvt1-abc-02", payload, HEADER_BYTES + 1000) == "corrupt"
    assert check(header, "kvt1-abc-01", payload, HEADER_BYTES + 999) == "short_read"
    assert check(header, "kvt1-abc-01", payload[:999], HEADER_BYTES + 999) == "corrupt"
    assert check(np.zeros(HEADER_BYTES, np.uint8), "kvt1-abc-01", payload,
                 HEADER_BYTES + 1000) == "corrupt"


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(2, 9), flip=st.integers(0, 10**9))
def test_checksums_split_across_threads_equal_one_by_one(seed, n, flip, split_every_batch):
    """``checksums`` over a batch past ``SPLIT_BYTES`` (half of it on the helper thread) gives
    each payload's own XXH3, in order; a flipped byte in any one changes that one alone."""
    import xxhash

    rng = np.random.default_rng(seed)
    payloads = [rng.integers(0, 256, int(rng.integers(1, 5000)), dtype=np.uint8)
                for _ in range(n)]
    got = objects.checksums(payloads)
    assert got == [xxhash.xxh3_64_intdigest(p) for p in payloads]
    i = flip % n
    payloads[i][flip % payloads[i].size] ^= 0xFF
    again = objects.checksums(payloads)
    assert [a != b for a, b in zip(got, again, strict=True)] == [j == i for j in range(n)]
