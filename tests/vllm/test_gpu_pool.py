"""``VllmGpuPool``'s batch listeners against its per-key ones, on vLLM's own ``BlockPool``: each
vLLM call that changes many blocks (allocation with evictions, caching, explicit evictions, a
reset) reaches a batch listener once, with the same (key id, block id) pairs, in the same order,
as the per-key listener hears one by one; a change outside those calls comes as a batch of one."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from bench.vllm.vs_vllm_variants import _hash, _VllmRequest
from kvtriton.vllm.gpu_pool import VllmGpuPool
from kvtriton.vllm.keys import KeyIds

pytestmark = pytest.mark.scheduler_role

BLOCK = 16


@pytest.fixture
def pools():
    from vllm.v1.core.block_pool import BlockPool

    pool = BlockPool(17, enable_caching=True, hash_block_size=BLOCK)
    view = VllmGpuPool(pool, KeyIds())
    per_key, batches = [], []
    view.add_listener(lambda k, b: per_key.append(("ins", k, b)),
                      lambda k, b: per_key.append(("ev", k, b)))

    def many(kind):
        def on(keys, blocks):
            assert keys.dtype == blocks.dtype == np.int64
            batches.append([(kind, k, b) for k, b in zip(keys.tolist(), blocks.tolist(),
                                                          strict=True)])
        return on

    view.add_batch_listener(many("ins"), many("ev"))
    return pool, view, per_key, batches


def _cache(pool, first_hash: int, n: int) -> list:
    blocks = pool.get_new_blocks(n)
    req = _VllmRequest(f"r{first_hash}", [_hash(first_hash + i) for i in range(n)], n * BLOCK,
                       n * BLOCK, n * BLOCK, max_tokens=1)
    pool.cache_full_blocks(req, blocks, 0, n, BLOCK, 0)
    return blocks


def test_one_batch_per_vllm_call_same_pairs_in_order(pools):
    pool, view, per_key, batches = pools
    a = _cache(pool, 0, 8)
    assert len(batches) == 1 and [e[0] for e in batches[0]] == ["ins"] * 8
    pool.free_blocks(a)
    b = _cache(pool, 100, 12)  # 8 free unhashed blocks, then 4 of the cached ones evicted
    assert [len(x) for x in batches] == [8, 4, 12]
    assert [e[0] for e in batches[1]] == ["ev"] * 4
    pool.free_blocks(b)
    pool.evict_blocks({b[0].block_id, b[1].block_id, a[7].block_id})
    assert len(batches) == 4 and len(batches[3]) == 3
    assert pool.reset_prefix_cache()
    assert [e[0] for e in batches[4]] == ["ev"] * len(batches[4])
    assert [e for x in batches for e in x] == per_key
    # The view's reads agree with the pairs heard: nothing cached after the reset.
    assert all(view.get_cached_block(k) is None for _, k, _ in per_key)


def test_a_change_outside_the_wrapped_calls_comes_at_once(pools):
    pool, _view, per_key, batches = pools
    a = _cache(pool, 0, 2)
    pool.free_blocks(a)
    pool._maybe_evict_cached_block(a[0])  # vLLM's private path, outside any wrapped call
    assert batches[-1] == per_key[-1:] and per_key[-1][0] == "ev"


# ---- pins kept apart from vLLM's counts (pin_held) -------------------------------------------


def _free_ids(pool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def test_held_pins_leave_vllm_counts_alone_until_vllm_drops_its_own(pools):
    """A store's sources pinned with ``pin_held`` while their request holds them: vLLM's counts
    do not move; when the request frees its blocks (vLLM's ``free_blocks``, as at a finish or a
    preemption), the pins move into vLLM's counts, so the blocks stay out of the free queue
    until the store completes."""
    pool, view, _, _ = pools
    held = _cache(pool, 0, 6)
    ids = [b.block_id for b in held]
    view.pin_held(ids[:4])
    view.pin_held(ids[:1])  # a block pinned twice (two transfers read it)
    assert [b.ref_cnt for b in held] == [1] * 6
    assert [view.ref_cnt[b] for b in ids] == [3, 2, 2, 2, 1, 1]
    assert view.num_kept_pins == 5
    pool.free_blocks(reversed(held))  # the request finishes: vLLM drops its references
    assert [b.ref_cnt for b in held] == [2, 1, 1, 1, 0, 0]
    assert view.num_kept_pins == 0
    free = _free_ids(pool)
    assert not set(ids[:4]) & set(free) and set(ids[4:]) <= set(free)
    view.free_blocks(ids[:4] + ids[:1])  # the stores complete
    assert [b.ref_cnt for b in held] == [0] * 6 and set(ids) <= set(_free_ids(pool))


def test_without_the_hook_a_held_pin_would_let_the_block_be_reused(pools):
    """Negative control: vLLM's own ``free_blocks``, past the view's wrapper, sends a block with
    a kept pin to the free queue, where the next allocation hands it out while a store still
    reads it. The wrapper is what keeps it out."""
    from vllm.v1.core.block_pool import BlockPool

    pool, view, _, _ = pools
    held = _cache(pool, 0, 3)
    view.pin_held([b.block_id for b in held])
    BlockPool.free_blocks(pool, held)
    assert {b.block_id for b in held} <= set(_free_ids(pool))


def test_kept_pins_are_dropped_one_per_occurrence_then_vllm_frees(pools):
    pool, view, _, _ = pools
    blocks = _cache(pool, 0, 3)
    ids = [b.block_id for b in blocks]
    pool.touch(blocks[:1])  # a real pin of the planner's (a block vLLM did not hold)
    view.pin_held([ids[0], ids[1]])
    view.free_blocks([ids[0], ids[0], ids[1]])  # one kept pin, then vLLM's count, then kept
    assert [b.ref_cnt for b in blocks] == [1, 1, 1] and view.num_kept_pins == 0
    with pytest.raises(ValueError, match=r"pin_held: a block id outside \[1, 17\)"):
        view.pin_held([0])


def test_unpin_blocks_moves_the_kept_pins_too(pools):
    pool, view, _, _ = pools
    if not callable(getattr(pool, "unpin_blocks", None)):
        pytest.skip("this vLLM has no BlockPool.unpin_blocks")
    blocks = _cache(pool, 0, 2)
    view.pin_held([blocks[0].block_id])
    pool.unpin_blocks(blocks, on_reuse=lambda b: None)
    assert [b.ref_cnt for b in blocks] == [1, 0]
    assert blocks[0].block_id not in _free_ids(pool)


def test_check_held_refuses_a_block_vllm_does_not_hold(pools, monkeypatch):
    pool, view, _, _ = pools
    monkeypatch.setattr(view, "check_held", True)
    blocks = _cache(pool, 0, 2)
    pool.free_blocks(blocks[1:])
    with pytest.raises(AssertionError, match=rf"blocks \[{blocks[1].block_id}\] are not held"):
        view.pin_held([blocks[0].block_id, blocks[1].block_id])
    assert view.num_kept_pins == 0
