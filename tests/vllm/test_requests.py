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
