"""``kvtriton.pool.GpuPool``: what the planner uses of its GPU pool, and the two pools that serve
it, ``BlockPool`` and vLLM's pool seen through ``kvtriton.vllm.gpu_pool.VllmGpuPool``."""

from __future__ import annotations

import typing

import pytest

from kvtriton.pool import BlockPool, GpuPool

#: Every attribute and method of the GPU pool that kvtriton/planner/*.py reads or calls.
PLANNER_USES = {"num_blocks", "ref_cnt", "add_listener", "block_hash", "block_keys",
                "get_cached_block", "__contains__", "iter_free", "touch", "free_blocks"}


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
