"""Setups by name, continuation hints and the waiting-queue lookahead in vLLM's real ``Scheduler``
(``KVTritonConnector``'s scheduler role; no model is run, ``helpers.vllm_driver`` steps it).

Hints reach the connector in a request's ``kv_transfer_params``, as vLLM builds it from
``SamplingParams.extra_args``; the lookahead sees the waiting queue through the connector API
alone (``on_new_request``, admission, finish). Each effect is checked against the same schedule
without the signal, where the tier's plain eviction order keeps the other blocks.
"""

from __future__ import annotations

import contextlib
import logging
import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.tier_study.study import ABLATION, COMBINED
from helpers.vllm_driver import BS, assert_idle, build, cpu_hashes, run, tokens
from kvtriton.setups import tier_setup
from kvtriton.sim.vllm_scheduler import vllm_request
from kvtriton.vllm.signals import HINT_KEY, LOGGED_CHARS, shorten

pytestmark = pytest.mark.scheduler_role

PROMPT_BLOCKS = 4
TIER_BLOCKS = 2 * PROMPT_BLOCKS  # holds two finished prompts, nothing more


def request(rid, seed, n_blocks, max_tokens=2, hint=None):
    r = vllm_request(rid, tokens(seed, n_blocks * BS), max_tokens, BS)
    if hint is not None:
        r.kv_transfer_params = {HINT_KEY: hint}  # what SamplingParams.extra_args gives
    return r


@contextlib.contextmanager
def kvtriton_warnings():
    """The warnings kvtriton's loggers emit inside the block, as log records. Our own handler on
    kvtriton's logger: what reaches the root (caplog) depends on the handlers vLLM and earlier
    tests installed, which once showed a warning twice."""
    records: list[logging.LogRecord] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = records.append
    ours = logging.getLogger("kvtriton")
    level = ours.level
    ours.addHandler(catch)
    ours.setLevel(logging.WARNING)
    try:
        yield records
    finally:
        ours.removeHandler(catch)
        ours.setLevel(level)


def serve(drv, side, req) -> set[bytes]:
    """Serve ``req`` to the end; the hashes the CPU tier gained."""
    before = cpu_hashes(side)
    drv.add(req)
    run(drv)
    return cpu_hashes(side) - before


# ---- every online setup of the study, by name ----------------------------------------------------


@pytest.mark.parametrize("setup", sorted(set(ABLATION + COMBINED)))
def test_every_online_setup_of_the_study_runs_by_name(model_config_dir, setup):
    """The simulator's ablation and combinations, each turned on by its composition alone: the
    connector runs the planner and eviction the setup parses to, and serves to an idle end."""
    s, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS, extra_config={"setup": setup})
    tier = tier_setup(setup)
    assert side.config.setup == tier.composition
    name, _, window = tier.cpu_eviction.partition(":")
    queue = side.cpu_pool.eviction
    assert queue.name.split("+")[0] == name
    if window:  # lfu:W: the connector's sketch ages on the window the setup names
        base = getattr(queue, "base", queue)
        assert base.window_tiers == float(window)
    p = side.planner.config
    assert (p.restore, p.cpu_free_order, p.restore_share, p.lazy, p.admission,
            p.refresh_on_gpu_hit) == (
        tier.planner.restore, tier.planner.cpu_free_order, tier.planner.restore_share,
        tier.planner.lazy, tier.planner.admission, tier.planner.refresh_on_gpu_hit)
    for i in range(3):
        serve(drv, side, request(f"r{i}", i % 2, PROMPT_BLOCKS, hint="continue"))
    assert_idle(s, side)


# ---- hints ---------------------------------------------------------------------------------------


# (hint of the older request, hint of the newer one, the one whose blocks the filler evicts)
HINT_CASES = [
    (None, None, "older"),  # the negative control: LRU evicts the older request's blocks
    (None, "close", "newer"),  # a closed session's blocks go first
    ("continue", None, "newer"),  # a turn hinted continue is protected
    (None, "later", "older"),  # a malformed hint is no hint
]


@pytest.mark.parametrize(("old_hint", "new_hint", "evicted"), HINT_CASES,
                         ids=[f"{a}-{b}" for a, b, _ in HINT_CASES])
