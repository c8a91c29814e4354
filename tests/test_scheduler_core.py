"""The scheduler core of the simulator, the harness and the soak (``kvtriton.sim.scheduler``).

Hand-built cases: null pages for positions already out of a sliding window (a parameter, so the
harness and the simulator differ by a flag, not by a copy), what a group drops once its tokens
are computed, the step policy's preemption and resumption, and the integrity hook's plain-value
calls. The import check runs in a fresh interpreter, so modules earlier tests imported cannot
hide an import of Triton or of integrity mode.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvtriton.hashing import HashIndex, chain_hashes, request_keys
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.sim.scheduler import BatchScheduler, KVScheduler, SeqBlocks
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

ROOT = Path(__file__).resolve().parent.parent
# Full attention plus a 40-token sliding window, both with 16-token blocks.
SLIDING = KVLayout([FullAttentionSpec(16, 1, 8, 1),
                    SlidingWindowSpec(16, 1, 8, 1, sliding_window=40)], name="sliding")
# Full attention plus Mamba states saved every 64 tokens.
MAMBA = KVLayout([FullAttentionSpec(16, 1, 8, 1), MambaSpec(64, (4,), (8,), 1)], name="mamba")
FULL = KVLayout([FullAttentionSpec(16, 1, 8, 1)], name="full")
INDEX = HashIndex()  # one id space for every request's keys: equal prefixes, equal keys


def _request(layout: KVLayout, rid: str, prefix: int, n: int) -> Request:
    tokens = list(range(prefix * 1_000_003, prefix * 1_000_003 + n))
    keys = request_keys(layout, INDEX, chain_hashes(tokens, layout.hash_block_size))
    return Request(rid, keys, num_prompt_tokens=n, num_tokens=n)


def _seq(kv: KVScheduler, req: Request) -> SeqBlocks:
    seq = SeqBlocks(req)
    kv.empty_tables(seq)
    return seq


@pytest.mark.parametrize("code", [
    "import kvtriton.sim",
    "from kvtriton.sim import agent_workload",
    "import kvtriton.sim.loop",
    "import kvtriton.sim.scheduler",
])
def test_simulator_imports_leave_out_triton_and_integrity_mode(code):
    probe = f"{code}\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    mods = set(out.stdout.split())
    assert "triton" not in mods
    assert "kvtriton.sim.integrity" not in mods


@pytest.mark.parametrize("null_out_of_window", [False, True], ids=["real-blocks", "null-pages"])
def test_out_of_window_positions_get_null_pages_only_when_asked(null_out_of_window):
    # 100 computed tokens (a CPU hit, say) with a 40-token window: tokens [0, 61) are out of it,
    # so sliding-window blocks 0..2 (tokens 0-47) are never read again; block 3 holds token 61.
    gpu = BlockPool(64)
    kv = KVScheduler(SLIDING, gpu, None, null_out_of_window=null_out_of_window)
    seq = _seq(kv, _request(SLIDING, "a", 1, 128))
    need = kv.blocks_needed(seq.tables, 100, computed=100)
    free = gpu.num_free_blocks
    kv.grow(seq, 100, computed=100)
    assert free - gpu.num_free_blocks == sum(need)
    assert len(seq.tables[0]) == len(seq.tables[1]) == 7
    assert NULL_BLOCK not in seq.tables[0]
    window = seq.tables[1]
    if null_out_of_window:
        assert window[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in window[3:]
        assert need == [7, 4]
    else:
        assert NULL_BLOCK not in window and need == [7, 7]
    assert seq.new == seq.tables


def test_sliding_window_drops_registered_pages_last_position_first():
    gpu = BlockPool(64)
    kv = KVScheduler(SLIDING, gpu, None)
    seq = _seq(kv, _request(SLIDING, "a", 1, 128))
    kv.grow(seq, 100)
    seq.req.num_computed_tokens = 100
    dropped = seq.tables[1][:3]
    kv.cache_computed(seq)
    assert seq.cached == [6, 6]
    assert seq.tables[1][:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in seq.tables[1][3:]
    assert NULL_BLOCK not in seq.tables[0]
    # Hashed blocks join the free queue's tail in the order freed.
    assert list(gpu.iter_free())[-3:] == dropped[::-1]


def test_mamba_keeps_only_its_last_state_and_hands_off_every_boundary():
    gpu = BlockPool(64)
    kv = KVScheduler(MAMBA, gpu, None)
    seq = _seq(kv, _request(MAMBA, "a", 1, 256))
    kv.grow(seq, 200)
    seq.req.num_computed_tokens = 200
    states = list(seq.tables[1])
    kv.cache_computed(seq)
    assert seq.handoffs == [(64, states[0], 1), (128, states[1], 1), (192, states[2], 1)]
    assert seq.tables[1] == [NULL_BLOCK, NULL_BLOCK, states[2], states[3]]
    out = kv.step_output([seq], {"a": 200}, preempted=set())
    assert out.boundary_handoffs == {"a": [(64, states[0], 1), (128, states[1], 1),
                                           (192, states[2], 1)]}
    assert not seq.handoffs and not any(seq.new)


def test_unregistered_pages_are_not_dropped():
    # Registered up to 32 tokens only: the window has moved past block 2, which is kept.
    gpu = BlockPool(64)
    kv = KVScheduler(SLIDING, gpu, None)
    seq = _seq(kv, _request(SLIDING, "a", 1, 128))
    kv.grow(seq, 100)
    kv.cache_full_blocks(seq, 32)
    seq.req.num_computed_tokens = 100
    kv.drop_unneeded(seq)
    assert seq.tables[1][:2] == [NULL_BLOCK] * 2 and seq.tables[1][2] != NULL_BLOCK


def _capture_step_outputs(sched: BatchScheduler) -> list:
    outputs = []
    build = sched.step_output

    def recording(*args, **kwargs):
        outputs.append(build(*args, **kwargs))
        return outputs[-1]

    sched.step_output = recording
    return outputs


def test_newest_running_request_is_preempted_and_resumes_with_a_new_table():
    # 8 blocks of 16 tokens: a (64 tokens) and b (48) take 7. Each samples a token; the next
    # step a's 65th token takes the last free block, so b's 49th finds none: b, the newest, is
    # preempted, and is reported resumed when it is admitted again, its prefix a GPU hit.
    gpu = BlockPool(8 + 1)
    sched = BatchScheduler(FULL, gpu, None, token_budget=512, max_running=8)
    outputs = _capture_step_outputs(sched)
    a = SeqBlocks(_request(FULL, "a", 1, 64))
    b = SeqBlocks(_request(FULL, "b", 2, 48))
    sched.add(a)
    sched.add(b)
    scheduled, meta = sched.schedule_step()
    assert scheduled == {"a": 64, "b": 48} and meta is None
    assert sched.advance(scheduled, lambda seq: False) == []
    b_blocks = list(b.tables[0])
    scheduled, _ = sched.schedule_step()
    assert scheduled == {"a": 1} and sched.preemptions == 1
    assert outputs[-1].preempted_req_ids == {"b"} and "b" not in outputs[-1].new_block_ids
    assert list(sched.waiting) == [b] and b.resumed and b.req.num_computed_tokens == 0
    assert b.tables == [[]] and gpu.num_free_blocks == 3
    sched.advance(scheduled, lambda seq: True)  # a finishes
    scheduled, _ = sched.schedule_step()
    assert scheduled == {"b": 1}  # 48 tokens hit the GPU prefix cache
    assert outputs[-1].finished_req_ids == {"a"}
    assert outputs[-1].resumed_req_ids == {"b"} and not b.resumed
    assert outputs[-1].new_block_ids["b"][0][:3] == b_blocks


class _RecordingHook:
    """An integrity hook that records the plain values it is called with."""

    def __init__(self) -> None:
        self.filled: list[tuple[int, int, int]] = []
        self.executed = 0
        self.checked: list[tuple[str, int, int, int]] = []

    def attach(self, num_gpu_blocks: int) -> None:
        pass

    def fill(self, group: int, block: int, key: int) -> None:
        self.filled.append((group, block, key))

    def execute(self, meta) -> None:
        self.executed += 1

    def check_load(self, request_id, keys, tables, start, end, step) -> None:
        self.checked.append((request_id, start, end, step))


def test_integrity_hook_sees_computed_blocks_steps_and_loads():
    gpu = BlockPool(16 + 1)
    planner = OffloadPlanner(FULL, gpu, 64, PlannerConfig())
    hook = _RecordingHook()
    sched = BatchScheduler(FULL, gpu, planner, token_budget=512, max_running=8,
                           integrity=hook)
    first = SeqBlocks(_request(FULL, "a", 1, 64))
    sched.add(first)
    scheduled, meta = sched.schedule_step()
    steps = 1
    sched.advance(scheduled, lambda seq: True)
    assert [(g, k) for g, _, k in hook.filled] == [(0, k) for k in first.req.keys[0].tolist()]
    while planner.cpu_pool.num_cached_keys < 4 and steps < 8:  # a's blocks are stored
        _, meta = sched.schedule_step()
        steps += 1
        sched.deliver([], [meta.store.event] if meta.store.event >= 0 else [], step=steps)
    assert planner.cpu_pool.num_cached_keys == 4
    assert gpu.reset_prefix_cache()  # the GPU copy is gone: a repeat hits the CPU tier
    again = SeqBlocks(_request(FULL, "b", 1, 64))
    sched.add(again)
    scheduled, meta = sched.schedule_step()
    steps += 1
    assert scheduled == {} and "b" in sched.loading and meta.load.event >= 0
    sched.deliver(["b"], [], step=7)
    assert hook.checked == [("b", 0, 48, 7)]  # the last token is always recomputed
    assert again.req.num_computed_tokens == 48 and sched.running == [again]
    assert hook.executed == steps and len(hook.filled) == 4
