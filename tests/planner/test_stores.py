"""The store lifecycle (``kvtriton.planner.stores``, ``kvtriton.planner.store_batches``): tables
kept in step over a chunked prefill, completed stores registered under every key of their GPU
block and freed in the configured order, a finish while a store is in flight, and the finish flush.
"""

from __future__ import annotations

import pytest

from helpers.planner_driver import (
    ALIAS_TINY,
    HYBRID_TINY,
    SCANS,
    PlannerDriver,
    lookup,
    stored_prompt,
    tokens_for,
)
from kvtriton.planner import PlannerConfig, ScanOutcomes

# ---- tables, registration, the CPU free order ----------------------------------------------------


def test_chunked_prefill_stores_blocks_allocated_in_later_steps():
    h = PlannerDriver()
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    stores = [h.step({"a": n}).store.gpu_blocks for n in (64, 64, 33, 1)]
    table = h.running["a"].tables[0]
    assert table == list(range(1, 12))
    assert stores == [[], table[0:4], table[4:8], table[8:10]]
    assert [h.planner.cursor("a")] == [10]


@pytest.mark.parametrize("scan", SCANS)
def test_alias_hashes_preserved(scan):
    h = PlannerDriver(ALIAS_TINY, config=PlannerConfig(scan=scan))
    a, m = stored_prompt(h, "a", tokens_for(1, 161))  # five 32-token blocks, ten hash boundaries
    assert len(m.store) == 5
    keys = a.keys[0].tolist()
    for i, c in enumerate(m.store.cpu_blocks):
        assert h.cpu.block_keys(c) == (keys[2 * i + 1], keys[2 * i])
    assert all(k in h.cpu for k in keys[:10])


@pytest.mark.parametrize("order", ["tail_first", "head_first"])
def test_cpu_lru_eviction_order_follows_free_order(order):
    h = PlannerDriver(cpu=10, config=PlannerConfig(cpu_free_order=order))
    a, _ = stored_prompt(h, "a", tokens_for(1, 161))
    h.finish("a")
    keys = h.primary_keys(a)[:10].tolist()
    queue = [h.cpu.block_hash(b) for b in h.cpu.iter_free()]
    assert queue == (keys[::-1] if order == "tail_first" else keys)
    stored_prompt(h, "b", tokens_for(2, 65))  # 4 blocks: the CPU evicts 4 of a's
    survivors = [k in h.cpu for k in keys]
    if order == "tail_first":  # the chain's tail goes first; its head stays hittable
        assert survivors == [True] * 6 + [False] * 4
        assert lookup(h, "x", tokens_for(1, 161)) == 96
        assert (h.planner.stats.chain_holes, h.planner.stats.lookups_with_holes) == (0, 0)
    else:  # the head goes first: the remaining 6 blocks are unreachable orphans
        assert survivors == [False] * 4 + [True] * 6
        assert lookup(h, "x", tokens_for(1, 161)) == 0
        assert (h.planner.stats.chain_holes, h.planner.stats.lookups_with_holes) == (6, 1)


@pytest.mark.parametrize("hold", [True, False])
def test_finish_while_store_in_flight_defers_cleanup(hold):
    h = PlannerDriver(config=PlannerConfig(hold_finished=hold))
    a, m = stored_prompt(h, "a", tokens_for(1, 161), complete=False)
    sources = m.store.gpu_blocks
    h.finish("a")
    assert h.planner.has_request("a")
    # The store's pins outlive the table; held, the finished table's own reference does too.
    assert [h.gpu.ref_cnt[b] for b in sources] == [2 if hold else 1] * 10
    assert h.planner.held_after_finish() == (sources[::-1] if hold else [])
    h.check_invariants()
    assert h.cpu_prefix_blocks(a) == 0
    h.complete(m)
    assert not h.planner.has_request("a") and h.planner.held_after_finish() == []
    assert h.cpu_prefix_blocks(a) == 10
    assert h.gpu.num_used_blocks == 0 and h.cpu.num_used_blocks == 0