def test_hints_decide_which_blocks_the_tier_keeps(model_config_dir, old_hint, new_hint, evicted):
    s, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS,
                         extra_config={"setup": "eager+hints"})
    older = serve(drv, side, request("older", 1, PROMPT_BLOCKS, hint=old_hint))
    with kvtriton_warnings() as records:
        newer = serve(drv, side, request("newer", 2, PROMPT_BLOCKS, hint=new_hint))
    assert len(older) == len(newer) == PROMPT_BLOCKS
    serve(drv, side, request("filler", 3, PROMPT_BLOCKS - 1))  # evicts 3 of the 8 blocks
    held = cpu_hashes(side)
    kept = {"older": len(older & held), "newer": len(newer & held)}
    assert kept[evicted] == 1, kept
    assert kept["older" if evicted == "newer" else "newer"] == PROMPT_BLOCKS, kept
    stats = side.signals.counters  # cumulative (vLLM's stats path reads the deltas each step)
    hints = [h for h in (old_hint, new_hint) if h is not None]
    assert stats["hints_close"] == hints.count("close")
    assert stats["hints_continue"] == hints.count("continue")
    warned = [r.getMessage() for r in records if HINT_KEY in r.getMessage()]
    if new_hint == "later":
        assert stats["malformed_hints"] == 1
        assert len(warned) == 1 and "request newer" in warned[0] and "'later'" in warned[0]
    else:
        assert stats["malformed_hints"] == 0 and not warned
    assert_idle(s, side)


@pytest.mark.parametrize("setup", ["eager", "lazy+hinted"])
def test_hints_to_a_setup_without_hints_are_counted_as_ignored_and_warned_once(
        model_config_dir, setup):
    """A setup without the hints axis or hinted admission does nothing with a hint: LRU as
    without them, the hints counted as ignored (not as applied), one warning per connector.
    With hinted admission (the positive control) they are applied and nothing is warned."""
    _, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS, extra_config={"setup": setup})
    with kvtriton_warnings() as records:
        older = serve(drv, side, request("older", 1, PROMPT_BLOCKS, hint="continue"))
        newer = serve(drv, side, request("newer", 2, PROMPT_BLOCKS, hint="close"))
        serve(drv, side, request("again", 4, PROMPT_BLOCKS - 1, hint="close"))
    counts = side.signals.counters
    warned = [r.getMessage() for r in records if HINT_KEY in r.getMessage()]
    if setup == "eager":
        held = cpu_hashes(side)  # "again" filled the tier: LRU evicted the older blocks
        assert (len(older & held), len(newer & held)) == (1, PROMPT_BLOCKS)
        assert (counts["hints_continue"], counts["hints_close"], counts["hints_ignored"]) \
            == (0, 0, 3)
        assert len(warned) == 1, warned
        assert "request older" in warned[0] and "setup 'eager' uses no hints" in warned[0]
        assert "hints_ignored" in warned[0]
    else:
        assert (counts["hints_continue"], counts["hints_close"], counts["hints_ignored"]) \
            == (1, 2, 0)
        assert not warned


def test_a_huge_hint_or_request_id_is_warned_in_a_bounded_line(model_config_dir):
    """A client's 100,000-character hint (under a 5,000-character request id) is still one
    warning naming the request and the problem, but a few hundred characters long: it used to
    be 100,202."""
    _, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS,
                         extra_config={"setup": "eager+hints"})
    rid = "r" * 5_000
    with kvtriton_warnings() as records:
        serve(drv, side, request(rid, 1, PROMPT_BLOCKS, hint="x" * 100_000))
    warned = [r.getMessage() for r in records]
    assert len(warned) == 1, [w[:300] for w in warned]
    line = warned[0]
    assert len(line) < 3 * LOGGED_CHARS + 200, len(line)
    assert f"kv_transfer_params[{HINT_KEY!r}] = 'xxx" in line and "is not one of" in line
    assert "(100,002 characters, cut at 200)" in line  # the hint's repr
    assert "rrr" in line and "(5,000 characters, cut at 200)" in line
    assert side.signals.counters["malformed_hints"] == 1


def test_shorten_keeps_short_text_and_cuts_long_text_saying_how_long():
    assert shorten("abc") == "abc"
    assert shorten("a" * LOGGED_CHARS) == "a" * LOGGED_CHARS
    cut = shorten("ab" * 150, limit=10)
    assert cut == "ababababab... (300 characters, cut at 10)"


