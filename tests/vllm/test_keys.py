"""Dense key ids for vLLM hashes: reserved ids bound as vLLM hashes a request's new blocks,
collisions kept apart, unbound ids recycled exactly once. No vLLM needed."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from kvtriton.vllm.keys import KeyIds, group_suffixes
from kvtriton.vllm.requests import RequestMirror, lookup_request

HBS = 16
SFX = group_suffixes(2)


@dataclass(eq=False)
class FakeVllmRequest:
    """The fields of ``vllm.v1.request.Request`` the adapter reads."""

    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)
    num_prompt_tokens: int = 32
    num_tokens: int = 32
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    lora_request: None = None


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_interning_is_exact_and_dense():
    keys = KeyIds()
    a, b = keys.id_of(h(1) + SFX[0]), keys.id_of(h(1) + SFX[1])
    assert (a, b) == (0, 1) and keys.id_of(h(1) + SFX[0]) == 0
    assert keys.hash_of(1) == h(1) + SFX[1] and keys.get(h(2)) is None


def test_mirror_reserves_future_positions_and_binds_them_as_vllm_hashes():
    keys = KeyIds()
    v = FakeVllmRequest("a", [h(1), h(2)])
    m = RequestMirror(v, keys, SFX, max_tokens=6 * HBS, hash_block_size=HBS)
    assert m.req.keys.shape == (2, 6) and m.bound == 2
    reserved = m.req.keys[:, 2:].copy()
    assert all(keys.hash_of(int(k)) is None for k in reserved.ravel())
    v.block_hashes += [h(3), h(4)]
    m.bind()
    # The reserved ids became the keys of the new hashes, in both groups.
    assert keys.get(h(3) + SFX[0]) == reserved[0, 0] and keys.get(h(4) + SFX[1]) == reserved[1, 1]
    assert lookup_request(v, keys, SFX).keys.tolist() == m.req.keys[:, :4].tolist()
    assert keys.num_reserved() == 4
    m.release()
    assert keys.num_reserved() == 0  # only the 4 never-bound ids went back
    m.release()  # a second release recycles nothing twice
    assert len(keys._free) == 4
    again = keys.reserve(5)
    assert len(set(again.tolist())) == 5 and set(reserved[:, 2:].ravel()) <= set(again.tolist())


def test_collision_keeps_the_first_id_and_leaves_the_reserved_one_unbound():
    keys = KeyIds()
    a = RequestMirror(FakeVllmRequest("a", [h(1)]), keys, SFX[:1], 3 * HBS, HBS)
    b_req = FakeVllmRequest("b", [h(1)])
    b = RequestMirror(b_req, keys, SFX[:1], 3 * HBS, HBS)
    # Both requests then make the same second block (identical outputs): a binds first.
    a.vreq.block_hashes.append(h(2))
    a.bind()
    b_req.block_hashes.append(h(2))
    b.bind()
    assert keys.collisions == 1 and keys.get(h(2) + SFX[0]) == a.req.keys[0, 1]
    assert b.unbound == [int(b.req.keys[0, 1])]
    b.release()
    a.release()
    assert keys.num_reserved() == 0


def test_refresh_copies_vllm_counters():
    keys = KeyIds()
    v = FakeVllmRequest("a", [h(1), h(2)], num_tokens=40)
    m = RequestMirror(v, keys, SFX[:1], 4 * HBS, HBS)
    v.num_computed_tokens, v.num_output_placeholders, v.num_tokens = 35, 1, 48
    v.block_hashes.append(h(3))
    m.refresh()
    r = m.req
    assert (r.num_computed_tokens, r.num_output_placeholders, r.num_tokens, m.bound) == (
        35, 1, 48, 3)


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


def test_pools_name_every_key_they_refer_to():
    """The CPU tier's cached keys, the keys its ARC ghost lists remember and the keys of events
    not yet taken all count as referenced (a recycler must keep them)."""
    from kvtriton.pool import BlockPool

    pool = BlockPool(4, eviction="arc", medium="CPU", enable_events=True)
    blocks = pool.get_new_blocks(3)
    for b, key in zip(blocks, (10, 11, 12), strict=True):
        pool.cache_block(b, key, ())
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)  # evicts all three: their keys go to a ghost list
    assert pool.num_cached_keys == 0
    assert sorted(set(pool.referenced_keys())) == [10, 11, 12]
    pool.take_events()
    assert sorted(pool.referenced_keys()) == [10, 11, 12]  # ghosts only now
    lru = BlockPool(4, medium="CPU")
    b = lru.get_new_blocks(1)
    lru.cache_block(b[0], 5, (6,))
    assert sorted(lru.referenced_keys()) == [5, 6]
