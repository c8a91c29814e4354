"""The fetch's run (``fetch_run``, vectorized) against its block-by-block reference, on random
presence masks (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.second_tier.fetches import fetch_run, fetch_run_loop


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 12), k=st.integers(1, 3), seed=st.integers(0, 2**32 - 1),
       p_cpu=st.floats(0, 1), p_store=st.floats(0, 1))
def test_fetch_run_matches_the_loop_reference(n, k, seed, p_cpu, p_store):
    rng = np.random.default_rng(seed)
    in_cpu = rng.random((n, k)) < p_cpu
    in_store = rng.random(int((~in_cpu).sum())) < p_store
    run, take = fetch_run(in_cpu, in_store)
    ref_run, ref_take = fetch_run_loop(in_cpu, in_store)
    assert run == ref_run and take.tolist() == ref_take.tolist()


def test_a_run_stops_at_the_first_block_neither_tier_holds():
    in_cpu = np.array([[False], [True], [False], [False]])
    run, take = fetch_run(in_cpu, np.array([True, False, True]))
    assert run == 2 and take.tolist() == [0]  # block 1 from the CPU, block 2 nowhere
