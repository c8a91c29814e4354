"""Chained block hashes, per-group keys and the dense ``HashIndex``."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtriton.hashing import (
    HashIndex,
    chain_hashes,
    group_key,
    group_keys,
    group_keys_array,
    mix64,
    mix64_array,
    request_keys,
)

MASK = (1 << 64) - 1
TOKENS = list(range(100, 164))  # 64 tokens: 4 blocks of 16


# ---- chain_hashes -------------------------------------------------------------------------------


def test_chain_hashes_deterministic_64bit_one_per_full_block():
    hs = chain_hashes(TOKENS, 16)
    assert len(hs) == 4
    assert hs == chain_hashes(list(TOKENS), 16)
    assert hs == chain_hashes(np.array(TOKENS, dtype=np.int32), 16)
    assert all(type(h) is int and 0 <= h <= MASK for h in hs)
    assert len(set(hs)) == 4


def test_chain_hashes_fixed_value_across_processes():
    # BLAKE2b, not hash(): the value is a constant of the format. A change here changes every
    # stored key, so it must be deliberate.
    import hashlib
    import struct

    root = 0x6B76_7472_6974_6F6E
    data = struct.pack("<Q", root) + np.array([1, 2], dtype=np.int64).tobytes()
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert chain_hashes([1, 2], 2) == [expected]


def test_equal_prefix_gives_equal_hashes_then_diverges():
    other = [*TOKENS[:40], 7, *TOKENS[41:]]  # differs in block 2 (tokens 32..47)
    a, b = chain_hashes(TOKENS, 16), chain_hashes(other, 16)
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    assert a[3] != b[3]  # the chain carries the difference forward even though block 3 is equal


def test_chain_is_positional_not_per_block():
    # Same block contents behind a different parent hash to a different value.
    blk = list(range(16))
    assert chain_hashes(blk + blk, 16)[1] != chain_hashes(blk, 16)[0]


def test_parent_continues_a_chain():
    full = chain_hashes(TOKENS, 16)
    tail = chain_hashes(TOKENS[32:], 16, parent=full[1])
    assert tail == full[2:]


def test_partial_trailing_block_is_unhashed():
    assert chain_hashes(TOKENS[:47], 16) == chain_hashes(TOKENS[:32], 16)
    assert len(chain_hashes(TOKENS[:47], 16)) == 2
    assert chain_hashes(TOKENS[:15], 16) == []
    assert chain_hashes([], 16) == []


def test_lora_id_separates_every_block():
    base = chain_hashes(TOKENS, 16)
    l1 = chain_hashes(TOKENS, 16, lora_id=1)
    l2 = chain_hashes(TOKENS, 16, lora_id=2)
    assert l1 == chain_hashes(TOKENS, 16, lora_id=1)
    for i in range(4):
        assert len({base[i], l1[i], l2[i]}) == 3
    assert chain_hashes(TOKENS, 16, lora_id=0) != base  # adapter 0 is not "no adapter"


def test_extra_keys_fold_into_their_block_only_and_chain_on():
    base = chain_hashes(TOKENS, 16)
    mm = chain_hashes(TOKENS, 16, extra_keys=[None, None, ("img", 0xABC), None])
    mm2 = chain_hashes(TOKENS, 16, extra_keys=[None, None, ("img", 0xABD), None])
    # A None entry adds nothing to its block's hash: hashed as repr(None), it would keep the
    # blocks before a request's first image from matching the same text-only prefix.
    assert mm[:2] == base[:2]
    assert chain_hashes(TOKENS, 16, extra_keys=[None] * 4) == base
    assert mm[2] != base[2] and mm[2] != mm2[2]
    assert mm[3] != mm2[3]
    # extra keys only for the full blocks are enough
    assert chain_hashes(TOKENS[:40], 16, extra_keys=["a", "b"]) == chain_hashes(
        TOKENS[:40], 16, extra_keys=["a", "b", "c"])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(token_ids=TOKENS, hash_block_size=0), "hash_block_size must be positive, got 0"),
        (dict(token_ids=TOKENS, hash_block_size=-16), "got -16"),
        (dict(token_ids=[[1, 2], [3, 4]], hash_block_size=2), r"1-D, got shape \(2, 2\)"),
        (dict(token_ids=[1.5, 2.0], hash_block_size=2), "integers, got dtype float64"),
        (dict(token_ids=TOKENS, hash_block_size=16, extra_keys=["a"]),
         "extra_keys has 1 entries for 4 blocks"),
        (dict(token_ids=TOKENS, hash_block_size=16, parent=-1), "parent -1 "),
        (dict(token_ids=TOKENS, hash_block_size=16, parent=1 << 64), f"parent {1 << 64} "),
        (dict(token_ids=TOKENS, hash_block_size=16, lora_id=1 << 63), f"lora_id {1 << 63} "),
    ],
    ids=["bs0", "bs-neg", "2d", "float-tokens", "short-extra", "parent-neg", "parent-big",
         "lora-big"],
)
def test_chain_hashes_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chain_hashes(**kwargs)


def test_float_tokens_are_not_truncated_into_a_hit():
    # Float token ids are refused, not cast to int64 (which would hash [1.5, 2.0] like [1, 2]).
    with pytest.raises(ValueError, match="float64"):
        chain_hashes(np.array([1.5, 2.0]), 2)


# ---- group keys ---------------------------------------------------------------------------------


def test_group_key_separates_groups_and_is_deterministic():
    hs = chain_hashes(TOKENS, 16)
    per_group = [group_keys(hs, g) for g in range(4)]
    assert per_group[1] == [group_key(h, 1) for h in hs]
    assert per_group[1] == group_keys(hs, 1)
    flat = [k for ks in per_group for k in ks] + hs
    assert len(set(flat)) == len(flat)  # no group key equals another group's or a raw hash
    assert all(0 <= k <= MASK for k in flat)


def test_mix64_is_splitmix_finalizer():
    # Reference values of SplitMix64's output function (state increments of the golden gamma).
    gamma = 0x9E3779B97F4A7C15
    assert mix64(gamma) == 0xE220A8397B1DCDAF
    assert mix64(2 * gamma & MASK) == 0x6E789E6AA1B965F4
    assert mix64(0) == 0


@given(st.integers(0, MASK), st.integers(0, 63), st.integers(0, 63))
def test_group_key_injective_per_hash(h, g1, g2):
    assert (group_key(h, g1) == group_key(h, g2)) == (g1 == g2)


# ---- HashIndex ----------------------------------------------------------------------------------


def test_hash_index_interns_densely_and_round_trips():
    idx = HashIndex()
    hs = [MASK, 0, 1 << 63, 12345]
    assert [idx.intern(h) for h in hs] == [0, 1, 2, 3]
    assert [idx.intern(h) for h in reversed(hs)] == [3, 2, 1, 0]  # existing ids are stable
    assert len(idx) == 4
    assert [idx.hash_of(i) for i in range(4)] == hs
    assert all(type(idx.hash_of(i)) is int for i in range(4))
    assert idx.get(12345) == 3 and idx.get(999) is None
    assert 0 in idx and 999 not in idx
    assert len(idx) == 4  # get and `in` do not intern


def test_hash_index_grows_past_initial_capacity():
    idx = HashIndex(initial_capacity=1)
    assert idx.capacity == 1
    hs = [mix64(i) for i in range(1000)]
    ids = idx.intern_many(hs)
    assert ids.dtype == np.int64 and ids.tolist() == list(range(1000))
    assert idx.capacity == 1024
    assert [idx.hash_of(i) for i in range(1000)] == hs
    # Repeats and new ones mixed: new ones take the next ids in order.
    again = idx.intern_many([hs[5], mix64(5000), hs[0], mix64(5001)])
    assert again.tolist() == [5, 1000, 0, 1001]
    assert len(idx) == 1002


def test_hash_index_numpy_uint64_is_the_same_key():
    idx = HashIndex(4)
    h = (1 << 64) - 5
    assert idx.intern(np.uint64(h)) == 0
    assert idx.intern(h) == 0
    assert idx.hash_of(0) == h


@pytest.mark.parametrize("bad", [-1, 1 << 64, 1.5, None, "abc"], ids=repr)
def test_hash_index_rejects_non_64bit_hashes(bad):
    idx = HashIndex(4)
    idx.intern(7)
    with pytest.raises(ValueError, match=f"hash {bad!r} is not a 64-bit unsigned int"):
        idx.intern(bad)
    assert len(idx) == 1 and idx.hash_of(0) == 7


def test_intern_many_is_all_or_nothing():
    # A bad hash is refused before any of the hashes before it is interned.
    idx = HashIndex(4)
    idx.intern(7)
    with pytest.raises(ValueError, match="hash -3 "):
        idx.intern_many([8, 9, -3, 10])
    assert len(idx) == 1 and 8 not in idx
    assert idx.intern(8) == 1


@pytest.mark.parametrize("hid", [-1, 2, 100])
def test_hash_of_out_of_range(hid):
    idx = HashIndex(4)
    idx.intern_many([10, 20])
    with pytest.raises(ValueError, match=rf"hash id {hid} out of range \[0, 2\)"):
        idx.hash_of(hid)


def test_hash_of_unassigned_slot_within_capacity_is_out_of_range():
    idx = HashIndex(8)
    idx.intern(10)
    with pytest.raises(ValueError, match=r"hash id 1 out of range \[0, 1\)"):
        idx.hash_of(1)


@pytest.mark.parametrize("cap", [0, -4])
def test_hash_index_bad_capacity(cap):
    with pytest.raises(ValueError, match=f"initial_capacity must be positive, got {cap}"):
        HashIndex(cap)


def test_mix64_array_matches_scalar():
    xs = [0, 1, 2**63, 2**64 - 1, 0x1234_5678_9ABC_DEF0]
    got = mix64_array(np.array(xs, dtype=np.uint64))
    assert [int(v) for v in got] == [mix64(x) for x in xs]


@pytest.mark.parametrize("group", [0, 1, 7])
def test_group_keys_array_matches_scalar(group):
    hs = [0, 5, 2**63 + 11, 2**64 - 1] + [mix64(i) for i in range(50)]
    got = group_keys_array(np.array(hs, dtype=np.uint64), group)
    assert [int(v) for v in got] == group_keys(hs, group)


def test_request_keys_interns_one_row_per_group():
    from kvtriton.specs import FullAttentionSpec, KVLayout, SlidingWindowSpec

    layout = KVLayout([FullAttentionSpec(16, 1, 8, 1),
                       SlidingWindowSpec(16, 1, 8, 1, sliding_window=32)])
    idx = HashIndex()
    hs = chain_hashes(list(range(64)), 16)
    keys = request_keys(layout, idx, hs)
    assert keys.shape == (2, 4) and keys.dtype == np.int64
    for g in range(2):
        assert [idx.hash_of(int(k)) for k in keys[g]] == group_keys(hs, g)
