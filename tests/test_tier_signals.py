"""``SignalBook`` moves a finished request's free CPU blocks into their hint's segment in chain
order (head first, as the chain's positions run), whatever the keys' id numbering. It moved them
in ascending key id: the connector numbers keys as vLLM shows it hashes (and recycles ids), the
simulator's ``ServingLoop`` as the workload lists them, so the two evicted the same hinted
blocks in different orders (``lazy+hints`` on ``bench.vllm.engine``'s ``cc_agentic``: 42.6% in
``ServingLoop`` against 49.0% in ``VllmLoop`` on one clock, equal once in chain order)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtriton.eviction import CLOSED, PROTECTED, HintedQueue, LRUQueue
from kvtriton.pool import BlockPool
from kvtriton.tier_signals import SignalBook

# One chain of four positions, numbered three ways: ascending, descending, shuffled.
CHAINS = {"ascending": [3, 5, 7, 9], "descending": [9, 7, 5, 3], "shuffled": [7, 3, 9, 5]}


def _tier(chain: list[int]) -> tuple[BlockPool, HintedQueue, SignalBook]:
    queue = HintedQueue(LRUQueue(), 1.0)  # the whole tier may be protected
    pool = BlockPool(len(chain) + 1, eviction=queue, medium="CPU")
    # Cached in reverse chain order: the plain queue holds them tail first.
    blocks = pool.get_new_blocks(len(chain))
    for b, k in zip(blocks, reversed(chain), strict=True):
        pool.cache_block(b, k)
    pool.free_blocks(blocks)

    def free_block(key: int) -> int | None:
        b = pool.get_cached_block(key)
        return b if b is not None and pool.is_free(b) else None

    return pool, queue, SignalBook(queue, free_block, hints=True, lookahead=False)


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
