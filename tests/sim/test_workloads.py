"""The workload registry's transformations (``kvtriton.sim.workloads``)."""

from __future__ import annotations

from kvtriton.sim.workload import Workload, agent_workload
from kvtriton.sim.workloads import limit_workload, scale_times

SMALL = {"num_conversations": 6, "min_turns": 3, "max_turns": 8, "system_prompt_tokens": 100,
         "first_user_tokens": 60, "user_tokens": 30, "output_tokens": 20}


def hints(w: Workload) -> list[str | None]:
    return [r.hint for r in w]


def test_cli_copies_keep_hints():
    w = agent_workload(**SMALL)
    assert hints(scale_times(w, 2.0)) == hints(w)
    assert hints(limit_workload(w, 10)) == hints(w)[:10]
