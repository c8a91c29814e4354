"""``VllmGpuPool``'s batch listeners against its per-key ones, on vLLM's own ``BlockPool``: each
vLLM call that changes many blocks (allocation with evictions, caching, explicit evictions, a
reset) reaches a batch listener once, with the same (key id, block id) pairs, in the same order,
as the per-key listener hears one by one; a change outside those calls comes as a batch of one."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm")

from bench.bench_vs_vllm import _hash, _VllmRequest
from kvtriton.vllm.gpu_pool import VllmGpuPool
from kvtriton.vllm.keys import KeyIds

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
