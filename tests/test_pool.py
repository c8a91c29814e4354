"""``BlockPool``: every operation, its bad input, the ``GpuPool`` protocol the planner uses and
the pools that serve it, and a stateful model of the LRU pool."""

import logging
import typing

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from helpers.planner_state import deep_state, raises_naming
from kvtriton.pool import NULL_BLOCK, BlockPool, cached_prefix_blocks
from kvtriton.pool_interface import AllBlocksCleared, BlockRemoved, BlockStored, GpuPool

N = 8  # blocks 1..7 usable


def make_pool(num_blocks=N, **kwargs):
    """A pool with events on and a log of every listener call: ("ins"|"ev", key, block)."""
    pool = BlockPool(num_blocks, enable_events=True, **kwargs)
    log = []
    pool.add_listener(lambda k, b: log.append(("ins", k, b)),
                      lambda k, b: log.append(("ev", k, b)))
    return pool, log


def snapshot(pool):
    """Everything observable about the pool (plus its pending events)."""
    keys = {k for b in range(pool.num_blocks) for k in pool.block_keys(b)}
    return {
        "ref": list(pool.ref_cnt),
        "keys": [pool.block_keys(b) for b in range(pool.num_blocks)],
        "map": {k: pool.cached_blocks(k) for k in sorted(keys)},
        "num_keys": pool.num_cached_keys,
        "free": list(pool.iter_free()),
        "num_free": pool.num_free_blocks,
        "events": list(pool._events),
    }


def busy_pool():
    """Blocks 1-3 referenced (2 cached under 20 + alias 21, 3 cached under 30 with ref 2),
    4 free and cached under 40, 5-7 free unhashed. Free queue: [5, 6, 7, 4]."""
    pool, log = make_pool()
    assert pool.get_new_blocks(4) == [1, 2, 3, 4]
    pool.cache_block(2, 20, [21])
    pool.cache_block(3, 30)
    pool.cache_block(4, 40)
    pool.touch([3])
    pool.free_blocks([4])
    pool.take_events()
    log.clear()
    assert list(pool.iter_free()) == [5, 6, 7, 4]
    return pool, log


# ---- allocation and free order ----------------------------------------------------------------


def test_allocation_order_and_counts():
    pool, _ = make_pool()
    assert list(pool.iter_free()) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_new_blocks(0) == []
    assert pool.get_new_blocks(3) == [1, 2, 3]
    assert pool.get_new_blocks(2) == [4, 5]
    assert list(pool.ref_cnt) == [0, 1, 1, 1, 1, 1, 0, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks) == (2, 5)
    assert pool.get_new_blocks(2) == [6, 7]
    assert pool.num_free_blocks == 0 and list(pool.iter_free()) == []
    pool.check_invariants()


def test_free_blocks_unhashed_to_head_hashed_to_tail_in_given_order():
    pool, _ = make_pool()
    pool.get_new_blocks(7)
    pool.cache_block(2, 200)
    pool.cache_block(4, 400)
    pool.cache_block(6, 600)
    pool.free_blocks([6, 1, 2, 3, 4])
    # hashed join the tail in the order given (6, 2, 4); unhashed go to the head (3 last in)
    assert list(pool.iter_free()) == [3, 1, 6, 2, 4]
    pool.free_blocks([7, 5])
    assert list(pool.iter_free()) == [5, 7, 3, 1, 6, 2, 4]
    assert pool.take_events() == [BlockStored([200], None, [], 0, None, "GPU"),
                                  BlockStored([400], None, [], 0, None, "GPU"),
                                  BlockStored([600], None, [], 0, None, "GPU")]
    # unhashed blocks are reused first, then the LRU of the hashed ones
    assert pool.get_new_blocks(5) == [5, 7, 3, 1, 6]
    assert pool.take_events() == [BlockRemoved([600], "GPU")]
    assert 600 not in pool and 200 in pool and 400 in pool
    pool.check_invariants()