@pytest.mark.parametrize("hold", [True, False])
def test_finished_table_joins_the_gpu_free_queue_tail_first(hold):
    """A 10-block prompt prefilled in two chunks: blocks 0-5 are stored by the second step's
    batch, still in flight when the request finishes, and 6-9 by the finish flush, issued a
    step later (the order of a serving loop, where the first batch completes in between).
    Held until its last store completes, the table joins the GPU free queue tail first, as
    without a CPU tier: GPU pressure evicts the chain's tail and the next turn still hits its
    head. Released store by store (vLLM's SimpleCPUOffloadConnector) the sources join head
    first, in store order: the first eviction takes block 0 and the whole prefix is lost."""
    h = PlannerDriver(num_gpu_blocks=16,
                      config=PlannerConfig(cpu_free_order="head_first", hold_finished=hold))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step({"a": 96})
    first = h.step({"a": 65})  # stores blocks 0-5 of the first chunk
    keys = h.primary_keys(a)[:10].tolist()
    h.finish("a")
    h.complete(first)  # the flush of 6-9 is still queued: the request's state stays
    assert h.planner.has_request("a")
    assert len(h.planner.held_after_finish()) == (10 if hold else 0)
    flush = h.step({})
    assert len(first.store) == 6 and len(flush.store) == 4
    h.complete(flush)
    h.check_invariants()
    assert not h.planner.has_request("a") and h.planner.held_after_finish() == []
    queue = [h.gpu.block_hash(b) for b in h.gpu.iter_free() if h.gpu.block_hash(b) is not None]
    assert queue == (keys[::-1] if hold else keys)
    h.gpu.free_blocks(h.gpu.get_new_blocks(h.gpu.num_free_blocks - 6))  # 4 of a's evicted
    assert h.gpu_hit(h.request("b", tokens_for(1, 170))).num_tokens == (96 if hold else 0)


# ---- finish flush (PR #53532) --------------------------------------------------------------------


@pytest.mark.parametrize("tail_cached", [False, True])
def test_finish_flush_stores_the_fine_grained_prompt_tail(tail_cached):
    """An 81-token prompt ends 16 tokens into its third 32-token block. When the scheduler
    cached that partial block under the prompt's last hash boundary (vLLM's partial-tail
    caching), the finish flush stores it too, and a fine-grained lookup reaches the boundary."""
    h = PlannerDriver(ALIAS_TINY, config=PlannerConfig(fine_grained=True))
    a = h.request("a", tokens_for(1, 81))
    h.admit(a)
    h.step()
    table = h.running["a"].tables[0]
    if tail_cached:
        h.gpu.cache_block(table[2], int(a.keys[0, 4]))
    h.finish("a")
    m = h.step()
    assert m.store.gpu_blocks == (table if tail_cached else table[:2])
    h.complete(m)
    assert lookup(h, "b", tokens_for(1, 81)) == (80 if tail_cached else 64)


def test_finish_flush_batches_finishing_requests_into_one_store():
    h = PlannerDriver()
    a, b = h.request("a", tokens_for(1, 161)), h.request("b", tokens_for(2, 161))
    h.admit(a)
    h.admit(b)
    h.step()  # prefilled, never stored: the requests finish before their next step
    ta, tb = h.running["a"].tables[0][:10], h.running["b"].tables[0][:10]
    h.finish("a")
    h.finish("b")
    assert h.planner.has_pending_stores() and h.planner.pending_store_blocks() == 20
    assert h.planner.has_request("a")
    m = h.step()
    assert (m.store.event, m.store.gpu_blocks, m.store.cpu_blocks) == (
        0, ta + tb, list(range(1, 21)))
    assert h.planner.stats.flush_stored == 20 and h.planner.stats.scan == ScanOutcomes()
    h.complete(m)
    assert not h.planner.has_request("a") and not h.planner.has_pending_stores()
    assert lookup(h, "x", tokens_for(1, 161)) == 160
    assert lookup(h, "y", tokens_for(2, 161)) == 160


def test_finish_flush_skips_hashes_already_cached():
    h = PlannerDriver()
    a = h.request("a", tokens_for(1, 161))
    b = h.request("b", tokens_for(1, 160) + tokens_for(2, 40))
    h.admit(a)
    h.admit(b)
    h.step()
    h.complete(h.step({"a": 1, "b": 0}))  # a's ten blocks; b was not scanned
    assert h.planner.cursor("b") == 0
    btable = h.running["b"].tables[0]
    h.finish("b")  # b's first ten blocks hold keys a stored: only its two own are queued
    assert h.planner.pending_store_blocks() == 2
    m = h.step({"a": 1})
    assert m.store.gpu_blocks == btable[10:12]
    assert h.planner.stats.flush_stored == 2


