"""LFU over admitted-request demand (``kvtriton.eviction.lfu``): the sketch, a hand scenario with
LRU as the negative control, a differential check against a plain-list reference, and the
planner feeding the queue every admitted request's keys."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.queue_ops import cached_pool, drain_order, store
from kvtriton.eviction import EvictionQueue, LFUQueue, make_eviction_queue
from kvtriton.eviction.lfu import FrequencySketch
from kvtriton.pool import BlockPool

# ---- the sketch ------------------------------------------------------------------------------


def test_sketch_counts_exactly_without_collisions_and_never_under():
    rng = np.random.default_rng(0)
    keys = rng.integers(0, 10**9, size=40)
    wide, narrow = FrequencySketch(1 << 16), FrequencySketch(8)
    exact: dict[int, int] = {}
    for _ in range(30):
        batch = np.unique(rng.choice(keys, size=10))
        wide.add(batch)
        narrow.add(batch)
        for k in batch.tolist():
            exact[k] = exact.get(k, 0) + 1
    want = np.array([exact.get(k, 0) for k in keys.tolist()])
    assert (wide.estimate(keys) == want).all()
    assert (narrow.estimate(keys) >= want).all()  # count-min over-estimates where keys collide
    assert [narrow.estimate_one(k) for k in keys.tolist()] == narrow.estimate(keys).tolist()


def test_sketch_ages_by_halving_after_its_window():
    s = FrequencySketch(1 << 10, window=6)
    assert not s.add(np.array([1, 2]))
    assert not s.add(np.array([1, 2]))
    assert s.add(np.array([1, 3]))  # the sixth sighting
    assert s.estimate(np.array([1, 2, 3])).tolist() == [1, 1, 0]
    assert s.agings == 1


def test_sketch_counters_saturate():
    s = FrequencySketch(64, cap=15)
    for _ in range(40):
        s.add(np.array([7]))
    assert s.estimate_one(7) == 15


@pytest.mark.parametrize("bad", [{"width": 0}, {"width": 8, "depth": 5},
                                 {"width": 8, "window": -1}, {"width": 8, "cap": 256}])
def test_sketch_refuses_bad_sizes(bad):
    with pytest.raises(ValueError):
        FrequencySketch(**bad)


# ---- hand scenario ---------------------------------------------------------------------------


def test_popular_key_survives_where_lru_evicts_it():
    # Key 1 is freed first but three requests held it; keys 2 and 3 one each. LRU (the negative
    # control) evicts key 1 first; LFU evicts the least-demanded one, oldest among equals: 2.
    for name, first_victim_key in (("lru", 1), ("lfu", 2)):
        pool, _ = cached_pool(name, 4, [1, 2, 3])
        for keys in ([1, 2, 3], [1], [1]):
            pool.eviction.on_request(np.array(keys))  # a no-op for LRU
        store(pool, 4)
        assert first_victim_key not in pool, name
        assert all(k in pool for k in {1, 2, 3} - {first_victim_key}), name


def test_demand_seen_while_free_reranks_the_block():
    pool, blocks = cached_pool("lfu:0", 4, [1, 2, 3])
    q = pool.eviction
    assert drain_order(q) == blocks
    q.on_request(np.array([1]))
    assert drain_order(q) == [blocks[1], blocks[2], blocks[0]]
    assert list(pool.iter_free()) == drain_order(q)


def test_aging_lets_old_demand_fade():
    # Window of 1 tier (3 blocks, so 3 sightings); an aging also halves the sightings counted.
    pool, blocks = cached_pool(LFUQueue(1), 4, [1, 2, 3])
    q = pool.eviction
    q.on_request(np.array([1]))
    q.on_request(np.array([1]))
    q.on_request(np.array([2, 3]))  # 4 sightings: counters halve, 1: 2 -> 1, 2 and 3: 1 -> 0
    assert q.sketch.agings == 1
    assert drain_order(q) == [blocks[1], blocks[2], blocks[0]]
    q.on_request(np.array([2]))  # 2 + 1 sightings: halve again, every count is 0
    assert q.sketch.agings == 2
    assert drain_order(q) == blocks  # no demand left: least recently freed first, as LRU


def test_repeated_touch_keeps_age_and_a_real_use_renews_it():
    pool, blocks = cached_pool("lfu:0", 4, [1, 2, 3])
    b1 = blocks[0]
    pool.touch([b1], user="r")
    pool.free_blocks([b1])  # first taker: a use, so it is now the youngest
    assert drain_order(pool.eviction)[-1] == b1
    pool.touch([b1], user="r")
    pool.free_blocks([b1])  # the same taker again: not reuse, keeps its age
    assert drain_order(pool.eviction)[-1] == b1
    pool.touch([blocks[1]], user="s")
    pool.free_blocks([blocks[1]])
    assert drain_order(pool.eviction) == [blocks[2], b1, blocks[1]]


def test_window_is_spelled_in_the_name():
    assert make_eviction_queue("lfu").window_tiers == 16
    assert make_eviction_queue("lfu:2.5").window_tiers == 2.5
    for bad in ("lfu:x", "arc:2", "nope"):
        with pytest.raises(ValueError):
            make_eviction_queue(bad)
    with pytest.raises(ValueError):
        LFUQueue(-1)


# ---- differential check against a plain-list reference --------------------------------------


class RefLFU(EvictionQueue):
    """LFUQueue's rule on plain lists, with exact counts: O(n) per operation."""

    name = "ref-lfu"
    observes_requests = True

    def reset(self, num_blocks):
        self.u, self.hashed = [], []
        self.key, self.freed, self.repeat = {}, {}, {}
        self.count: dict[int, int] = {}
        self.clock = 0

    def on_request(self, keys):
        for k in keys.tolist():
            self.count[k] = self.count.get(k, 0) + 1

    def push(self, b, key):
        self.clock += 1
        if key is None:
            self.u.insert(0, b)
            return
        self.key[b] = key
        if not self.repeat.pop(b, False):
            self.freed[b] = self.clock
        self.hashed.append(b)

    def remove(self, b, reuse=True):
        if b in self.u:
            self.u.remove(b)
            return
        self.hashed.remove(b)
        self.repeat[b] = not reuse

    def _rank(self, b):
        return self.count.get(self.key[b], 0), self.freed[b]

    def pop(self):
        if self.u:
            return self.u.pop(0)
        b = min(self.hashed, key=self._rank)
        self.hashed.remove(b)
        self.repeat.pop(b, None)
        return b

    def __len__(self):
        return len(self.u) + len(self.hashed)

    def __contains__(self, b):
        return b in self.u or b in self.hashed

    def iter_blocks(self, after=None):
        order = [*self.u, *sorted(self.hashed, key=self._rank)]
        return iter(order[order.index(after) + 1:] if after in order else order)


