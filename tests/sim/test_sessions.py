"""Sessions in the simulator: ``causal_sessions`` (each request's session as a server can tell it
on arrival) and the ``sessions`` axis in the serving loop.

``causal_sessions`` is checked on the agent generator with its sessions hidden (a continuation
extends its previous turn's whole prompt, so the inferred sessions are the generator's), on the
Mooncake trace (sessionless) for causality: the answer for a request never changes when the
requests after it are cut off; and a request whose prompt extends none is a session of its own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.workload import Workload, WorkloadRequest, causal_sessions
from kvtriton.sim.workloads import load_workload

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 6, "system_prompt_tokens": 64,
         "first_user_tokens": 64, "user_tokens": 32, "output_tokens": 16, "seed": 3}


def _hidden(wl: Workload) -> Workload:
    return Workload([replace(r, session=None) for r in wl.requests], wl.hash_block_size,
                    wl.name)


def test_inferred_sessions_are_the_generators_own():
    wl = agent_workload(**SMALL)
    inferred = causal_sessions(_hidden(wl))
    # The same partition of the requests: one inferred name per generator session and back.
    pairs = set(zip([r.session for r in wl.requests], inferred, strict=True))
    assert len(pairs) == len({s for s, _ in pairs}) == len({i for _, i in pairs})
    assert causal_sessions(wl) == [r.session for r in wl.requests]  # known sessions are kept


def test_a_prompt_that_extends_no_earlier_one_starts_a_session():
    h = np.array([1, 2, 3], dtype=np.uint64)
    reqs = [WorkloadRequest("a", 0.0, 32, 0, h[:2]),
            WorkloadRequest("b", 1.0, 48, 0, h),  # extends a's whole prompt
            WorkloadRequest("c", 2.0, 16, 0, h[:1]),  # a prefix of a's, extends nobody's
            WorkloadRequest("d", 3.0, 48, 0, np.array([1, 2, 9], dtype=np.uint64)),  # a's too
            WorkloadRequest("e", 4.0, 32, 0, np.array([1, 7], dtype=np.uint64))]  # c's
    assert causal_sessions(Workload(reqs, 16)) == ["a", "a", "c", "a", "c"]


def test_sessions_are_inferred_from_the_past_only():
    wl = load_workload("mooncake", block_size=64, limit=300)
    full = causal_sessions(wl)
    assert len(set(full)) < len(full)  # continuations were found
    for cut in (1, 57, 150):
        head = Workload(wl.requests[:cut], wl.hash_block_size, wl.name)
        assert causal_sessions(head) == full[:cut]


@pytest.mark.parametrize("idle", [0.001, 86400])
def test_the_loop_ages_sessions_out_by_modeled_time(idle):
    wl = agent_workload(**SMALL)
    setup = f"eager+sessions:{idle}"
    r = simulate(wl, gpu_tokens=2048, cpu_tokens=2048, setups=[setup], bound=False)
    expired = r.rows[0]["sessions_expired"]
    # Think times exceed a millisecond: each session ages out between its turns; never in a day.
    assert expired >= len({q.session for q in wl.requests}) if idle < 1 else expired == 0
