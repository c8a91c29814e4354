"""Train/test splits of a workload: a setup, share or threshold is chosen on one part and
reported on the other, so that a figure the study tuned is never its own evidence.

A split is a mapping request id -> ``"train"`` or ``"test"`` that ``simulate(parts=...)`` takes;
both parts run in the same simulation (they share the server, its queue and the tier, as they
would in production), and every row reports each part's figures apart.

- ``time_halves``: requests in arrival order, the first half train. For one long trace
  (Mooncake) where the future is the question: a setting chosen on the first half is judged on
  the second, which the tier meets already warmed by the first.
- ``session_sets``: whole sessions (conversations, agent traces) drawn into two sets by a seeded
  shuffle. For a set of independent sessions (the coding-agent traces, the agent generator): a
  setting chosen on some users' sessions is judged on other users'. A sub-agent's session
  (``<trace>/<agent>``) goes with its trace's: they share their context.
"""

from __future__ import annotations

import numpy as np

from kvtriton.sim.workload import Workload

__all__ = ["PARTS", "SPLIT_SEED", "TEST", "TRAIN", "session_sets", "split_named", "time_halves"]

TRAIN, TEST = "train", "test"
PARTS = (TRAIN, TEST)
#: The seed of every session split the study reports (fixed before any result was seen).
SPLIT_SEED = 2026


def time_halves(workload: Workload) -> dict[str, str]:
    """The first ``ceil(n / 2)`` requests by arrival time (ties in workload order) train, the
    rest test."""
    order = sorted(range(len(workload)), key=lambda i: (workload.requests[i].arrival_s, i))
    cut = (len(order) + 1) // 2
    return {workload.requests[i].request_id: TRAIN if n < cut else TEST
            for n, i in enumerate(order)}


def session_sets(workload: Workload, seed: int = SPLIT_SEED) -> dict[str, str]:
    """Sessions shuffled with ``seed`` and the first ``ceil(s / 2)`` of them train, the rest
    test; a request without a session is a session of its own, a session named ``a/b`` is
    session ``a``'s. The draw depends on the sorted session names only, not on their order in
    the workload."""
    sessions = sorted({_session(wr) for wr in workload})
    order = np.random.default_rng(seed).permutation(len(sessions))
    cut = (len(sessions) + 1) // 2
    part = {sessions[j]: TRAIN if n < cut else TEST for n, j in enumerate(order)}
    return {wr.request_id: part[_session(wr)] for wr in workload}


def split_named(kind: str, workload: Workload) -> dict[str, str]:
    """The split ``kind`` (``"time"`` or ``"sessions"``) of ``workload``."""
    if kind == "time":
        return time_halves(workload)
    if kind == "sessions":
        return session_sets(workload)
    raise ValueError(f"split {kind!r}: expected 'time' or 'sessions'")


def _session(wr) -> str:
    return wr.session.split("/")[0] if wr.session is not None else f"request:{wr.request_id}"