def test_free_with_remaining_references_keeps_block_out_of_queue():
    pool, _ = make_pool()
    pool.get_new_blocks(1)
    pool.touch([1, 1])
    assert pool.ref_cnt[1] == 3
    pool.free_blocks([1, 1])
    assert pool.ref_cnt[1] == 1 and not pool.is_free(1)
    pool.free_blocks([1])
    assert pool.ref_cnt[1] == 0 and pool.is_free(1)
    assert next(pool.iter_free()) == 1


def test_get_new_blocks_evicts_primary_and_aliases():
    pool, log = make_pool()
    pool.get_new_blocks(2)
    pool.cache_block(1, 10, [11, 12], parent_key=9, token_ids=[1, 2, 3, 4], block_size=4,
                     lora_id=3, group_idx=1)
    assert log == [("ins", 10, 1), ("ins", 11, 1), ("ins", 12, 1)]
    assert pool.take_events() == [BlockStored([10, 11, 12], 9, [1, 2, 3, 4], 4, 3, "GPU", None, 1)]
    pool.free_blocks([1])
    assert pool.get_new_blocks(5) == [3, 4, 5, 6, 7]  # unhashed ones first
    assert 10 in pool and log[3:] == []
    assert pool.get_new_blocks(1) == [1]
    assert log[3:] == [("ev", 10, 1), ("ev", 11, 1), ("ev", 12, 1)]
    assert pool.take_events() == [BlockRemoved([10, 11, 12], "GPU")]
    assert pool.block_keys(1) == () and pool.block_hash(1) is None
    assert all(k not in pool for k in (10, 11, 12)) and pool.num_cached_keys == 0
    assert pool.ref_cnt[1] == 1
    pool.check_invariants()


def test_touch_of_free_cached_block_is_a_hit():
    pool, _ = make_pool()
    pool.get_new_blocks(3)
    pool.cache_block(2, 20)
    pool.free_blocks([1, 2, 3])
    assert list(pool.iter_free()) == [3, 1, 4, 5, 6, 7, 2]
    assert pool.get_cached_block(20) == 2
    pool.touch([2])
    assert pool.ref_cnt[2] == 1 and not pool.is_free(2)
    assert list(pool.iter_free()) == [3, 1, 4, 5, 6, 7]
    assert pool.block_keys(2) == (20,)
    assert pool.get_new_blocks(6) == [3, 1, 4, 5, 6, 7]  # never the hit block
    assert pool.take_events() == [BlockStored([20], None, [], 0, None, "GPU")]
    pool.touch([2])  # a second user of a referenced block
    assert pool.ref_cnt[2] == 2
    pool.check_invariants()


def test_several_blocks_per_key():
    pool, log = make_pool()
    pool.get_new_blocks(3)
    pool.cache_block(1, 7)
    pool.cache_block(2, 7, [8])
    pool.cache_block(3, 8, [7])
    assert pool.cached_blocks(7) == [1, 2, 3] and pool.cached_blocks(8) == [2, 3]
    assert pool.get_cached_block(7) == 1
    assert pool.num_cached_keys == 2
    pool.free_blocks([1, 2, 3])
    pool.get_new_blocks(4)  # the unhashed 4-7
    assert pool.get_new_blocks(1) == [1]
    assert pool.cached_blocks(7) == [2, 3] and pool.get_cached_block(7) == 2
    assert pool.get_new_blocks(1) == [2]
    assert pool.cached_blocks(7) == [3] and pool.cached_blocks(8) == [3]
    assert pool.get_new_blocks(1) == [3]
    assert pool.cached_blocks(7) == [] and pool.get_cached_block(7) is None
    assert 7 not in pool and 8 not in pool and pool.num_cached_keys == 0
    assert [e for e in log if e[0] == "ev"] == [
        ("ev", 7, 1), ("ev", 7, 2), ("ev", 8, 2), ("ev", 8, 3), ("ev", 7, 3)]
    pool.check_invariants()


def test_aliases_deduplicated_and_primary_dropped_from_them():
    pool, log = make_pool()
    pool.get_new_blocks(1)
    pool.cache_block(1, 5, [6, 5, 7, 6])
    assert pool.block_keys(1) == (5, 6, 7) and pool.block_hash(1) == 5
    assert log == [("ins", 5, 1), ("ins", 6, 1), ("ins", 7, 1)]
    assert pool.take_events()[0].block_hashes == [5, 6, 7]
    assert all(pool.get_cached_block(k) == 1 for k in (5, 6, 7))
    pool.check_invariants()


