"""An object's header: what it accepts and what it refuses, on random payloads (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.second_tier.objects import HEADER_BYTES, check, write_header


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
