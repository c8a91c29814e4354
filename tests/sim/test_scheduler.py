"""The scheduler core (``kvtriton.sim.scheduler``) and its step policy
(``kvtriton.sim.batch_scheduler``) of the simulator, the tests' planner driver and the memory soak.

Hand-built cases: null pages for positions already out of a sliding window (a parameter, so the
planner driver and the simulator differ by a flag, not by a copy) and before what a hit writes,
what a group drops once its tokens are computed, the step policy's preemption and resumption,
vLLM 0.32's step policy, and the integrity hook's plain-value calls.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.hashing import HashIndex, chain_hashes, request_keys
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.sim.batch_scheduler import BatchScheduler
from kvtriton.sim.scheduler import KVScheduler, SeqBlocks
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

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


def test_a_hit_leaves_null_pages_before_its_window_and_its_state():
    # A hit of 256 tokens: the load writes the window's last blocks (40-token window: tokens
    # 217..255, blocks 13..15) and the state saved at 256 (64-token states: position 3); the
    # positions before get null pages, those after (tokens 256..299 to compute) real blocks.
    layout = KVLayout([FullAttentionSpec(16, 1, 8, 1),
                       SlidingWindowSpec(16, 1, 8, 1, sliding_window=40),
                       MambaSpec(64, (4,), (8,), 1)], name="three-kinds")
    gpu = BlockPool(128)
    kv = KVScheduler(layout, gpu, None)
    seq = SeqBlocks(Request("a", np.arange(3 * 20).reshape(3, 20), num_prompt_tokens=300,
                            num_tokens=300))
    kv.empty_tables(seq)
    need = kv.blocks_needed(seq.tables, 300, computed=256)
    kv.grow(seq, 300, computed=256)
    full, window, mamba = seq.tables
    assert NULL_BLOCK not in full and len(full) == 19
    assert window[:13] == [NULL_BLOCK] * 13 and NULL_BLOCK not in window[13:]
    assert mamba[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in mamba[3:] and len(mamba) == 5
    assert need == [19, 6, 2] and gpu.num_used_blocks == sum(need)


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
    # The load landed; b holds its blocks outside ``running`` until the next step schedules it.
    assert again.req.num_computed_tokens == 48 and sched.running == [] and "b" in sched.loading
    scheduled, _ = sched.schedule_step()
    steps += 1
    assert scheduled == {"b": 16} and sched.running == [again] and not sched.loading
    assert hook.executed == steps and len(hook.filled) == 4


# ---- vLLM 0.32's step policy: landed loads, the in-flight reservation, the CPU lookup, full-ISL
# admission. Each test fails on a step policy that departs from vLLM's at that point.

def _tiered(gpu_blocks: int, *, token_budget: int = 512, **kw) -> BatchScheduler:
    gpu = BlockPool(gpu_blocks + 1)
    planner = OffloadPlanner(FULL, gpu, 64, PlannerConfig())
    return BatchScheduler(FULL, gpu, planner, token_budget=token_budget, max_running=8, **kw)


def _offload(sched: BatchScheduler, *reqs: Request) -> None:
    """Run ``reqs`` to their finish, store their blocks in the CPU tier and drop the GPU copy:
    a later request with their prefix hits in the CPU tier only."""
    for req in reqs:
        sched.add(SeqBlocks(req))
    scheduled, _ = sched.schedule_step()
    assert set(scheduled) == {r.request_id for r in reqs}
    sched.advance(scheduled, lambda seq: True)
    cpu = sched.planner.cpu_pool
    want = sum(r.num_tokens // 16 for r in reqs)
    for step in range(8):
        _, meta = sched.schedule_step()
        sched.deliver([], [meta.store.event] if meta.store.event >= 0 else [], step=step)
        if cpu.num_cached_keys == want:
            break
    assert cpu.num_cached_keys == want and not sched.busy
    assert sched.gpu.reset_prefix_cache()


def _load_event(meta, rid: str) -> None:
    assert meta.load.event >= 0 and rid in meta.load_event_to_reqs[meta.load.event]


@pytest.mark.parametrize("full_isl", [True, False], ids=["full-isl", "first-chunk"])
def test_landed_load_waits_holding_its_blocks_and_preempts_nobody(full_isl):
    # 8 GPU blocks. b's first 48 tokens are in the CPU tier only: b takes 3 blocks for its
    # load, c (64 tokens, running) 4, and c's decode the last one while the load runs. When the
    # load lands, b's next 16 tokens need a block and none is free. vLLM keeps b waiting with
    # its blocks (kv_holding_waiting) and allocates its chunk without preempting: b waits,
    # nobody is preempted (had b joined `running` when its load landed, its chunk would preempt
    # the newest running request, b itself, throwing the load away).
    sched = _tiered(8, reserve_full_isl=full_isl)
    _offload(sched, _request(FULL, "x", 1, 64))
    c, b = SeqBlocks(_request(FULL, "c", 2, 64)), SeqBlocks(_request(FULL, "b", 1, 64))
    sched.add(c)
    sched.add(b)
    scheduled, meta = sched.schedule_step()
    assert scheduled == {"c": 64} and list(sched.loading) == ["b"]
    _load_event(meta, "b")
    loaded = list(b.tables[0])
    assert len(loaded) == 3 and sched.gpu.num_free_blocks == 1
    sched.advance(scheduled, lambda seq: False)
    scheduled, _ = sched.schedule_step()  # c's 65th token takes the last free block
    assert scheduled == {"c": 1} and sched.gpu.num_free_blocks == 0
    sched.advance(scheduled, lambda seq: False)
    sched.deliver(["b"], [], step=2)
    assert b not in sched.running and list(sched.loading) == ["b"]
    for _ in range(3):  # c decodes within its 5th block; b waits with its blocks
        scheduled, _ = sched.schedule_step()
        assert scheduled == {"c": 1} and sched.preemptions == 0
        assert sched.running == [c] and list(sched.loading) == ["b"] and b.tables[0] == loaded
        sched.advance(scheduled, lambda seq: False)
    # Reached in the waiting phase, its loaded blocks joined the GPU prefix cache.
    assert all(sched.gpu.block_hash(blk) is not None for blk in loaded)
    scheduled, _ = sched.schedule_step()
    sched.advance(scheduled, lambda seq: True)  # c finishes: its blocks are free
    scheduled, _ = sched.schedule_step()
    assert scheduled == {"b": 16} and sched.running == [b] and not sched.loading
    assert b.tables[0][:3] == loaded and sched.preemptions == 0
    assert sched.cpu_hit_tokens == 48  # b's, counted once at its admission


@pytest.mark.parametrize("full_isl", [True, False], ids=["full-isl", "first-chunk"])
def test_cpu_hit_admission_leaves_what_inflight_prefills_still_need(full_isl):
    # 8 GPU blocks; x's and y's blocks are in the CPU tier only. b1 (96 tokens) loads its first
    # 64 into 4 blocks and will need 2 more for the rest of its prompt. b2's load (48 tokens)
    # needs 3: 4 are free, but 2 of them are b1's. vLLM admits an async load only into the
    # free blocks minus what in-flight prefills still need (_inflight_prefill_reserved_blocks),
    # so b2 waits, though the plain free count would admit it.
    sched = _tiered(8, reserve_full_isl=full_isl)
    _offload(sched, _request(FULL, "x", 1, 64), _request(FULL, "y", 2, 64))
    b1, b2 = SeqBlocks(_request(FULL, "b1", 1, 96)), SeqBlocks(_request(FULL, "b2", 2, 64))
    sched.add(b1)
    sched.add(b2)
    scheduled, meta = sched.schedule_step()
    assert scheduled == {} and list(sched.loading) == ["b1"] and list(sched.waiting) == [b2]
    _load_event(meta, "b1")
    assert sched.gpu.num_free_blocks == 4
    assert sum(sched.blocks_to_hold(b1.tables, 96, 64)) == 2
    assert sum(sched.blocks_needed(b2.tables, 48)) == 3 and b2.tables == [[]]
    # Once b1 is done the CPU hit of b2 is admitted: b1's table is held until its finish
    # flush (its two computed blocks) completes (PlannerConfig.hold_finished), then freed.
    sched.deliver(["b1"], [], step=1)
    scheduled, _ = sched.schedule_step()
    assert scheduled == {"b1": 32} and list(sched.waiting) == [b2]
    sched.advance(scheduled, lambda seq: True)
    scheduled, meta = sched.schedule_step()
    assert scheduled == {} and list(sched.waiting) == [b2] and len(meta.store) == 2
    assert sched.gpu.num_free_blocks == 2
    sched.deliver([], [meta.store.event], step=3)
    scheduled, _ = sched.schedule_step()
    assert list(sched.loading) == ["b2"] and len(b2.tables[0]) == 3
    assert sched.cpu_hit_tokens == 64 + 48


@pytest.mark.parametrize("full_isl", [True, False], ids=["full-isl", "first-chunk"])
def test_cpu_lookup_is_made_even_when_one_more_token_does_not_fit(full_isl):
    # c (120 tokens) holds all 8 GPU blocks; b's prefix is in the CPU tier. vLLM asks the
    # connector for every waiting request it reaches before it tries to allocate, and the
    # lookup touches the CPU blocks it matches (their eviction order changes): b's lookup is
    # made every step, though not even one more token fits.
    sched = _tiered(8, reserve_full_isl=full_isl)
    _offload(sched, _request(FULL, "x", 1, 64))
    c, b = SeqBlocks(_request(FULL, "c", 2, 120)), SeqBlocks(_request(FULL, "b", 1, 64))
    sched.add(c)
    scheduled, _ = sched.schedule_step()
    assert scheduled == {"c": 120} and sched.gpu.num_free_blocks == 0
    sched.advance(scheduled, lambda seq: False)
    calls = []
    lookup = sched.planner.get_num_new_matched_tokens

    def spy(req, num_computed_tokens):
        out = lookup(req, num_computed_tokens)
        calls.append((req.request_id, num_computed_tokens, out[0]))
        return out

    sched.planner.get_num_new_matched_tokens = spy
    sched.add(b)
    for step in range(2):
        scheduled, _ = sched.schedule_step()
        assert scheduled == {"c": 1} and list(sched.waiting) == [b] and not sched.loading
        sched.advance(scheduled, lambda seq: False)
        assert calls == [("b", 0, 48)] * (step + 1)


def test_full_isl_admits_a_request_only_when_its_whole_prompt_fits():
    # 8 GPU blocks, c (60 tokens) holds 4. b's first chunk (63 tokens of the 64-token budget
    # left after c's decode) needs 4 blocks and 4 are free, but its 96-token prompt needs 6.
    # vLLM's default (scheduler_reserve_full_isl) admits b only when all 6 fit; with it off,
    # b is admitted on its first chunk.
    def run(**kw):
        sched = BatchScheduler(FULL, BlockPool(8 + 1), None, token_budget=64, max_running=8,
                               **kw)
        c = SeqBlocks(_request(FULL, "c", 1, 60))
        sched.add(c)
        scheduled, _ = sched.schedule_step()
        assert scheduled == {"c": 60}
        sched.advance(scheduled, lambda seq: False)
        b = SeqBlocks(_request(FULL, "b", 2, 96))
        sched.add(b)
        scheduled, _ = sched.schedule_step()
        assert sched.blocks_to_hold([[]], 96) == [6] and sched.blocks_needed([[]], 63) == [4]
        return scheduled, sched

    scheduled, sched = run()
    assert scheduled == {"c": 1} and sched.gpu.num_free_blocks == 4 and sched.reserve_full_isl
    scheduled, sched = run(reserve_full_isl=False)
    assert scheduled == {"c": 1, "b": 63} and sched.gpu.num_free_blocks == 0


def test_full_isl_counts_a_sliding_window_as_vllm_caps_it():
    # vLLM reserves for a sliding-window group at most the pages it holds at once (window - 1
    # plus one step's tokens, plus one: SlidingWindowSpec.max_admission_blocks_per_request);
    # full attention holds every page. 40-token window, 16-token blocks, 16-token steps:
    # ceil(55 / 16) + 1 = 5 pages. Out-of-window positions of a hit are null and not counted.
    sched = BatchScheduler(SLIDING, BlockPool(64), None, token_budget=16, max_running=4)
    assert sched.blocks_to_hold([[], []], 200) == [13, 5]
    assert sched.blocks_to_hold([[], []], 48) == [3, 3]
    assert sched.blocks_to_hold([[1] * 8, [NULL_BLOCK] * 5 + [1] * 3], 200, 128) == [5, 0]


def test_cpu_hit_past_the_window_leaves_the_gpu_hits_window_pages_alone():
    # y's 48 tokens are in the GPU prefix cache (3 pages per group, all free); b's CPU hit
    # reaches 144 tokens, where the 40-token window starts at token 105: the sliding window's
    # pages 0..5 are out of it. vLLM skips the local hit's blocks that are out of the window at
    # the local plus external hit (add_local_computed_blocks): they stay free, unheld, while
    # the load runs. Full attention takes its 3 hit pages.
    gpu = BlockPool(64 + 1)
    sched = BatchScheduler(SLIDING, gpu, None, token_budget=512, max_running=8)
    sched.add(SeqBlocks(_request(SLIDING, "y", 1, 49)))
    scheduled, _ = sched.schedule_step()
    sched.advance(scheduled, lambda seq: True)
    b = SeqBlocks(_request(SLIDING, "b", 1, 160))
    hit = sched.gpu_hit(b.req)
    assert hit.num_tokens == 48 and all(NULL_BLOCK not in t and len(t) == 3 for t in hit.blocks)
    sched.cpu_hit = lambda req, local: 144 - local  # the CPU tier holds b's next 96 tokens
    sched.add(b)
    free = gpu.num_free_blocks
    scheduled, _ = sched.schedule_step()
    assert scheduled == {} and list(sched.loading) == ["b"] and b.pending_ext == 96
    assert b.tables[0][:3] == hit.blocks[0] and NULL_BLOCK not in b.tables[0]
    assert b.tables[1][:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in b.tables[1][6:]
    assert all(map(gpu.is_free, hit.blocks[1])) and not any(map(gpu.is_free, hit.blocks[0]))
    assert free - gpu.num_free_blocks == 3 + 6 + 3  # full: hit + 6 new; window: 3 new