def test_aliases_accept_a_generator():
    pool, _ = make_pool()
    pool.get_new_blocks(1)
    pool.cache_block(1, 5, (k for k in (6, 7)))
    assert pool.block_keys(1) == (5, 6, 7)


def test_events_off_by_default_and_medium_is_named():
    pool = BlockPool(4)
    pool.get_new_blocks(1)
    pool.cache_block(1, 5)
    assert pool.take_events() == []
    cpu = BlockPool(4, medium="CPU", enable_events=True)
    cpu.get_new_blocks(1)
    cpu.cache_block(1, 5)
    cpu.free_blocks([1])
    assert cpu.evict_cached(1)
    assert cpu.take_events() == [BlockStored([5], None, [], 0, None, "CPU"),
                                 BlockRemoved([5], "CPU")]
    assert cpu.take_events() == []


def test_evict_cached():
    pool, log = busy_pool()
    assert list(pool.iter_free()) == [5, 6, 7, 4]
    assert pool.evict_cached(4) is True
    assert list(pool.iter_free()) == [4, 5, 6, 7]  # unhashed now: reused first
    assert 40 not in pool and pool.block_keys(4) == ()
    assert log == [("ev", 40, 4)]
    assert pool.take_events() == [BlockRemoved([40], "GPU")]
    before = snapshot(pool)
    assert pool.evict_cached(2) is False  # referenced
    assert pool.evict_cached(4) is False  # free but unhashed
    assert pool.evict_cached(1) is False  # referenced, unhashed
    assert snapshot(pool) == before and log == [("ev", 40, 4)]
    pool.check_invariants()


def test_cached_blocks_count_the_hashed_blocks_referenced_or_free():
    """``num_cached_blocks`` is the pool's fill: hashed blocks whether referenced or not, where
    ``num_used_blocks`` counts the referenced ones, cached or not."""
    pool, _ = busy_pool()

    def hashed():
        return sum(pool.block_hash(b) is not None for b in range(pool.num_blocks))

    counts = [(pool.num_cached_blocks, hashed(), pool.num_used_blocks)]
    pool.free_blocks([3, 1, 2, 3])  # every reference dropped: the cached blocks stay
    counts.append((pool.num_cached_blocks, hashed(), pool.num_used_blocks))
    pool.evict_cached(4)
    counts.append((pool.num_cached_blocks, hashed(), pool.num_used_blocks))
    pool.reset_prefix_cache()
    counts.append((pool.num_cached_blocks, hashed(), pool.num_used_blocks))
    assert counts == [(3, 3, 3), (3, 3, 0), (2, 2, 0), (0, 0, 0)]


def test_iter_free_after():
    pool, _ = busy_pool()
    assert list(pool.iter_free(after=6)) == [7, 4]
    assert list(pool.iter_free(after=4)) == []
    assert list(pool.iter_free(after=2)) == [5, 6, 7, 4]  # not free: from the start


def test_reset_prefix_cache_refuses_while_referenced(caplog):
    pool, log = busy_pool()
    before = snapshot(pool)
    with caplog.at_level(logging.WARNING, logger="kvtriton.pool"):
        assert pool.reset_prefix_cache() is False
    assert "3 blocks still referenced" in caplog.text
    assert snapshot(pool) == before and log == []


def test_reset_prefix_cache_clears():
    pool, log = busy_pool()
    pool.free_blocks([3, 1, 2, 3])
    assert pool.num_used_blocks == 0
    assert pool.reset_prefix_cache() is True
    assert sorted(log) == [("ev", 20, 2), ("ev", 21, 2), ("ev", 30, 3), ("ev", 40, 4)]
    assert pool.take_events() == [AllBlocksCleared("GPU")]
    assert pool.num_cached_keys == 0
    assert all(pool.block_keys(b) == () for b in range(N))
    assert all(k not in pool for k in (20, 21, 30, 40))
    assert list(pool.iter_free()) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_new_blocks(2) == [1, 2]
    assert pool.take_events() == []  # nothing left to remove
    pool.check_invariants()


