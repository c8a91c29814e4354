"""kvtriton's scheduler side against vLLM's own ``SimpleCPUOffloadScheduler``, step for step
(``bench.conformance.differential``: the connector that feeds both, the schedules, the recognised
differences and their evidence, the models kvtriton is held to while the two are apart), and
the negative control: known bug classes (``bench.conformance.differential_mutations``), each applied
by monkeypatch from the start and at the first recognised difference, must be caught in the seeds
where they change what kvtriton does (here a few per class; the by-name study
``differential_mutations`` checks every class in 300 seeds).

``KVTRITON_DIFF_SEEDS`` sets the seed count (CI: ``SEEDS``); ``python -m
bench.conformance.differential`` runs thousands and records the outcome counts (``--mutations``: the
bug classes' table too).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.conformance.differential import MUTATIONS, mutation_table, run_seed, summarise
from bench.conformance.differential_models import HashOrigins, TierModel, expected_flush

pytestmark = pytest.mark.scheduler_role

SEEDS = int(os.environ.get("KVTRITON_DIFF_SEEDS", "100"))
#: Per bug class, seeds where it changes an answer planted from the start and where, planted at
#: the first recognised difference, it is caught while apart (the first of each in
#: ``python -m bench --only differential_mutations``, whose 300 seeds are the whole table: every
#: class caught wherever it changes an answer). CI runs these few.
MUTATION_SEEDS = {
    "bind_dropped": [0, 1, 3],
    "bind_dropped_deep": [0, 1, 18, 30],
    "cursor_moves_after_budget_spent": [3, 11, 126],
    "cursor_not_stopped_by_deferred": [3, 11, 12],
    "cursor_one_past_deferred": [3, 11, 12],
    "failed_store_registered": [1, 3, 9],
    "flush_from_wrong_cursor": [1, 2, 8],
    "flush_one_short": [1, 2, 8],
    "in_flight_flag_never_set": [0, 1, 3],
    "in_flight_flags_never_cleared": [0, 1, 3],
    "load_one_short": [0, 1, 9],
    "wrong_free_order": [0, 1, 3],
}
#: A genuine key collision: two requests with the same 143-token prompt whose first decode
#: tokens happen to be equal (crc32-derived tokens, 1 in 30,000), so both make the hash of
#: position 8; the later one's reserved id stays unbound.
COLLISION_SEED = 1972


@pytest.fixture(scope="module")
def records(model_config_dir):
    """The unmutated seeds' records (the bug classes' answers are compared against them)."""
    return {seed: run_seed(model_config_dir, seed) for seed in range(SEEDS)}


def test_same_blocks_as_vllms_manager_on_random_schedules(records):
    records = list(records.values())
    out = summarise(records)
    t = out["totals"]
    print(f"\n{SEEDS} seeds: {out['outcomes']}, recognised {out['differences_by_class']}; "
          f"{t['steps_compared']} steps compared in step, {t['steps_apart']} apart "
          f"({out['seeds_resynced']} seeds back in step, {out['seeds_apart_at_end']} apart at "
          f"the end); loads in {out['seeds_with_loads']} seeds; {t['lookups']} lookups, "
          f"{t['stores']} stores, {t['loads']} loads; {t['gaps_opened']} cursor gaps; "
          f"{sum(r.failed_stores for r in records)} failed stores")
    assert not out["unrecognised"], "\n".join(out["unrecognised"][:10])
    # The schedules must exercise what they are meant to: loads in most seeds, CPU evictions
    # during allocation, comparison past the recognised differences, failed stores.
    assert out["seeds_with_loads"] > SEEDS // 2
    assert t["exhausted_steps"] > 0 and t["steps_apart"] > 0
    assert sum(r.failed_stores > 0 for r in records) > SEEDS // 10


def test_the_known_difference_after_a_cursor_gap_is_recognised(model_config_dir):
    # Seed 1341: a cursor gap opens (kvtriton passed positions as cached that the step's
    # allocation evicted), then the request is aborted and the two finish flushes start from
    # different cursors.
    rec = run_seed(model_config_dir, 1341)
    assert not rec.unknown, rec.unknown
    assert rec.differences["per_request_allocation"] >= 1


def test_a_genuine_key_collision_is_recognised(model_config_dir):
    rec = run_seed(model_config_dir, COLLISION_SEED)
    assert not rec.unknown, rec.unknown
    assert rec.differences["key_collision"] == 1


def test_every_bug_class_has_seeds():
    assert set(MUTATION_SEEDS) == set(MUTATIONS)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_known_bug_is_caught_wherever_it_changes_an_answer(model_config_dir, records, mutation):
    seeds = MUTATION_SEEDS[mutation]
    ways = mutation_table(model_config_dir, seeds, [mutation], baseline=records)[mutation]
    for way, row in ways.items():
        print(f"\n{mutation}, {way}: fired in {row['fired']}, changed an answer in "
              f"{row['changed']}, caught in {row['caught']} (apart in {row['caught_apart']})")
        assert row["changed"], (f"{mutation} ({way}) changed no answer in seeds {seeds}: pick "
                                "others from python -m bench --only differential_mutations")
        assert not row["passed"], f"{mutation} ({way}) changed answers and passed in seeds " \
                                  f"{row['passed']}"
    # Planted at the first recognised difference, it is caught while the pair is apart, where
    # kvtriton is held to the models alone.
    assert ways["planted_apart"]["caught_apart"], f"{mutation} was never caught while apart"


# ---- the models, on hand-made cases -------------------------------------------------------------

def _req(rid, hashes):
    return SimpleNamespace(request_id=rid, block_hashes=list(hashes))


def test_a_collision_needs_another_request_to_have_made_the_hash_first():
    o = HashOrigins()
    a, b = _req("a", [b"p0"]), _req("b", [b"p0"])
    o.observe(a)
    o.admitted(a)
    o.admitted(b)  # a shared prompt block: known at admission, no reserved id
    a.block_hashes.append(b"own")  # decode: a's own hash
    o.observe_all()
    assert o.collided("a") == set() and o.collided("b") == set()
    b.block_hashes.append(b"own")  # b makes a's hash later: b's position 1 may collide
    o.observe_all()
    assert o.collided("a") == set() and o.collided("b") == {1}
    a.block_hashes.append(b"both")
    b.block_hashes.append(b"both")  # both in one interval: which came first is unknown
    o.observe_all()
    assert o.collided("a") == {2} and o.collided("b") == {1, 2}


def test_the_tier_model_is_an_lru_queue_with_pins():
    t = TierModel(5)  # blocks 1..4
    assert t.store(0, [b"x", b"y"]) == [1, 2]
    assert t.free == [3, 4]
    t.reports([], [0], [])  # registered, freed head first to the tail
    assert t.free == [3, 4, 1, 2] and t.where == {b"x": 1, b"y": 2}
    t.lookup("r", t.blocks_of([b"x", b"y"]))
    assert t.free == [3, 4] and t.ref[1] == t.ref[2] == 1
    assert t.accept("r", 1) == [1]  # the rest of the hit is released
    assert t.free == [3, 4, 2] and t.ref[1] == 1
    assert t.store(1, [b"z", b"w", b"v"]) == [3, 4, 2]  # takes the head: evicts y
    assert b"y" not in t.where and t.free == []
    t.reports([], [], [1])  # failed: freed unhashed, to the head
    assert t.free == [2, 4, 3] and b"z" not in t.where
    t.issue_loads()
    t.reports(["r"], [], [])
    assert t.free == [2, 4, 3, 1]


def test_the_expected_flush_skips_what_is_cached_in_flight_or_past_the_free_blocks():
    table, hashes = [10, 11, 12, 13, 14], [b"a", b"b", b"c", b"d", b"e"]
    gpu = dict(zip(table, hashes, strict=True)).get
    assert expected_flush(table, 1, 5, hashes, gpu, set(), {b"c"}, {13}, 9) == [11, 14]
    assert expected_flush(table, 1, 5, hashes, gpu, {1}, set(), set(), 9) == [12, 13, 14]
    assert expected_flush(table, 0, 5, hashes, gpu, set(), set(), set(), 2) == [10, 11]
