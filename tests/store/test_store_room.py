"""A store with no memory, a full one, and a name another writer holds first, against a real
``mooncake_master`` on loopback (issue 50, item 4): the scheduler says at start when nothing
can ever be stored (no replica contributes, no store host joined); a put the store has no room
for is counted as ``full``, not as any error; and a put of a name another writer began or
finished first is counted ``already_present``, never as stored (Mooncake keeps the first
writer's object and answers a plain put of the same name with 0)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from kvtriton.pool import BlockPool
from kvtriton.second_tier.client import NO_MEMORY, StoreClient
from kvtriton.second_tier.config import parse_second_tier
from kvtriton.second_tier.faults import FaultLog
from kvtriton.second_tier.local_master import join, mooncake_master
from kvtriton.second_tier.naming import object_names
from kvtriton.second_tier.worker_io import StoreIO
from kvtriton.specs import FullAttentionSpec, KVLayout

ROW = 1 << 20  # a 1 MiB block: 16 of them fill Mooncake's smallest segment
FP = "fedcba9876543210"


def _config(master, **kw):
    return parse_second_tier({"kind": "mooncake",
                              "master_server_address": master.master_server_address,
                              "metadata_server": master.metadata_server, **kw})


def _io(master, seed: int, blocks: int = 8) -> StoreIO:
    pool = np.random.default_rng(seed).integers(0, 256, (blocks, ROW), dtype=np.uint8)
    return StoreIO(StoreClient(_config(master), 0, FaultLog(f"test {seed}")), FP, pool, (ROW,),
                   background=False)


def _hashes(n: int, salt: int) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


def _scheduler_part(master):
    """The scheduler's part as the connector builds it at start (``store_tier``), for a
    one-rank model; a plain namespace stands for vLLM's config (the fields it reads)."""
    from kvtriton.vllm.store_tier import scheduler_fetches

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="test-model", revision=None, dtype="float16"),
        cache_config=SimpleNamespace(cache_dtype="auto", prefix_caching_hash_algo="sha256"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1))
    layout = KVLayout([FullAttentionSpec(16, 1, 8, 1)])
    return scheduler_fetches(_config(master), vllm_config, layout, BlockPool(9),
                             lambda key: bytes(32))


def test_start_says_when_the_store_holds_no_memory(caplog):
    """Default ``segment_bytes: 0`` and no store host: every put would fail, said once at start;
    a store host joined: nothing said."""
    with mooncake_master() as m:
        with caplog.at_level(logging.WARNING, logger="kvtriton"):
            _scheduler_part(m).close()
        said = [r.getMessage() for r in caplog.records if NO_MEMORY in r.getMessage()]
        assert len(said) == 1 and m.master_server_address in said[0], caplog.text
        assert "segment_bytes" in said[0] and "\n" not in said[0]
        caplog.clear()
        host = join(m, segment_bytes=16 << 20, buffer_bytes=4 << 20)
        try:
            with caplog.at_level(logging.WARNING, logger="kvtriton"):
                _scheduler_part(m).close()
        finally:
            host.close()
        assert NO_MEMORY not in caplog.text


def test_a_full_store_is_counted_full_not_error(caplog):
    """A 16 MiB store host and 24 blocks of 1 MiB: the puts past its room are ``full``, warned
    once as such; none is the generic ``error``."""
    with mooncake_master() as m:
        host = join(m, segment_bytes=16 << 20, buffer_bytes=4 << 20)
        a = _io(m, 1, blocks=24)
        try:
            with caplog.at_level(logging.WARNING, logger="kvtriton"):
                a.put(list(range(24)), [0] * 24, _hashes(24, salt=1))
            stored = a.stats["second_tier_put_blocks"]
            assert 0 < stored < 24
            assert a.faults.counts["full"] == 24 - stored
            assert a.faults.counts["error"] == 0
            warned = [r.getMessage() for r in caplog.records if "second tier fault" in
                      r.getMessage()]
            assert len(warned) == 1 and "'full'" in warned[0]
        finally:
            a.close()
            host.close()


def test_a_store_with_no_memory_counts_every_put_full():
    with mooncake_master() as m:
        a = _io(m, 2)
        try:
            a.put([0, 1, 2], [0] * 3, _hashes(3, salt=2))
            assert a.stats["second_tier_put_blocks"] == 0
            assert a.faults.counts["full"] == 3 and a.faults.counts["error"] == 0
        finally:
            a.close()


@pytest.fixture
def master():
    with mooncake_master() as m:
        host = join(m, segment_bytes=64 << 20, buffer_bytes=4 << 20)
        yield m
        host.close()


def test_a_name_another_writer_wrote_first_is_already_present_not_stored(master):
    """Replica ``b`` finds its blocks absent, then replica ``a`` writes them before ``b``'s put
    (the interleaving is forced by running ``a``'s put inside ``b``'s existence query; the
    store is real). Mooncake keeps ``a``'s objects: ``b`` stored none of them."""
    a, b = _io(master, 3), _io(master, 4)
    hashes = _hashes(4, salt=3)
    query = b.client.exists

    def absent_then_written_by_a(names):
        present = query(names)
        a.put([0, 1, 2, 3], [0] * 4, hashes)
        return present

    try:
        b.client.exists = absent_then_written_by_a
        b.put([4, 5, 6, 7], [0] * 4, hashes)
        assert a.stats["second_tier_put_blocks"] == 4
        assert b.stats["second_tier_put_already_present"] == 4
        assert b.stats["second_tier_put_blocks"] == 0 and b.stats["second_tier_put_bytes"] == 0
        assert sum(b.faults.counts.values()) == 0  # not a fault
        # What the store holds is a's: read back into b's pool, it matches a's blocks.
        b.fetch(0, [0, 1], [0, 0], hashes[:2])
        assert b.take_results() == {0: []}
        assert np.array_equal(b._pool[0:2], a._pool[0:2])
    finally:
        a.close()
        b.close()


def test_a_name_another_writer_is_writing_is_already_present_not_stored(master):
    """A writer that has begun (reserved the name, bytes not yet sealed): the existence query
    says absent, and a plain put answered 0 and stored nothing, counted as stored. Once the
    other writer gives up, the name is absent: ``b`` never claimed it."""
    b = _io(master, 5)
    hashes = _hashes(2, salt=5)
    names = object_names(FP, hashes)
    other = join(master, segment_bytes=0, buffer_bytes=1 << 20)
    try:
        assert other.batch_put_session_start(names, [ROW + 64] * 2) == [0, 0]
        b.put([0, 1], [0, 0], hashes)
        assert b.stats["second_tier_put_already_present"] == 2
        assert b.stats["second_tier_put_blocks"] == 0
        assert other.batch_put_session_revoke(names) == [0, 0]
        assert b.client.exists(names).tolist() == [False, False]
        b.put([0, 1], [0, 0], hashes)  # now b writes them
        assert b.stats["second_tier_put_blocks"] == 2
        assert b.client.exists(names).tolist() == [True, True]
    finally:
        other.close()
        b.close()
