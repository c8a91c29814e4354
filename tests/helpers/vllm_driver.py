"""Driving ``KVTritonConnector`` in vLLM's real ``Scheduler`` (scheduler role; no model is run),
for the ``tests/vllm`` tests: a scheduler built on a local ``config.json`` (no hub access) and
stepped with ``bench.conformance.scheduler_driver.Driver``, which reports every transfer one step
after it was issued unless a test holds it; the hashes each side holds; the checks of an idle end.

Importing this module does not import vLLM: the test modules skip first when it is missing.
"""

from __future__ import annotations

import pytest

from bench.conformance.scheduler_driver import Driver
from kvtriton.sim.vllm_scheduler import make_scheduler, vllm_request
from kvtriton.specs import FullAttentionSpec, SlidingWindowSpec

BS = 16
FULL = FullAttentionSpec(BS, 1, 8, 1)
WINDOW = SlidingWindowSpec(BS, 1, 8, 1, sliding_window=32)


def needs_engine() -> pytest.MarkDecorator:
    """Skip a test that starts vLLM's engine where the installed vLLM cannot start one: a CUDA
    wheel on a machine without a GPU, whose platform is unspecified (``make test``'s second lane
    runs vLLM 0.33.0's CUDA wheel over the CPU venv for its scheduler alone). The reason names
    the release."""
    import vllm
    from vllm.platforms import current_platform

    return pytest.mark.skipif(
        current_platform.is_unspecified(),
        reason=f"vLLM {vllm.__version__} has no platform here (its CUDA wheel without a GPU): "
               "no engine starts; its scheduler runs the scheduler-role tests")


def tokens(seed: int, n: int, start: int = 0) -> list[int]:
    """Token ids that depend on (seed, position): equal seeds share their prefix."""
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(start, start + n)]


def build(model_dir, groups=(FULL,), **kw):
    kw.setdefault("num_gpu_blocks", 64)
    kw.setdefault("cpu_blocks", 128)
    kw.setdefault("max_num_batched_tokens", 256)
    s = make_scheduler(model_dir, list(groups), **kw)
    return s, s.connector.scheduler_side, Driver(s, world_size=kw.get("world_size", 1))


def cpu_hashes(side) -> set[bytes]:
    """vLLM hashes (with group id) the CPU tier holds now."""
    pool = side.cpu_pool
    return {side.keys.hash_of(k) for b in range(1, pool.num_blocks) for k in pool.block_keys(b)}


def gpu_block_hashes(s, rid) -> list[list[bytes | None]]:
    """Per group, the vLLM hash of each GPU block of ``rid``'s table."""
    pool = s.kv_cache_manager.block_pool
    return [[pool.blocks[b].block_hash for b in ids]
            for ids in s.kv_cache_manager.get_block_ids(rid)]


def run(drv, max_steps=500):
    drv.run(max_steps)
    assert not drv.scheduler.has_requests() and not drv.pending()


def assert_idle(s, side):
    """Nothing leaked: every GPU and CPU block is free and the planner holds nothing."""
    side.planner.check_invariants(idle=True)
    pool = s.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert side.cpu_pool.num_used_blocks == 0
    assert side.keys.num_reserved() == 0


def evict_gpu(drv, seed=999, natural=False):
    """Empty the GPU prefix cache: vLLM's ``reset_prefix_cache`` (nothing may be running), or
    with ``natural`` two requests of fresh tokens that take every GPU block (their blocks go to
    the CPU tier too)."""
    if not natural:
        assert drv.scheduler.reset_prefix_cache()
        return
    kv = drv.scheduler.kv_cache_manager
    n = (kv.block_pool.num_gpu_blocks - 1) // kv.num_kv_cache_groups - 2
    for i in range(2):  # two rounds: every block of the pool is handed out at least once
        drv.add(vllm_request(f"filler{seed}.{i}", tokens(seed + i, n * BS), 1, BS))
        run(drv)


def step_until(drv, cond, limit=200):
    for _ in range(limit):
        so, _ = drv.step()
        if cond(so):
            return so
    raise AssertionError("condition never met")


def gpu_hash_list(token_ids, group=0):
    """vLLM's hashes (with group id) of the full blocks of ``token_ids``."""
    r = vllm_request("h", token_ids, 1, BS)
    return [h + group.to_bytes(4, "big") for h in r.block_hashes]
