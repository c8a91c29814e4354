"""Second-sight admission and GPU-hit refresh, driven through the planner harness."""

from __future__ import annotations

import pytest
from planner_harness import Harness, tokens_for

from kvtriton.eviction import ARCQueue
from kvtriton.planner import PlannerConfig
from kvtriton.pool import BlockPool


def _store_steps(h: Harness, rid: str, tokens: list[int]):
    """Admit ``rid``, prefill, decode one step, completing both steps' stores; return the
    GPU blocks stored."""
    req = h.request(rid, tokens)
    h.admit(req)
    stored = []
    for meta in (h.step({rid: req.num_tokens - req.num_computed_tokens}), h.step({rid: 1})):
        stored += meta.store.gpu_blocks
        h.complete(meta)
    return req, stored


@pytest.mark.parametrize("scan", ["fused", "loop"])
def test_second_sight_stores_a_key_once_a_second_request_holds_it(scan):
    h = Harness(config=PlannerConfig(scan=scan, admission="second"))
    _, stored = _store_steps(h, "a", tokens_for(1, 161))
    assert stored == []  # first sight: nothing stored
    assert h.planner.stats.admission_skipped == 10
    h.finish("a")
    # b shares a's first 96 tokens (6 blocks) and then differs.
    b, _ = _store_steps(h, "b", tokens_for(1, 96) + tokens_for(2, 65))
    stored = [k for k in h.primary_keys(b)[:10].tolist() if k in h.cpu]
    assert stored == h.primary_keys(b)[:6].tolist()  # exactly the keys seen twice
    h.check_invariants()


def test_admission_all_is_the_negative_control():
    h = Harness(config=PlannerConfig(admission="all"))
    _, stored = _store_steps(h, "a", tokens_for(1, 161))
    assert len(stored) == 10 and h.planner.stats.admission_skipped == 0


def test_second_sight_holds_back_the_finish_flush_too():
    h = Harness(config=PlannerConfig(admission="second"))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step({"a": a.num_tokens})
    h.finish("a")  # the flush would store the 10 confirmed blocks
    assert h.step().store.gpu_blocks == []


def test_admission_second_with_lazy_is_refused():
    with pytest.raises(ValueError, match="admission 'second'"):
        PlannerConfig(lazy=True, admission="second")
    with pytest.raises(ValueError, match="admission must be"):
        PlannerConfig(admission="often")


def _cpu_order_after_gpu_hit(refresh: bool) -> tuple[list[int], list[int], list[int]]:
    """a and c stored in that order (a's CPU blocks the next LRU victims); then b hits a's
    prefix in the GPU. Returns the CPU free order and a's and c's CPU blocks."""
    h = Harness(num_gpu_blocks=64, cpu=64, config=PlannerConfig(refresh_on_gpu_hit=refresh))
    a, _ = _store_steps(h, "a", tokens_for(1, 161))
    h.finish("a")
    c, _ = _store_steps(h, "c", tokens_for(3, 161))
    h.finish("c")
    h.step()
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)  # GPU prefix hit on a's blocks
    a_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(a)[:10]]
    c_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(c)[:10]]
    order = [x for x in h.cpu.iter_free() if h.cpu.block_hash(x) is not None]
    h.check_invariants()
    return order, a_cpu, c_cpu


def test_a_gpu_hit_refreshes_the_cpu_copies_tail_first():
    order, a_cpu, c_cpu = _cpu_order_after_gpu_hit(refresh=True)
    # b's GPU hit covers a's 10 blocks: their copies are now newer than c's, chain head last.
    hit = a_cpu[:10]
    assert order[-len(hit):] == hit[::-1]
    assert max(order.index(x) for x in c_cpu) < min(order.index(x) for x in hit)


def test_without_refresh_the_cpu_order_is_store_time():
    order, a_cpu, c_cpu = _cpu_order_after_gpu_hit(refresh=False)
    assert order.index(a_cpu[0]) < order.index(c_cpu[0])  # negative control: a still first


def test_refresh_is_reuse_for_arc_once_per_request():
    h = Harness(num_gpu_blocks=64, cpu=BlockPool(64, eviction="arc", medium="CPU"),
                config=PlannerConfig(refresh_on_gpu_hit=True))
    a, _ = _store_steps(h, "a", tokens_for(1, 161))
    h.finish("a")
    q = h.cpu.eviction
    assert isinstance(q, ARCQueue)
    a_cpu = [h.cpu.get_cached_block(int(k)) for k in h.primary_keys(a)[:10]]
    assert all(x in q._first for x in a_cpu)  # T1
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)
    assert all(x in q._second for x in a_cpu)  # another request used them: reuse
    assert h.planner.stats.gpu_hit_refreshed == 10
