"""Same-step loads in the simulator (``simulate(..., sync_load_budget_bytes=...)``,
``kvtriton.sync_loads``): a CPU hit within the step's budget is computed in the step that admits
it, its load on that step's critical path; budget 0 is the simulator as it was.

The scenario (``reuse_while_decoding``): ``a`` computes a prefix P and finishes, fillers push P
out of the GPU (the eager tier stored it), and ``b`` = P plus a block arrives while ``d``
decodes, so every step runs something. Without a budget ``b``'s load is issued in the step that
admits it and ``b`` is computed in the next; with one, in the same step.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.sim import agent_workload, simulate
from kvtriton.sim.loop import ServingLoop
from kvtriton.sim.workload import Workload, WorkloadRequest
from kvtriton.specs import preset
from kvtriton.sync_loads import SyncLoadBudget

BLOCK = 16
P_BLOCKS = 16
GIB = 1 << 30
#: Figures measured on the clock, not modeled: they differ run to run.
MEASURED = ("wall_s", "build_meta_ms_mean", "build_meta_ms_p99", "planner_ms_per_step")


def chain(seed: int, n: int) -> np.ndarray:
    return np.arange(seed * 1000 + 1, seed * 1000 + 1 + n, dtype=np.uint64)


def reuse_while_decoding() -> Workload:
    prefix = chain(1, P_BLOCKS)
    reqs = [WorkloadRequest("a", 0.0, P_BLOCKS * BLOCK, 1, prefix),
            WorkloadRequest("d", 0.0, BLOCK, 300, chain(2, (BLOCK + 300) // BLOCK))]
    reqs += [WorkloadRequest(f"f{j}", 0.01 + j * 1e-3, P_BLOCKS * BLOCK, 1, chain(10 + j, 16))
             for j in range(3)]
    reqs.append(WorkloadRequest("b", 1.0, (P_BLOCKS + 1) * BLOCK, 1,
                                np.concatenate([prefix, chain(99, 1)])))
    return Workload(reqs, BLOCK, "reuse while decoding")


def first_token_steps(monkeypatch) -> dict[str, int]:
    """Request id -> the step that sampled its first token, for the runs that follow."""
    steps: dict[str, int] = {}
    sampled = ServingLoop._sampled

    def record(self, seq):
        steps.setdefault(seq.req.request_id, self.step_no)
        return sampled(self, seq)

    monkeypatch.setattr(ServingLoop, "_sampled", record)
    return steps


def run(budget: int, **kw) -> dict:
    res = simulate(reuse_while_decoding(), gpu_tokens=64 * BLOCK, cpu_tokens=64 * BLOCK,
                   setups=["eager"], references=(), bound=False,
                   sync_load_budget_bytes=budget, **kw)
    return res.rows[0]


def test_a_hit_within_the_budget_gets_its_first_token_a_step_earlier(monkeypatch):
    layout = preset("llama3-8b", block_size=BLOCK)
    steps = first_token_steps(monkeypatch)
    off = run(0)
    b_off = steps.pop("b")
    steps.clear()
    hit = off["cpu_hit_tokens"]
    assert hit >= 4 * BLOCK  # b's prefix came back from the CPU tier
    on = run(layout.hit_bytes(hit))
    assert on["sync_loads"] == 1 and off["sync_loads"] == 0
    assert on["cpu_hit_tokens"] == hit and on["loaded_blocks"] == off["loaded_blocks"]
    assert steps["b"] == b_off - 1
    # The load stays on the first token's path: b gains a step, less the load's link time.
    ttft_on, ttft_off = on["ttft_all_s"][-1], off["ttft_all_s"][-1]
    assert ttft_on < ttft_off
    # One byte short of the hit: asynchronous, as without a budget.
    steps.clear()
    short = run(layout.hit_bytes(hit) - 1)
    assert short["sync_loads"] == 0 and steps["b"] == b_off


def test_the_budget_keeps_one_token_to_compute():
    budget = SyncLoadBudget(preset("llama3-8b", block_size=BLOCK), GIB)
    assert not budget.reserve("r", 0, 64, 64)  # nothing would be left to compute
    assert budget.reserve("r", 0, 48, 64)


def test_the_budget_resets_per_step_and_gives_back_a_lookup_done_again():
    layout = preset("llama3-8b", block_size=BLOCK)
    budget = SyncLoadBudget(layout, layout.hit_bytes(2 * BLOCK))
    assert budget.reserve("r", 0, BLOCK, 100) and budget.reserve("s", 0, BLOCK, 100)
    assert not budget.reserve("t", 0, BLOCK, 100)  # the step's budget is spent
    assert budget.reserve("s", 0, BLOCK, 100)  # looked up again: its own bytes came back
    budget.release("s")
    assert budget.reserve("t", 0, BLOCK, 100)
    budget.new_step()
    assert budget.reserve("u", 0, 2 * BLOCK, 100) and not budget.reserve("v", 0, BLOCK, 100)
    with pytest.raises(ValueError, match="non-negative int"):
        SyncLoadBudget(layout, -1)


def test_budget_zero_is_the_simulator_without_it():
    """Every figure equal to the last digit (the clock's measurements aside), with the budget
    off and with one that no hit fits in (every hit answered asynchronous)."""
    wl = agent_workload(num_conversations=6, min_turns=3, max_turns=5, seed=4)
    kw = {"gpu_tokens": 4096, "cpu_tokens": 16384, "setups": ["eager", "lazy+hints"],
          "references": (), "bound": False}
    rows = [simulate(wl, **kw).rows]
    rows += [simulate(wl, sync_load_budget_bytes=b, **kw).rows for b in (0, 1)]
    assert rows[0][0]["cpu_hit_tokens"] > 0
    strip = [[{k: v for k, v in r.items() if k not in MEASURED} for r in rs] for rs in rows]
    assert strip[0] == strip[1] == strip[2]
    assert all(r["sync_loads"] == 0 for r in rows[0])


def test_integrity_mode_checks_every_same_step_load():
    row = run(GIB, integrity=True)
    assert row["sync_loads"] == 1
    assert row["integrity_blocks_checked"] == row["loaded_blocks"] > 0


def test_a_bad_budget_is_one_error():
    with pytest.raises(ValueError, match="sync_load_budget_bytes must be a non-negative int"):
        run(-1)


def test_vllms_scheduler_gives_the_same_step():
    """The same scenario through vLLM's own scheduler and the connector: b's hit is loaded in
    the step that schedules it there too, and its first token comes sooner."""
    pytest.importorskip("vllm")
    off, on = (run(b, engine="vllm") for b in (0, GIB))
    assert (off["sync_loads"], on["sync_loads"]) == (0, 1)
    assert on["cpu_hit_tokens"] == off["cpu_hit_tokens"] > 0
    assert on["ttft_all_s"][-1] < off["ttft_all_s"][-1]


def test_the_command_takes_the_budget_in_bytes(capsys, tmp_path):
    from kvtriton.cli import main

    for bad in ("-1", "64MiB", "1.5"):
        assert main(["simulate", "--sync-load-budget", bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--sync-load-budget" in err, err
    out = tmp_path / "sim.json"
    assert main(["simulate", "--conversations", "2", "--turns", "2", "3", "--setups", "eager",
                 "--no-bound", "--quiet", "--sync-load-budget", str(GIB),
                 "--json", str(out)]) == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["conditions"]["sync_load_budget_bytes"] == GIB
    assert "sync_loads" in doc["rows"][0]