def test_finish_flush_multi_group():
    h = PlannerDriver(HYBRID_TINY)
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    tables = [t[:10] for t in h.running["a"].tables]
    h.finish("a")
    m = h.step()
    assert m.store.gpu_blocks == tables[0] + tables[1]
    assert m.store.groups == [0] * 10 + [1] * 10


def test_finish_flush_stops_at_free_cpu_blocks():
    h = PlannerDriver(cpu=6)
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    table = h.running["a"].tables[0]
    h.finish("a")
    assert h.planner.stats.flush_stored == 6
    m = h.step()
    assert m.store.gpu_blocks == table[:6]
    h.complete(m)
    assert lookup(h, "x", tokens_for(1, 161)) == 96


def test_reset_releases_the_finish_flush_queue():
    h = PlannerDriver()
    h.admit(h.request("a", tokens_for(1, 161)))
    h.step()
    h.finish("a")
    assert h.cpu.num_used_blocks == 10 and h.gpu.num_used_blocks == 10
    assert h.planner.reset()
    assert h.cpu.num_used_blocks == 0 and h.gpu.num_used_blocks == 0
    assert not h.planner.has_pending_stores()
    assert h.step().store.event == -1


def test_finish_after_preemption_and_reallocation_flushes_the_final_table():
    """A request preempted (its row released), allocated again on a GPU prefix hit, and
    aborted before any step carried its new table: its flush must store the hit blocks the CPU
    lacks from the table the scheduler hands over at the end, as vLLM's manager does."""
    h = PlannerDriver()
    req = h.request("a", tokens_for(5, 4 * 16 + 1))
    h.admit(req)
    h.step({"a": req.num_tokens})  # prefilled; its blocks would be stored by the next step
    h.preempt("a")
    h.step({})  # reports the preemption: the row goes
    assert h.cpu.num_cached_keys == 0
    assert h.resume("a") == (4 * 16, 0)  # the GPU prefix cache still holds its 4 blocks
    tables = tuple(list(t) for t in h.running["a"].tables)
    h.planner.request_finished(req, tables)
    flush = h.planner.queued_flush()
    assert flush.gpu_blocks == tables[0][:4]
    m = h.step({})  # the flush goes out with the next batch
    assert m.store.gpu_blocks == tables[0][:4]


# ---- a step of many requests: rows read in C-level passes -------------------------------------


def _many_requests_run(monkeypatch, passes_from: int) -> list[tuple]:
    """40 requests prefilled over chunks, then decoding, with CPU evictions between steps (so
    re-stores join the new stores); every step's store pairs, keys and the cursors."""
    import kvtriton.planner.store_batches as store_batches

    monkeypatch.setattr(store_batches, "_ROW_PASSES_FROM", passes_from)
    h = PlannerDriver(num_gpu_blocks=1024, cpu=1024, config=PlannerConfig(restore=True))
    reqs = [h.request(f"r{i:02d}", tokens_for(i + 1, 80 + 16 * (i % 5))) for i in range(40)]
    for r in reqs:
        h.admit(r)
    seen = []
    for step in range(8):
        scheduled = {r.request_id: 32 for r in reqs if r.request_id in h.running}
        meta = h.step(scheduled) if step < 4 else h.step(decode=True)
        seen.append((meta.store.gpu_blocks, meta.store.cpu_blocks,
                     [h.planner.cursor(r.request_id) for r in reqs]))
        h.complete(meta)
        cached = [b for b in h.cpu.iter_free() if h.cpu.block_hash(b) is not None]
        for b in cached[::7]:
            h.cpu.evict_cached(b)
    return seen


def test_rows_of_many_requests_read_in_passes_as_in_the_loop(monkeypatch):
    """Past ``_ROW_PASSES_FROM`` requests a step's rows and confirmed tokens are read in C-level
    passes; the same run through the per-request loop selects the same blocks every step."""
    passes = _many_requests_run(monkeypatch, 32)
    loop = _many_requests_run(monkeypatch, 10**9)
    assert passes == loop
    assert sum(len(g) for g, _, _ in passes) > 40  # stores and re-stores happened
