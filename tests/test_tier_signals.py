"""``SignalBook`` moves a finished request's free CPU blocks into their hint's segment in chain
order (head first, as the chain's positions run), whatever the keys' id numbering. It moved them
in ascending key id: the connector numbers keys as vLLM shows it hashes (and recycles ids), the
simulator's ``ServingLoop`` as the workload lists them, so the two evicted the same hinted
blocks in different orders (``lazy+hints`` on ``bench.vllm.engine``'s ``cc_agentic``: 42.6% in
``ServingLoop`` against 49.0% in ``VllmLoop`` on one clock, equal once in chain order)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.eviction import CLOSED, NORMAL, PROTECTED, HintedQueue, LRUQueue
from kvtriton.pool import BlockPool
from kvtriton.tier_signals import PROBATION_SHARE, TRACKED_SEGMENTS, SignalBook, book_bytes

# One chain of four positions, numbered three ways: ascending, descending, shuffled.
CHAINS = {"ascending": [3, 5, 7, 9], "descending": [9, 7, 5, 3], "shuffled": [7, 3, 9, 5]}


def _cached_tier(keys: list[int], spare: int = 0, **book
                 ) -> tuple[BlockPool, HintedQueue, SignalBook]:
    """A CPU pool of ``len(keys) + spare`` blocks, the first ``len(keys)`` each caching one of
    ``keys`` in that order and free, under an LRU whose whole tier may be protected; the book
    over it (``book``: its axes)."""
    queue = HintedQueue(LRUQueue(), 1.0)
    pool = BlockPool(len(keys) + spare + 1, eviction=queue, medium="CPU")
    blocks = pool.get_new_blocks(len(keys))
    for b, k in zip(blocks, keys, strict=True):
        pool.cache_block(b, k)
    pool.free_blocks(blocks)

    def free_block(key: int) -> int | None:
        b = pool.get_cached_block(key)
        return b if b is not None and pool.is_free(b) else None

    return pool, queue, SignalBook(queue, free_block, **book)


def _tier(chain: list[int]) -> tuple[BlockPool, HintedQueue, SignalBook]:
    # Cached in reverse chain order: the plain queue holds them tail first. A tier large
    # enough that the unproven claim fits its probation share.
    return _cached_tier(list(reversed(chain)), spare=4 * len(chain), hints=True,
                        lookahead=False)


@pytest.mark.parametrize("hint, segment", [("continue", PROTECTED), ("close", CLOSED)])
@pytest.mark.parametrize("numbering", list(CHAINS))
def test_a_hint_moves_the_chain_in_chain_order(numbering, hint, segment):
    chain = CHAINS[numbering]
    pool, queue, book = _tier(chain)
    keys = np.array([chain], dtype=np.int64)  # (groups, positions)
    book.admitted("r", keys)
    book.finished("r", keys, hint)
    moved = list(queue._protected if segment == PROTECTED else queue._closed)
    assert [pool.block_hash(b) for b in moved] == chain


# ---- sessions ------------------------------------------------------------------------------------

IDLE_S = 10.0
N_KEYS = 12
CAP = N_KEYS  # the protected segment of the tier below: the whole of its 12 blocks
PROBATION = int(PROBATION_SHARE * CAP)

# An event: (seconds since the last event, session or None for an expire, the keys of the turn).
# The tenant of a turn: None (the one tenant) or "t" (a ``cache_salt``).
_events = st.lists(st.tuples(st.floats(0, 8, allow_nan=False),
                             st.one_of(st.none(), st.integers(0, 3)),
                             st.lists(st.integers(0, N_KEYS - 1), max_size=6),
                             st.sampled_from([None, None, "t"])),
                   max_size=30)


def _reference_levels(events) -> tuple[dict[int, int], int]:
    """The sessions' rules, one key at a time: a turn protects its keys, as a claim that is
    proven when the session's previous turn (within ``IDLE_S``) had its head among them; the
    unproven claims hold at most ``PROBATION`` keys (or the newest alone), the oldest let go
    first; a session's new
    turn lets go of its previous turn's keys it does not renew; sessions age out in the order
    they were last heard from. A let-go key is protected no more unless a later claim renewed
    it."""
    now, epoch = 0.0, 0
    claims: list[dict] = []  # the oldest first
    seen: dict[int, tuple[int, float]] = {}
    key_epoch: dict[int, int] = {}
    level = dict.fromkeys(range(N_KEYS), NORMAL)
    expired = 0

    def let_go(claim):
        for k in claim["keys"]:
            if key_epoch[k] == claim["epoch"]:
                level[k] = NORMAL

    for dt, session, keys, tenant in events:
        now += dt
        if session is None:
            while claims and claims[0]["at"] <= now - IDLE_S:
                gone = claims.pop(0)
                let_go(gone)
                seen.pop(gone["owner"], None)
                expired += 1
            continue
        if not keys:
            continue
        uniq = list(dict.fromkeys(keys))
        owner = (tenant, session)
        last = seen.pop(owner, None)
        proven = last is not None and last[1] > now - IDLE_S and last[0] in uniq
        seen[owner] = (uniq[0], now)
        before = [c for c in claims if c["owner"] == owner]
        claims = [c for c in claims if c["owner"] != owner]
        epoch += 1
        for k in uniq:
            key_epoch[k] = epoch
            level[k] = PROTECTED
        claims.append({"owner": owner, "keys": uniq, "epoch": epoch, "at": now,
                       "proven": proven})
        while (sum(len(c["keys"]) for c in claims if not c["proven"]) > PROBATION
               and sum(not c["proven"] for c in claims) > 1):
            first = next(c for c in claims if not c["proven"])
            claims.remove(first)
            let_go(first)
        while (len({c["owner"][0] for c in claims}) > 1
               and sum(len(c["keys"]) for c in claims) > CAP):
            held = {}
            for c in claims:  # oldest first: a tie goes to the tenant whose claim is oldest
                held[c["owner"][0]] = held.get(c["owner"][0], 0) + len(c["keys"])
            top = max(held.values())
            first = next(c for c in claims if held[c["owner"][0]] == top)
            claims.remove(first)
            let_go(first)
        for c in before:
            let_go(c)
    return level, expired


@settings(max_examples=150, deadline=None)
@given(_events)
def test_sessions_protect_and_age_out_as_the_per_key_rule_says(events):
    pool, queue, book = _cached_tier(list(range(N_KEYS)), hints=False, lookahead=False,
                                     session_idle_s=IDLE_S)
    now, expired = 0.0, 0
    for dt, session, keys, tenant in events:
        now += dt
        if session is None:
            expired += book.expire(now)
        else:
            book.turn_ended(session, np.array([keys], dtype=np.int64), now, tenant=tenant)
    want, want_expired = _reference_levels(events)
    assert {k: queue.level(k) for k in range(N_KEYS)} == want
    assert expired == want_expired == book.sessions_expired
    protected = {pool.block_hash(b) for b in queue._protected}
    assert protected == {k for k, lv in want.items() if lv == PROTECTED}
    assert book.live_sessions <= 8


def test_an_aged_out_sessions_blocks_go_before_the_plain_order():
    """Aging out is the protection ending, not a fresh use: the session's blocks, unused for the
    whole idle time, are the next victims (in LRU they would be the oldest), ahead of a block
    cached since; a key of theirs freed again later takes the plain order."""
    queue = HintedQueue(LRUQueue(), 1.0)
    # Eight blocks held throughout: a tier whose probation share holds the session's turn.
    pool = BlockPool(12, eviction=queue, medium="CPU")

    def free_block(key: int) -> int | None:
        b = pool.get_cached_block(key)
        return b if b is not None and pool.is_free(b) else None

    book = SignalBook(queue, free_block, hints=False, lookahead=False, session_idle_s=IDLE_S)
    a, b, c, *_held = pool.get_new_blocks(11)
    for blk, k in ((a, 1), (b, 2), (c, 3)):
        pool.cache_block(blk, k)
    pool.free_blocks([a, b])
    book.turn_ended("s", np.array([[1, 2]], dtype=np.int64), 0.0)
    pool.free_blocks([c])  # cached after the session's turn: used more recently
    assert book.expire(IDLE_S - 1) == 0 and next(iter(queue.iter_blocks())) == c
    assert book.expire(IDLE_S) == 1
    assert list(queue.iter_blocks())[:2] == [a, b] and queue.level(1) == NORMAL


# ---- claims: what one client may take ------------------------------------------------------


def _chain_tier(num_blocks: int, **book) -> tuple[BlockPool, HintedQueue, SignalBook]:
    """An empty CPU pool of ``num_blocks`` blocks under an LRU with half of it protectable."""
    queue = HintedQueue(LRUQueue(), 0.5)
    pool = BlockPool(num_blocks + 1, eviction=queue, medium="CPU")

    def free_block(key: int) -> int | None:
        b = pool.get_cached_block(key)
        return b if b is not None and pool.is_free(b) else None

    return pool, queue, SignalBook(queue, free_block, **book)


def _chain(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)[None, :]


def test_continue_hints_that_nobody_continues_hold_only_the_probation_share():
    """An attacker hinting ``continue`` on 200 unrelated requests of 5 keys: the unproven claims
    never hold more than the probation share of the segment (the last alone aside); a real
    conversation whose next turn holds its whole previous context is proven and keeps its
    protection through the flood. Negative control: with an unbounded probation share the flood
    takes the segment."""
    _, queue, book = _chain_tier(400, hints=True, lookahead=False)
    cap = queue.protect_capacity
    turn1 = _chain(1_000_000, 20)
    book.finished("victim-1", turn1, "continue")
    turn2 = np.concatenate([turn1, _chain(1_000_020, 10)], axis=1)  # holds turn 1 whole
    book.finished("victim-2", turn2, "continue")
    assert book.claims_proven == 1
    for i in range(200):
        book.finished(f"attacker-{i}", _chain(100 * i, 5), "continue")
        assert book.unproven_keys <= max(int(PROBATION_SHARE * cap), 5)
    assert all(queue.level(int(k)) == PROTECTED for k in turn2.ravel())
    assert book.claims_let_go["unproven"] >= 190


def test_without_the_probation_bound_the_flood_takes_the_segment(monkeypatch):
    import kvtriton.tier_signals as tier_signals

    monkeypatch.setattr(tier_signals, "PROBATION_SHARE", 10.0)
    _, queue, book = _chain_tier(400, hints=True, lookahead=False)
    for i in range(200):
        book.finished(f"attacker-{i}", _chain(100 * i, 5), "continue")
    assert book.unproven_keys > queue.protect_capacity


def test_a_tenant_over_its_fair_share_lets_go_of_its_oldest_claims():
    """Tenant "a" holds proven sessions filling the segment twice over; tenant "b" claims 30
    keys: "a", holding the most, lets go of its oldest claims until the claims fit the segment,
    and "b" keeps all its keys."""
    _, queue, book = _chain_tier(400, hints=False, lookahead=False, session_idle_s=1e3)
    cap = queue.protect_capacity  # 200
    for s in range(10):  # two turns each: proven on the second, 40 keys a session
        for turn in (1, 2):
            book.turn_ended(s, _chain(1000 * s, 20 * turn), float(turn), tenant="a")
    assert book.claimed_keys == 400 and book.claims_proven == 10
    b = _chain(900_000, 30)
    for turn in (1, 2):
        book.turn_ended("b1", b, 3.0 + turn, tenant="b")
    assert book.claims_let_go["over_share"] == 6  # 400 - 6 * 40 + 30 <= 200
    assert all(queue.level(int(k)) == PROTECTED for k in b.ravel())
    assert book._tenant_keys == {"a": 160, "b": 30} and cap == 200
    gone = [int(k) for s in range(6) for k in _chain(1000 * s, 40).ravel()]
    assert all(queue.level(k) == NORMAL for k in gone)


def test_fresh_session_ids_keep_the_books_memory_within_its_bound():
    """Every request a fresh session id (4,000, 20 times the segment): the book remembers at
    most a segment's worth of sessions and tracks at most its bound of claims, and the memory
    it holds stays within ``book_bytes`` (measured with tracemalloc)."""
    import tracemalloc

    _, queue, book = _chain_tier(400, hints=False, lookahead=False, session_idle_s=3600.0)
    cap = queue.protect_capacity
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(4_000):
        book.turn_ended(f"attacker-{i:0>200}", _chain(3 * i, 3), float(i) * 1e-3)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(book._seen) <= cap and book.live_sessions <= TRACKED_SEGMENTS * cap
    assert book.claimed_keys <= int(PROBATION_SHARE * cap) + 3
    # The per-key-id arrays (``_tail``, the queue's levels) grow with the ids, not the sessions.
    per_key_ids = 3 * 4_000 * (8 + 1 + 1 + 4 + 8)
    assert used <= book_bytes(cap, 256) + per_key_ids, (used, book_bytes(cap, 256))


@pytest.mark.parametrize("setup, name", [("eager+hints", "lru+hints"),
                                         ("eager+sessions", "lru+sessions"),
                                         ("eager+arc+waiting", "arc+waiting")])
def test_the_protected_queue_is_named_for_what_protects(setup, name):
    from kvtriton.setups import tier_setup
    from kvtriton.tier_signals import cpu_queue

    queue, hinted = cpu_queue(tier_setup(setup))
    assert queue is hinted and queue.name == name