def test_cached_prefix_blocks():
    pool, _ = busy_pool()
    assert cached_prefix_blocks(pool, [20, 30, 40, 99, 21]) == [2, 3, 4]
    assert cached_prefix_blocks(pool, [99, 20]) == []


def test_pool_keeps_a_blocks_group_until_its_hashes_go():
    """``cache_block``'s ``group_idx`` is the block's group until the block is handed out again
    or the prefix cache is reset; a bad one is refused before anything changes."""
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, 10, group_idx=1)
    pool.cache_block(b, 11)
    assert (pool.block_group(a), pool.block_group(b)) == (1, None)
    with pytest.raises(ValueError, match=f"group_idx -1 of block {c} is not a non-negative int"):
        pool.cache_block(c, 12, group_idx=-1)
    assert pool.block_hash(c) is None and 12 not in pool
    pool.free_blocks([a, b, c])
    assert pool.block_group(a) == 1  # free and still cached: still its group
    pool.get_new_blocks(3)  # evicts both
    assert (pool.block_group(a), pool.block_group(b)) == (None, None)
    pool.check_invariants()
    pool = BlockPool(4)
    c = pool.get_new_blocks(1)
    pool.cache_block(c[0], 10, group_idx=2)
    pool.free_blocks(c)
    assert pool.reset_prefix_cache() and pool.block_group(c[0]) is None


def test_pools_name_every_key_they_refer_to():
    """The CPU tier's cached keys, the keys its ARC ghost lists remember and the keys of events
    not yet taken all count as referenced (a recycler must keep them)."""
    pool = BlockPool(4, eviction="arc", medium="CPU", enable_events=True)
    blocks = pool.get_new_blocks(3)
    for b, key in zip(blocks, (10, 11, 12), strict=True):
        pool.cache_block(b, key, ())
    pool.free_blocks(blocks)
    pool.get_new_blocks(3)  # evicts all three: their keys go to a ghost list
    assert pool.num_cached_keys == 0
    assert sorted(set(pool.referenced_keys())) == [10, 11, 12]
    pool.take_events()
    assert sorted(pool.referenced_keys()) == [10, 11, 12]  # ghosts only now
    lru = BlockPool(4, medium="CPU")
    b = lru.get_new_blocks(1)
    lru.cache_block(b[0], 5, (6,))
    assert sorted(lru.referenced_keys()) == [5, 6]


# ---- bad input: ValueError naming the value, pool unchanged -----------------------------------

BAD_INPUT = [
    ("n-too-big", lambda p: p.get_new_blocks(5), "asked for 5 blocks, 4 free"),
    ("n-negative", lambda p: p.get_new_blocks(-1), "n must be a non-negative int, got -1"),
    ("n-float", lambda p: p.get_new_blocks(1.0), "got 1.0"),
    ("touch-out-of-range", lambda p: p.touch([1, N]), rf"block id {N} out of range \[0, {N}\)"),
    ("touch-negative", lambda p: p.touch([-1]), r"block id -1 out of range"),
    ("touch-null", lambda p: p.touch([4, 0]), "block id 0 is the null block"),
    ("touch-bool", lambda p: p.touch([True]), "block id True out of range"),
    ("free-null", lambda p: p.free_blocks([1, 0]), "free_blocks: block id 0 is the null block"),
    ("free-out-of-range", lambda p: p.free_blocks([99]), "block id 99 out of range"),
    ("double-free", lambda p: p.free_blocks([1, 5]), r"block 5 freed 1x with ref count 0"),
    ("same-id-twice", lambda p: p.free_blocks([2, 1, 2]), r"block 2 freed 2x with ref count 1"),
    ("thrice-ref2", lambda p: p.free_blocks([3, 3, 3]), r"block 3 freed 3x with ref count 2"),
    ("free-free-cached", lambda p: p.free_blocks([4]), r"block 4 freed 1x with ref count 0"),
    ("cache-null", lambda p: p.cache_block(0, 99), "cache_block: block id 0 is the null block"),
    ("cache-out-of-range", lambda p: p.cache_block(N, 99), f"block id {N} out of range"),
    ("cache-cached", lambda p: p.cache_block(2, 99), "block 2 is already cached under 0x14"),
    ("cache-free", lambda p: p.cache_block(5, 99), "block 5 is free"),
    ("cache-free-cached", lambda p: p.cache_block(4, 99), "block 4 is already cached"),
    ("cache-none-key", lambda p: p.cache_block(1, None), "key None of block 1 is not an int"),
    ("cache-none-alias", lambda p: p.cache_block(1, 99, [98, None]), "key None of block 1"),
    ("evict-null", lambda p: p.evict_cached(0), "evict_cached: block id 0 is the null block"),
    ("evict-out-of-range", lambda p: p.evict_cached(-3), "block id -3 out of range"),
]


