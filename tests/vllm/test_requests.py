"""vLLM requests mirrored for the planner (``kvtriton.vllm.requests``): reserved ids bound as vLLM
hashes a request's new blocks, collisions kept apart, counters copied. No vLLM needed."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def test_the_planner_request_reads_vllm_counters_as_they_are():
    keys = KeyIds()
    v = FakeVllmRequest("a", [h(1), h(2)], num_tokens=40)
    m = RequestMirror(v, keys, SFX[:1], 4 * HBS, HBS)
    r = m.req
    v.num_computed_tokens, v.num_output_placeholders, v.num_tokens = 35, 1, 48
    assert (r.num_computed_tokens, r.num_output_placeholders, r.num_tokens,
            r.confirmed_tokens) == (35, 1, 48, 34)
    # vLLM hands over another object for the same request: the counters follow it.
    w = FakeVllmRequest("a", list(v.block_hashes), num_tokens=64, num_computed_tokens=50)
    m.vreq = w
    assert (r.num_computed_tokens, r.num_tokens) == (50, 64)
    w.num_tokens = 20  # below the prompt: the planner's count never is
    assert r.num_tokens == w.num_prompt_tokens == 32
    w.block_hashes.append(h(3))
    assert m.bound == 2
    m.refresh()
    assert m.bound == 3 and keys.get(h(3) + SFX[0]) == r.keys[0, 2]


def test_a_live_request_is_checked_as_a_request_is():
    import numpy as np
    import pytest

    from kvtriton.vllm.requests import LiveRequest

    v = FakeVllmRequest("a", num_computed_tokens=-1)
    with pytest.raises(ValueError, match="num_computed_tokens must be a non-negative int"):
        LiveRequest(v, np.zeros((1, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="keys must be non-negative ids"):
        LiveRequest(FakeVllmRequest("b"), np.full((1, 2), -1, dtype=np.int64))