def test_close_spares_blocks_a_later_request_was_admitted_with(model_config_dir):
    """A close covers the blocks its request held last: a prefix a request admitted after it
    shares belongs to that request's future and keeps the plain order."""
    _, side, drv = build(model_config_dir, cpu_blocks=3 * PROMPT_BLOCKS,
                         extra_config={"setup": "eager+hints"})
    shared = serve(drv, side, request("first", 1, PROMPT_BLOCKS))
    # Same prompt, admitted after "first": it is the shared blocks' last holder.
    drv.add(request("closing", 1, PROMPT_BLOCKS, max_tokens=40, hint="close"))
    drv.step()
    drv.add(request("reader", 1, PROMPT_BLOCKS))
    run(drv)
    keys = [side.keys.get(h) for h in shared]
    queue = side.cpu_pool.eviction
    assert {queue.level(k) for k in keys} == {0}  # NORMAL: "reader" holds them last


# ---- waiting-queue lookahead ---------------------------------------------------------------------


@pytest.mark.parametrize("setup", ["eager+waiting", "eager"])
def test_waiting_requests_keys_stay_in_the_tier(model_config_dir, setup):
    """A request waits (one running slot, taken) for a prefix the CPU tier holds, while the
    running request's stores fill the tier: with the lookahead its prefix stays; without it
    (the negative control) LRU evicts it first. Admitted, its keys are plain again."""
    s, side, drv = build(model_config_dir, cpu_blocks=TIER_BLOCKS, max_num_seqs=1,
                         extra_config={"setup": setup})
    prefix = serve(drv, side, request("p", 1, PROMPT_BLOCKS))
    serve(drv, side, request("q", 2, PROMPT_BLOCKS))
    drv.add(request("long", 3, PROMPT_BLOCKS - 1, max_tokens=30))
    drv.add(vllm_request("w", tokens(1, PROMPT_BLOCKS * BS + 5), 2, BS))
    for _ in range(10):  # long's prompt is computed and stored; w still waits
        drv.step()
    assert "w" not in s.running and s.requests["w"] in s.waiting
    kept = len(prefix & cpu_hashes(side))
    assert kept == (PROMPT_BLOCKS if setup == "eager+waiting" else 1)
    run(drv)
    assert side.signals.protected_blocks == 0
    assert_idle(s, side)


# ---- the simulator's vLLM engine feeds the workload's hints -------------------------------------


def test_simulate_on_vllm_passes_each_requests_hint():
    """``simulate(engine="vllm")`` hands every request its workload hint in
    ``kv_transfer_params``, as a server would: under ``lazy+hinted`` the connector holds back
    closed sessions' keys (``admission_skipped``); the same workload with its hints removed (the
    negative control) holds back none."""
    from dataclasses import replace

    from kvtriton.sim import agent_workload, simulate
    from kvtriton.sim.workload import Workload

    wl = agent_workload(num_conversations=4, min_turns=2, max_turns=3, system_prompt_tokens=256,
                        first_user_tokens=128, user_tokens=64, output_tokens=16, seed=5)
    bare = Workload([replace(r, hint=None) for r in wl.requests], wl.hash_block_size, wl.name)
    kw = {"gpu_tokens": 2048, "cpu_tokens": 4096, "setups": ["lazy+hinted"], "bound": False,
          "engine": "vllm"}
    hinted, control = simulate(wl, **kw).rows[0], simulate(bare, **kw).rows[0]
    assert any(r.hint == "close" for r in wl.requests)
    assert hinted["finished"] == control["finished"] == len(wl)
    assert hinted["admission_skipped"] > 0 and control["admission_skipped"] == 0


def test_recycled_key_ids_start_over_in_the_plain_order():
    """A key id the sweep recycles will name another block: its hint level and last holder go
    with the old one (a protected or closed level must not carry over)."""
    import numpy as np

    from kvtriton.eviction import CLOSED, NORMAL, PROTECTED
    from kvtriton.vllm.keys import KeyIds, group_suffixes
    from kvtriton.vllm.signals import TierSignals

    keys = KeyIds()
    ids = np.array([keys.id_of(bytes([i]) * 32) for i in range(4)], dtype=np.int64)
    signals = TierSignals(tier_setup("eager+hints"), keys, group_suffixes(1))
    queue = signals.cpu_pool(8, enable_events=False).eviction
    signals.admitted("a", ids[None, :])
    queue.hint(ids[:2], PROTECTED, lambda _k: None)
    queue.hint(ids[2:], CLOSED, lambda _k: None)
    signals.forget(ids[[0, 2]])
    assert [queue.level(int(k)) for k in ids] == [NORMAL, PROTECTED, NORMAL, CLOSED]
    assert signals.book.last_holder(ids[[0, 2]]).tolist() == [-1, -1]
    assert signals.book.last_holder(ids[[1, 3]]).tolist() == [0, 0]