@pytest.mark.parametrize(("op", "match"), [b[1:] for b in BAD_INPUT], ids=[b[0] for b in BAD_INPUT])
def test_bad_input_raises_and_leaves_pool_unchanged(op, match):
    pool, log = busy_pool()
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        op(pool)
    assert snapshot(pool) == before
    assert log == []
    pool.check_invariants()


def test_none_key_regression_keeps_invariants():
    # A key None is refused: registered, it would leave the block looking unhashed, so the block
    # would join the free queue's head and be reused with the map still pointing at it.
    pool, _ = make_pool()
    pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="key None"):
        pool.cache_block(1, None)
    assert None not in pool and pool.num_cached_keys == 0
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks", [1, 0, -5, 2.0, "8"])
def test_bad_num_blocks(num_blocks):
    with pytest.raises(ValueError, match=f"num_blocks must be an int >= 2.*got {num_blocks!r}"):
        BlockPool(num_blocks)


def test_unknown_eviction():
    with pytest.raises(ValueError, match="unknown eviction 'mru'"):
        BlockPool(4, eviction="mru")


@pytest.mark.parametrize("bad", [True, False, 2.0, -1, "2", None, np.float64(2.0)], ids=repr)
def test_get_new_blocks_refuses_bools_and_floats(bad):
    """``get_new_blocks`` takes an int count: ``True`` or ``2.0`` is refused (not read as 1 or
    2) and the pool is left as it was; NumPy ints are counts too."""
    pool = BlockPool(8)
    before = deep_state(pool)
    with raises_naming(bad, also="get_new_blocks: n must be a non-negative int"):
        pool.get_new_blocks(bad)
    assert deep_state(pool) == before
    got = pool.get_new_blocks(np.int64(2))
    assert got == [1, 2] and all(type(b) is int for b in got)
    pool.check_invariants()


# ---- the GPU pool protocol -----------------------------------------------------------------------

#: Every attribute and method of the GPU pool that kvtriton/planner/*.py reads or calls.
PLANNER_USES = {"num_blocks", "ref_cnt", "add_listener", "block_hash", "block_keys",
                "get_cached_block", "__contains__", "iter_free", "touch", "pin_held",
                "free_blocks"}


def protocol_members(proto: type) -> set[str]:
    """``typing.get_protocol_members`` (Python 3.13+), else the Protocol's annotations and the
    functions its body defines."""
    get = getattr(typing, "get_protocol_members", None)
    if get is not None:
        return set(get(proto))
    own = f"{proto.__name__}."
    functions = {name for name, value in vars(proto).items()
                 if callable(value) and getattr(value, "__qualname__", "").startswith(own)}
    return set(proto.__annotations__) | functions


def missing_members(pool: object) -> set[str]:
    return {m for m in protocol_members(GpuPool) if not hasattr(pool, m)}


def test_protocol_lists_what_the_planner_uses():
    assert protocol_members(GpuPool) == PLANNER_USES


def test_block_pool_serves_it():
    assert missing_members(BlockPool(8)) == set()


def test_vllm_gpu_pool_serves_it():
    pytest.importorskip("vllm")
    from vllm.v1.core.block_pool import BlockPool as VllmBlockPool

    from kvtriton.vllm.gpu_pool import VllmGpuPool
    from kvtriton.vllm.keys import KeyIds

    pool = VllmGpuPool(VllmBlockPool(8, enable_caching=True, hash_block_size=16), KeyIds())
    assert missing_members(pool) == set()


