"""Admission rules (``kvtriton.planner.admission``): second sight holds an eager store back until
a second request holds the key; hinted admission keeps a lazy tier from offloading the keys a
closed session held last.

``admission="all"`` runs beside each rule as the negative control: the same blocks must then be
stored, so a filter that skipped everything (or nothing) fails.
"""

from __future__ import annotations

import pytest

from helpers.planner_driver import PlannerDriver, store_prompt, tokens_for
from kvtriton.planner import PlannerConfig
from kvtriton.sim import agent_workload, simulate

# ---- second sight (eager stores) -----------------------------------------------------------------


@pytest.mark.parametrize("scan", ["fused", "loop"])
def test_second_sight_stores_a_key_once_a_second_request_holds_it(scan):
    h = PlannerDriver(config=PlannerConfig(scan=scan, admission="second"))
    _, stored = store_prompt(h, "a", tokens_for(1, 161))
    assert stored == []  # first sight: nothing stored
    assert h.planner.stats.admission_skipped == 10
    h.finish("a")
    # b shares a's first 96 tokens (6 blocks) and then differs.
    b, _ = store_prompt(h, "b", tokens_for(1, 96) + tokens_for(2, 65))
    stored = [k for k in h.primary_keys(b)[:10].tolist() if k in h.cpu]
    assert stored == h.primary_keys(b)[:6].tolist()  # exactly the keys seen twice
    h.check_invariants()


def test_admission_all_is_the_negative_control():
    h = PlannerDriver(config=PlannerConfig(admission="all"))
    _, stored = store_prompt(h, "a", tokens_for(1, 161))
    assert len(stored) == 10 and h.planner.stats.admission_skipped == 0


def test_second_sight_holds_back_the_finish_flush_too():
    h = PlannerDriver(config=PlannerConfig(admission="second"))
    a = h.request("a", tokens_for(1, 161))
    h.admit(a)
    h.step({"a": a.num_tokens})
    h.finish("a")  # the flush would store the 10 confirmed blocks
    assert h.step().store.gpu_blocks == []


# ---- hinted admission (lazy mode) ----------------------------------------------------------------


def lazy(admission: str) -> PlannerConfig:
    return PlannerConfig(lazy=True, lazy_target_blocks=64, admission=admission)


STORED: dict[int, list[int]] = {}


def step(h: PlannerDriver, **kw) -> None:
    """One step with its transfers completed; the GPU blocks it stored are noted."""
    m = h.step(**kw)
    STORED.setdefault(id(h), []).extend(m.store.gpu_blocks)
    h.complete(m)


def run_and_finish(h: PlannerDriver, rid: str, tokens: list[int], hint: str | None) -> list[int]:
    """Admit, prefill and decode ``rid``, finish it with ``hint``; its GPU table."""
    req = h.request(rid, tokens)
    h.admit(req)
    step(h)
    step(h, decode=True)
    table = list(h.running[rid].tables[0])
    h.running[rid].hint = hint
    h.finish(rid)
    return table


def offload_all(h: PlannerDriver) -> list[int]:
    """Steps until the lazy walk finds nothing more; every GPU block stored so far."""
    for _ in range(8):
        step(h)
    return STORED.pop(id(h), [])


@pytest.mark.parametrize("admission", ["all", "hinted"])
def test_a_closed_sessions_blocks_are_not_offloaded(admission):
    h = PlannerDriver(num_gpu_blocks=64, config=lazy(admission))
    closed = run_and_finish(h, "a", tokens_for(1, 161), "close")
    open_ = run_and_finish(h, "b", tokens_for(2, 161), None)
    stored = set(offload_all(h))
    assert set(open_[:10]) <= stored
    if admission == "hinted":
        assert not stored & set(closed[:10])
        assert h.planner.stats.admission_skipped == 10  # counted once per key
        assert h.planner._lazy.num_closed == 10
    else:
        assert set(closed[:10]) <= stored
        assert h.planner.stats.admission_skipped == 0
    h.check_invariants()


@pytest.mark.parametrize("hint", ["continue", None])
def test_a_later_holder_admits_a_closed_key_again(hint):
    """A new request holding the closed prefix (a GPU prefix hit) takes its keys out of the
    closed set at its admission; once it finishes without ``close`` they are offloaded."""
    h = PlannerDriver(num_gpu_blocks=64, config=lazy("hinted"))
    first = run_and_finish(h, "a", tokens_for(1, 161), "close")
    assert h.planner._lazy.num_closed == 10
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)
    assert h.planner._lazy.num_closed == 0
    step(h)
    step(h, decode=True)
    h.running["b"].hint = hint
    h.finish("b")
    assert set(first[:10]) <= set(offload_all(h))
    assert h.planner.stats.admission_skipped == 0


def test_a_close_after_another_finish_wins():
    """The last holder's hint decides: a key closed after an open finish is held back."""
    h = PlannerDriver(num_gpu_blocks=64, config=lazy("hinted"))
    run_and_finish(h, "a", tokens_for(1, 161), None)
    b = h.request("b", tokens_for(1, 161))
    h.admit(b)
    step(h)
    step(h, decode=True)
    h.running["b"].hint = "close"
    h.finish("b")
    assert offload_all(h) == []
    assert h.planner.stats.admission_skipped == 10


def test_the_closed_set_forgets_keys_the_gpu_evicts():
    """Bounded memory: a closed key leaves the set when its GPU block is evicted."""
    h = PlannerDriver(num_gpu_blocks=64, config=lazy("hinted"))
    run_and_finish(h, "a", tokens_for(1, 161), "close")
    assert h.planner._lazy.num_closed == 10
    for b in list(h.gpu.iter_free()):
        h.gpu.evict_cached(b)
    assert h.planner._lazy.num_closed == 0


def test_a_bad_hint_is_refused_and_changes_nothing():
    h = PlannerDriver(num_gpu_blocks=64, config=lazy("hinted"))
    req = h.request("a", tokens_for(1, 161))
    h.admit(req)
    h.step()
    with pytest.raises(ValueError, match="'later'"):
        h.planner.request_finished(req, hint="later")
    assert h.planner.has_request("a")
    h.check_invariants()


def test_hinted_admission_in_the_serving_loop():
    """On the agent generator (every session's last turn closes) hinted admission holds back
    closed keys and stores fewer blocks than plain lazy, with every byte checked."""
    wl = agent_workload(num_conversations=6, min_turns=3, max_turns=5, seed=1)
    res = simulate(wl, gpu_tokens=16384, cpu_tokens=16384, setups=["lazy", "lazy+hinted"],
                   references=(), integrity=True)
    plain, hinted = res.rows
    assert plain["admission_skipped"] == 0 < hinted["admission_skipped"]
    assert hinted["lazy_stored"] < plain["lazy_stored"]
    assert hinted["finished"] == plain["finished"] == len(wl.requests)