# (kind, a, c): interpreted against the pool's state so that any list is valid.
_OPS = st.lists(st.tuples(st.sampled_from(["alloc", "hit", "free", "sight", "evict"]),
                          st.integers(0, 10), st.integers(0, 30)), max_size=60)


def _run(pool: BlockPool, ops) -> list:
    held: list[int] = []
    trace = []
    for kind, a, c in ops:
        if kind == "alloc":
            blocks = pool.get_new_blocks(min(a % 3 + 1, pool.num_free_blocks))
            for i, b in enumerate(blocks):
                if (c + i) % 3:
                    pool.cache_block(b, (c + 5 * i) % 12)
            held += blocks
        elif kind == "hit" and (b := pool.get_cached_block(c % 12)) is not None:
            pool.touch([b], user=a % 2)  # two users: some touches repeat, some are reuse
            held.append(b)
        elif kind == "free" and held:
            k = a % len(held) + 1
            chunk, held[:] = held[-k:], held[:-k]
            pool.free_blocks(chunk)
        elif kind == "sight":
            pool.eviction.on_request(np.unique(np.array([c % 12, (c + a) % 12])))
        elif kind == "evict":
            trace.append(pool.evict_cached(1 + a % (pool.num_blocks - 1)))
        trace.append(list(pool.iter_free()))
    return trace