# ---- stateful model ---------------------------------------------------------------------------

M = 9  # blocks 1..8
KEYS = st.integers(0, 11)  # a small key space, so keys collide across blocks


class PoolModel(RuleBasedStateMachine):
    """Random operations against a plain-Python model of the LRU pool.

    The model keeps the free queue as a list (head = next victim), ref counts, per-block keys
    (primary first) and key -> blocks in registration order, plus the listener calls and events
    every operation must produce.
    """

    def __init__(self):
        super().__init__()
        self.pool, self.log = make_pool(M)
        self.ref = [0] * M
        self.free = list(range(1, M))
        self.keys = [()] * M
        self.map = {}
        self.want_log = []
        self.want_events = []

    # model helpers

    def _drop_keys(self, b):
        for k in self.keys[b]:
            self.map[k].remove(b)
            if not self.map[k]:
                del self.map[k]
            self.want_log.append(("ev", k, b))

    def _held(self):
        return [b for b in range(1, M) for _ in range(self.ref[b])]

    # rules

    @rule(n=st.integers(0, 3) | st.integers(0, M))
    def allocate(self, n):
        if n > len(self.free):
            before = snapshot(self.pool)
            with pytest.raises(ValueError, match=f"asked for {n} blocks, {len(self.free)} free"):
                self.pool.get_new_blocks(n)
            assert snapshot(self.pool) == before
            return
        victims, self.free = self.free[:n], self.free[n:]
        for b in victims:
            assert self.ref[b] == 0  # never hand out a referenced block
            if self.keys[b]:
                self._drop_keys(b)
                self.want_events.append(BlockRemoved(list(self.keys[b]), "GPU"))
                self.keys[b] = ()
            self.ref[b] = 1
        got = self.pool.get_new_blocks(n)
        assert got == victims
        assert len(set(got)) == len(got)

    @precondition(lambda self: any(self.ref) or any(self.keys))
    @rule(data=st.data())
    def touch(self, data):
        hittable = [b for b in range(1, M) if self.ref[b] or self.keys[b]]
        blocks = data.draw(st.lists(st.sampled_from(hittable), min_size=1, max_size=3))
        for b in blocks:
            if self.ref[b] == 0:
                self.free.remove(b)
            self.ref[b] += 1
        self.pool.touch(blocks)

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data())
    def free(self, data):
        held = self._held()
        order = data.draw(st.permutations(held))
        self._free(order[: data.draw(st.integers(1, len(order)))])

    def _free(self, order):
        for b in order:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.keys[b]:
                    self.free.append(b)
                else:
                    self.free.insert(0, b)
        self.pool.free_blocks(order)

    @precondition(lambda self: any(r and not k for r, k in zip(self.ref, self.keys, strict=True)))
    @rule(data=st.data(), key=KEYS, aliases=st.lists(KEYS, max_size=3))
    def cache(self, data, key, aliases):
        cands = [b for b in range(1, M) if self.ref[b] and not self.keys[b]]
        b = data.draw(st.sampled_from(cands))
        keys = tuple(dict.fromkeys([key, *aliases]))
        self.keys[b] = keys
        for k in keys:
            self.map.setdefault(k, []).append(b)
            self.want_log.append(("ins", k, b))
        self.want_events.append(BlockStored(list(keys), None, [], 0, None, "GPU"))
        self.pool.cache_block(b, key, aliases)

    @precondition(lambda self: any(self.keys))
    @rule(data=st.data())
    def evict_cached(self, data):
        # A free cached block if there is one (evicted), else any block (a no-op).
        cands = [b for b in range(1, M) if not self.ref[b] and self.keys[b]]
        self._evict_cached(data.draw(st.sampled_from(cands or list(range(1, M)))))

    def _evict_cached(self, b):
        expect = self.ref[b] == 0 and bool(self.keys[b])
        if expect:
            self._drop_keys(b)
            self.want_events.append(BlockRemoved(list(self.keys[b]), "GPU"))
            self.keys[b] = ()
            self.free.remove(b)
            self.free.insert(0, b)
        assert self.pool.evict_cached(b) is expect

    @precondition(lambda self: any(self.keys))
    @rule(data=st.data(), free_all=st.booleans())
    def reset(self, data, free_all):
        if free_all and any(self.ref):  # drop every reference first, in a random order
            self._free(data.draw(st.permutations(self._held())))
        if any(self.ref):
            before = snapshot(self.pool)
            assert self.pool.reset_prefix_cache() is False
            assert snapshot(self.pool) == before
            return
        for b in range(1, M):
            self._drop_keys(b)
            self.keys[b] = ()
        self.free = list(range(1, M))
        self.want_events.append(AllBlocksCleared("GPU"))
        assert self.pool.reset_prefix_cache() is True

    @rule(data=st.data())
    def bad_input(self, data):
        ops = [
            (lambda p: p.free_blocks([0]), "null block"),
            (lambda p: p.touch([M]), f"block id {M} out of range"),
            (lambda p: p.cache_block(0, 1), "null block"),
        ]
        for b in range(1, M):
            if self.ref[b] == 0:
                ops.append((lambda p, b=b: p.free_blocks([b]), f"block {b} freed 1x with ref "))
                if not self.keys[b]:
                    ops.append((lambda p, b=b: p.cache_block(b, 1), f"block {b} is free"))
            else:
                ops.append((lambda p, b=b, r=self.ref[b]: p.free_blocks([b] * (r + 1)),
                            f"block {b} freed {self.ref[b] + 1}x with ref count {self.ref[b]}"))
            if self.keys[b]:
                ops.append((lambda p, b=b: p.cache_block(b, 1), f"block {b} is already cached"))
        op, match = data.draw(st.sampled_from(ops))
        before = snapshot(self.pool)
        with pytest.raises(ValueError, match=match):
            op(self.pool)
        assert snapshot(self.pool) == before

    # checked after every rule

    @invariant()
    def agrees_with_model(self):
        pool = self.pool
        pool.check_invariants()
        assert all(r >= 0 for r in pool.ref_cnt)
        assert list(pool.ref_cnt) == self.ref and pool.ref_cnt[NULL_BLOCK] == 0
        assert list(pool.iter_free()) == self.free
        for b in range(1, M):
            assert pool.is_free(b) == (pool.ref_cnt[b] == 0)
            assert pool.block_keys(b) == self.keys[b]
        assert not pool.is_free(NULL_BLOCK) and pool.block_keys(NULL_BLOCK) == ()
        assert pool.num_cached_keys == len(self.map)
        for k, blocks in self.map.items():
            assert pool.cached_blocks(k) == blocks
            assert pool.get_cached_block(k) == blocks[0]
        assert self.log == self.want_log
        assert pool.take_events() == self.want_events
        self.log.clear()
        self.want_log.clear()
        self.want_events.clear()


