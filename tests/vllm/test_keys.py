"""Dense key ids for vLLM hashes (``kvtriton.vllm.keys.KeyIds``): exact and dense interning,
reserved ids bound once, unbound ids recycled exactly once. No vLLM needed."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.vllm.keys import KeyIds, group_suffixes

SFX = group_suffixes(2)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_interning_is_exact_and_dense():
    keys = KeyIds()
    a, b = keys.id_of(h(1) + SFX[0]), keys.id_of(h(1) + SFX[1])
    assert (a, b) == (0, 1) and keys.id_of(h(1) + SFX[0]) == 0
    assert keys.hash_of(1) == h(1) + SFX[1] and keys.get(h(2)) is None


def test_binding_a_bound_id_is_an_error():
    keys = KeyIds()
    kid = int(keys.reserve(1)[0])
    assert keys.bind(h(9), kid)
    with pytest.raises(ValueError, match="already bound"):
        keys.bind(h(10), kid)
    assert np.array_equal(keys.reserve(0), np.zeros(0, dtype=np.int64))


def test_recycled_ids_are_handed_out_again_and_forget_their_hash():
    keys = KeyIds()
    a, b, c = (keys.id_of(h(i)) for i in range(3))
    keys.recycle([b, b])  # a repeat is recycled once
    assert keys.get(h(1)) is None and keys.hash_of(b) is None
    assert keys.num_bound == 2 and keys.recycled == 1 and keys.num_reserved() == 0
    d = keys.id_of(h(9))
    assert d == b and keys.hash_of(d) == h(9) and keys.capacity == 3
    assert sorted(keys.bound_ids().tolist()) == [a, b, c]
    with pytest.raises(ValueError, match=r"\[7\]"):
        keys.recycle([a, 7])  # never handed out: nothing changes
    assert keys.num_bound == 3 and keys.get(h(0)) == a
    r = keys.reserve(1)
    with pytest.raises(ValueError, match="not bound"):
        keys.recycle(r)  # a reserved id is the mirror's to release