@given(ops=_OPS, num_blocks=st.integers(2, 10))
def test_matches_plain_list_reference(ops, num_blocks):
    # A sketch wide enough that 12 keys never share a column in every row, never aging.
    pool = BlockPool(num_blocks, eviction=LFUQueue(0, width_per_block=4096))
    ref = BlockPool(num_blocks, eviction=RefLFU())
    assert _run(pool, ops) == _run(ref, ops)
    pool.check_invariants()
    assert list(pool.iter_free()) == drain_order(pool.eviction)


# ---- the planner feeds the queue ---------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("wrapped", [False, True], ids=["plain", "hints"])
def test_every_admitted_request_counts_each_key_once(lazy, wrapped):
    from helpers.planner_driver import PlannerDriver, tokens_for
    from kvtriton.eviction import HintedQueue
    from kvtriton.planner import PlannerConfig

    lfu = LFUQueue(0)
    cpu = BlockPool(65, eviction=HintedQueue(lfu, 0.5) if wrapped else lfu, medium="CPU")
    h = PlannerDriver(cpu=cpu, config=PlannerConfig(restore=False, lazy=lazy))
    shared = tokens_for(1, 48)  # three 16-token blocks
    a = h.request("a", shared + tokens_for(2, 32))
    b = h.request("b", shared + tokens_for(3, 16))
    h.admit(a)
    h.admit(b)  # b's shared blocks are a GPU hit: the CPU pool never sees them
    est = lfu.sketch.estimate
    assert est(h.primary_keys(a)[:3]).tolist() == [2, 2, 2]
    assert est(h.primary_keys(a)[3:]).tolist() == [1, 1]
    assert est(h.primary_keys(b)[3:]).tolist() == [1]


def test_a_queue_that_does_not_observe_requests_is_not_called():
    from helpers.planner_driver import PlannerDriver, tokens_for

    class Deaf(LFUQueue):
        observes_requests = False

        def on_request(self, keys):
            raise AssertionError("called")

    h = PlannerDriver(cpu=BlockPool(65, eviction=Deaf(0), medium="CPU"))
    h.admit(h.request("a", tokens_for(1, 48)))


def test_sketch_width_covers_one_window_of_sightings():
    q = LFUQueue(16)
    q.reset(1025)  # a tier of 1,024 blocks: a window of 16,384 sightings
    assert (q.sketch.width, q.sketch.window) == (16384, 16384)
    q = LFUQueue(0)
    q.reset(1025)  # never ages: 8 counters per block
    assert (q.sketch.width, q.sketch.window) == (8192, 0)


@pytest.mark.parametrize(("window_tiers", "num_blocks"), [(16, 1025), (0, 1025), (64, 301),
                                                          (4, 2), (0.5, 100), (1000, 7)],
                         ids=["w16", "never_ages", "w64_rounds_up", "one_block", "half", "w1000"])
def test_memory_bytes_is_what_reset_allocates(window_tiers, num_blocks):
    """The host-memory checks count a sketch before it exists: the count must be its bytes."""
    q = LFUQueue(window_tiers)
    said = q.memory_bytes(num_blocks)
    q.reset(num_blocks)
    assert said == q.sketch._rows.nbytes
    assert make_eviction_queue("lru").memory_bytes(num_blocks) == 0


def test_memory_bytes_of_a_wide_window_is_known_without_allocating_it():
    # lfu:1000000 on the 262,143-block tier of 8 GiB of a small model's KV: a 1 TiB sketch.
    assert make_eviction_queue("lfu:1000000").memory_bytes(262_144) == 1 << 40
    assert make_eviction_queue("lfu:4096").memory_bytes(262_144) == 4 << 30


def test_a_cache_only_replay_refuses_lfu():
    # No planner admits requests there: the queue would run as LRU without saying so.
    from kvtriton.sim.replay import _check_eviction

    _check_eviction("lru")
    with pytest.raises(ValueError, match="use simulate"):
        _check_eviction("lfu")
