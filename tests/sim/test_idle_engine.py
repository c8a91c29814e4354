"""A lazy tier stores from the GPU free queue in the steps the engine takes, and an idle engine
takes none. vLLM's engine core steps while its scheduler ``has_requests()`` (a request running or
waiting, one finished in the last step, the connector's stores pending), then waits for the next
arrival without scheduling. Both simulator loops used to step on until the next arrival, each
step's ``build_meta`` walking the free queue ``lazy_target_blocks`` deeper and storing what it
passed (evicting the CPU tier's LRU blocks before the next lookup); and ``ServingLoop`` derived
that depth from the planner config's default budget (8,192 tokens), not the loop's. On
``bench.vllm.engine``'s ``cc_agentic`` the engine's ``lazy+hints`` then hit more than either
loop predicted."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.planner import OffloadPlanner
from kvtriton.sim import simulate
from kvtriton.sim.workload import Workload, WorkloadRequest

BLOCK = 16
BUDGET = 2 * BLOCK  # lazy target: two steps' worth of blocks, 4
X_BLOCKS = 12


def chain(seed: int, n: int) -> np.ndarray:
    return np.arange(seed * 1000 + 1, seed * 1000 + 1 + n, dtype=np.uint64)


def idle_gap() -> Workload:
    """``x`` fills the GPU and finishes; ``b``, unrelated, arrives 10 s later."""
    return Workload([WorkloadRequest("x", 0.0, X_BLOCKS * BLOCK, 1, chain(1, X_BLOCKS)),
                     WorkloadRequest("b", 10.0, 2 * BLOCK, 1, chain(2, 2))], BLOCK, "idle gap")


@pytest.mark.parametrize("engine", ["kvtriton", "vllm"])
def test_an_idle_engine_walks_the_free_queue_no_further(engine, monkeypatch):
    if engine == "vllm":
        pytest.importorskip("vllm")
    stored_at_lookup: dict[str, int] = {}
    lookup = OffloadPlanner.get_num_new_matched_tokens

    def recording(self, req, num_computed_tokens):
        stored_at_lookup.setdefault(req.request_id, self.stats.blocks_stored)
        return lookup(self, req, num_computed_tokens)

    monkeypatch.setattr(OffloadPlanner, "get_num_new_matched_tokens", recording)
    row = simulate(idle_gap(), gpu_tokens=(X_BLOCKS + 1) * BLOCK, cpu_tokens=16 * BLOCK,
                   setups=["lazy"], token_budget=BUDGET, max_running=4, bound=False,
                   engine=engine).rows[0]
    assert row["finished"] == 2
    # The step after x's finish walks 4 free blocks ahead of eviction and stores them; the
    # store completes and the engine idles until b. Stepping on, the loops stored all 12.
    assert stored_at_lookup == {"x": 0, "b": 2 * BUDGET // BLOCK}
