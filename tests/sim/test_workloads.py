"""The workload registry's transformations (``kvtriton.sim.workloads``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.sim.workload import Workload, agent_workload
from kvtriton.sim.workloads import coarsen, fresh_outputs, limit_workload, scale_times

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def hints(w: Workload) -> list[str | None]:
    return [r.hint for r in w]


def test_cli_copies_keep_hints():
    w = agent_workload(**SMALL)
    assert hints(scale_times(w, 2.0)) == hints(w)
    assert hints(limit_workload(w, 10)) == hints(w)[:10]
    assert hints(coarsen(w, 3)) == hints(w)
    assert hints(fresh_outputs(w, 4)) == hints(w)


def _shared_blocks(a, b, block: int) -> int:
    """Leading prompt blocks two requests share."""
    pa, pb = a.hashes[:a.prompt_len // block], b.hashes[:b.prompt_len // block]
    n = min(len(pa), len(pb))
    diff = np.flatnonzero(pa[:n] != pb[:n])
    return int(diff[0]) if len(diff) else n


@settings(max_examples=25, deadline=None)
@given(stride=st.integers(1, 7), seed=st.integers(0, 50))
def test_coarsen_keeps_the_sharing_at_coarser_resolution(stride, seed):
    """Two prompts that share L leading blocks share exactly ceil(L / stride) after, for every
    pair (the loop reference is the definition)."""
    w = agent_workload(**SMALL, hash_block_size=16, seed=seed)
    c = coarsen(w, stride)
    b = w.hash_block_size
    for r, s in zip(w.requests, c.requests, strict=True):
        assert s.prompt_len == -(-(r.prompt_len // b) // stride) * b + r.prompt_len % b
        assert s.session == r.session and s.after == r.after and s.think_s == r.think_s
    reqs = list(zip(w.requests, c.requests, strict=True))
    for i in range(0, len(reqs), 3):
        for j in range(i + 1, len(reqs), 2):
            shared = _shared_blocks(reqs[i][0], reqs[j][0], b)
            assert _shared_blocks(reqs[i][1], reqs[j][1], b) == -(-shared // stride)


def test_fresh_outputs_are_never_shared():
    """In the generator a turn's prompt holds the previous turn's output; after
    ``fresh_outputs`` no output block is in any other request."""
    w = agent_workload(**SMALL, hash_block_size=16)
    b = w.hash_block_size
    prompts = {h for r in w for h in r.hashes[:r.prompt_len // b].tolist()}
    outs = [h for r in w for h in r.hashes[r.prompt_len // b:].tolist()]
    assert prompts & set(outs)  # the control: the generator reuses outputs
    f = fresh_outputs(w, 8)
    prompts = {h for r in f for h in r.hashes[:r.prompt_len // b].tolist()}
    outs = [h for r in f for h in r.hashes[r.prompt_len // b:].tolist()]
    assert not prompts & set(outs) and len(outs) == len(set(outs))
    assert all(r.output_len == min(o.output_len, 8) for r, o in zip(f, w, strict=True))
    assert [r.hashes[:r.prompt_len // b].tolist() for r in f] == \
        [r.hashes[:r.prompt_len // b].tolist() for r in w]


@pytest.mark.parametrize("call, message", [
    (lambda w: coarsen(w, 0), "stride must be an int >= 1, got 0"),
    (lambda w: coarsen(w, 2.0), "stride must be an int >= 1, got 2.0"),
    (lambda w: fresh_outputs(w, 0), "max_output_tokens must be an int >= 1, got 0"),
])
def test_transformations_refuse_bad_values(call, message):
    with pytest.raises(ValueError, match=message):
        call(agent_workload(**SMALL))
