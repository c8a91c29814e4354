"""``BlockPool``'s batched path against its one-by-one path: an allocation of n blocks (n
victims evicted in one call, the batch listeners called once) makes the same decisions as n
allocations of one block, under every eviction policy (LRU, ARC, S3-FIFO and the hinted queue
over each), and ``cache_blocks`` is ``cache_block`` in a loop. Random operation lists, the same
for both pools; every decision, every (key, block) handed to the listeners, in order, and the
pools' whole state are compared."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.planner_state import deep_state
from kvtriton.eviction import CLOSED, PROTECTED, ARCQueue, HintedQueue, LRUQueue, S3FIFOQueue
from kvtriton.pool import BlockPool

NUM_BLOCKS = 24
SETUPS = {
    "lru": LRUQueue,
    "arc": ARCQueue,
    "s3fifo": S3FIFOQueue,
    "hinted_lru": lambda: HintedQueue(LRUQueue(), 0.3),
    "hinted_arc": lambda: HintedQueue(ARCQueue(), 0.3),
    "hinted_s3fifo": lambda: HintedQueue(S3FIFOQueue(), 0.3),
}

# (op, a, b): alloc n / cache the i-th held block under a fresh key (+ an alias) / free the
# i-th held block / hit the block of the i-th key ever cached / hint (hinted queues only).
OPS = st.lists(st.tuples(st.sampled_from(["alloc", "cache", "free", "hit", "hint"]),
                         st.integers(0, 40), st.integers(0, 3)), min_size=1, max_size=60)


class _Side:
    """A pool plus the log of what its listeners heard, per-key or batched."""

    def __init__(self, setup: str, batched: bool) -> None:
        self.pool = BlockPool(NUM_BLOCKS, eviction=SETUPS[setup](), enable_events=True)
        self.batched = batched
        self.log: list[tuple[str, int, int]] = []
        self.calls = 0
        if batched:
            self.pool.add_batch_listener(self._many("ins"), self._many("ev"))
        else:
            self.pool.add_listener(lambda k, b: self.log.append(("ins", k, b)),
                                   lambda k, b: self.log.append(("ev", k, b)))
        self.held: list[int] = []

    def _many(self, kind):
        def on(keys: np.ndarray, blocks: np.ndarray) -> None:
            assert keys.dtype == blocks.dtype == np.int64 and len(keys) == len(blocks)
            self.calls += 1
            self.log += [(kind, k, b) for k, b in zip(keys.tolist(), blocks.tolist(),
                                                       strict=True)]
        return on

    def alloc(self, n: int) -> list[int]:
        if self.batched:
            out = self.pool.get_new_blocks(n)
        else:
            out = [b for _ in range(n) for b in self.pool.get_new_blocks(1)]
        self.held += out
        return out

    def cache(self, items: list[tuple[int, list[int]]]) -> None:
        if self.batched:
            self.pool.cache_blocks([b for b, _ in items], [ks for _, ks in items])
        else:
            for b, ks in items:
                self.pool.cache_block(b, ks[0], ks[1:])


def _free_block_of(pool: BlockPool):
    def free_block_of(key: int) -> int | None:
        b = pool.get_cached_block(key)
        return b if b is not None and pool.is_free(b) else None
    return free_block_of


def _state(pool: BlockPool):
    """The pool's whole state but its listeners (which differ by kind on purpose)."""
    return deep_state({k: v for k, v in vars(pool).items() if not k.startswith("_on_")})


def _run(setup: str, ops) -> tuple[_Side, _Side]:
    sides = (_Side(setup, batched=True), _Side(setup, batched=False))
    next_key, cached_keys = 1000, []
    for op, a, b in ops:
        one, two = sides
        if op == "alloc":
            n = min(a % 9, one.pool.num_free_blocks)
            assert one.alloc(n) == two.alloc(n)
        elif op == "cache":
            todo = [x for x in one.held if one.pool.block_hash(x) is None][:b + 1]
            items = []
            for x in todo:
                items.append((x, [next_key, next_key + 1] if a % 3 == 0 else [next_key]))
                cached_keys.append(next_key)
                next_key += 2
            for side in sides:
                side.cache(items)
        elif op == "free" and one.held:
            x = one.held[a % len(one.held)]
            for side in sides:
                side.held.remove(x)
                side.pool.free_blocks([x])
        elif op == "hit" and cached_keys:
            k = cached_keys[a % len(cached_keys)]
            x = one.pool.get_cached_block(k)
            if x is not None:
                for side in sides:
                    side.pool.touch([x])
                    side.held.append(x)
        elif op == "hint" and setup.startswith("hinted") and cached_keys:
            keys = np.array(cached_keys[-(b + 1):], dtype=np.int64)
            for side in sides:
                side.pool.eviction.hint(keys, PROTECTED if a % 2 else CLOSED,
                                        _free_block_of(side.pool))
        assert one.log == two.log
    return sides


@pytest.mark.parametrize("setup", list(SETUPS))
@settings(max_examples=60, deadline=None)
@given(ops=OPS)
def test_batched_allocation_decides_as_one_by_one(setup, ops):
    one, two = _run(setup, ops)
    assert one.log == two.log
    assert _state(one.pool) == _state(two.pool)
    assert one.pool.take_events() == two.pool.take_events()
    one.pool.check_invariants()


def test_one_listener_call_per_allocation():
    """Eight victims evicted by one allocation reach a batch listener in one call."""
    side = _Side("lru", batched=True)
    blocks = side.alloc(8)
    side.cache([(b, [100 + i]) for i, b in enumerate(blocks)])
    assert side.calls == 1
    side.pool.free_blocks(blocks)
    side.alloc(NUM_BLOCKS - 1)
    assert side.calls == 2
    assert [(k, b) for kind, k, b in side.log if kind == "ev"] == \
        [(100 + i, b) for i, b in enumerate(blocks)]


def test_cache_blocks_checks_every_block_first():
    pool = BlockPool(8)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(b, 7)
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_blocks([a, b], [[1], [2]])
    assert pool.block_hash(a) is None and 1 not in pool
    with pytest.raises(ValueError, match="named twice"):
        pool.cache_blocks([a, a], [[1], [2]])
    with pytest.raises(ValueError, match="key lists"):
        pool.cache_blocks([a], [[1], [2]])