class PoolModelArrays(PoolModel):
    """The same model, with every batch of the pool and its LRU queue run through the array
    paths (``batch_min = 0``): the default sends calls of a few blocks, all of this model's,
    through the per-block loops."""

    def __init__(self):
        super().__init__()
        self.pool.batch_min = 0
        self.pool.eviction.batch_min = 0


# More runs than the profile's default: a run needs many steps to build shared keys and free
# cached blocks. The "long" profile still raises it.
_MODEL_SETTINGS = settings(max_examples=max(150, settings.default.max_examples),
                           stateful_step_count=50)
TestPoolModel = PoolModel.TestCase
TestPoolModel.settings = _MODEL_SETTINGS
TestPoolModelArrays = PoolModelArrays.TestCase
TestPoolModelArrays.settings = _MODEL_SETTINGS


@settings(max_examples=100)
@given(refs=st.lists(st.integers(0, 2), min_size=2, max_size=40), data=st.data())
def test_count_free_matches_a_loop(refs, data):
    """``count_free`` (one C-level read of the counts) against a loop over ``ref_cnt``."""
    pool = BlockPool(len(refs) + 1)
    for b, r in enumerate(refs, start=1):
        if r:
            pool.touch([b] * r)
    ids = data.draw(st.lists(st.integers(0, len(refs)), max_size=30))
    want = sum(1 for b in ids if b != NULL_BLOCK and pool.ref_cnt[b] == 0)
    assert pool.count_free(ids) == want
