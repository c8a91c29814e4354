"""vLLM's ``KVCacheConfig`` as a kvtriton ``KVLayout``, and the CPU tier's size in blocks.

The planner needs each group's kind and block size, and the hash block size; vLLM resolves the
latter two exactly as its own offload connector does (``resolve_kv_cache_block_sizes``). The
CPU tier is sized the way vLLM's SimpleCPUOffloadConnector sizes it, so both hold the same
number of blocks for the same bytes: ``GPU blocks x CPU bytes // GPU KV bytes`` blocks, where the
GPU KV bytes are those of the backing allocation every ``KVCacheTensor`` describes, and block 0
of them is the null block (never used), as in vLLM's pools.
"""

from __future__ import annotations

from typing import Any

from kvtriton.specs import FullAttentionSpec, GroupSpec, KVLayout, MambaSpec, SlidingWindowSpec

__all__ = ["cpu_blocks_for_bytes", "layout_from_vllm"]


def _group_spec(i: int, group: Any) -> GroupSpec:
    from vllm.v1 import kv_cache_interface as kvi

    spec = group.kv_cache_spec
    n_layers = max(1, len(group.layer_names))
    kind = type(spec)
    if not getattr(spec, "prefix_cacheable", True):
        raise ValueError(f"KVTritonConnector: KV cache group {i} ({kind.__name__}) is not "
                         "prefix-cacheable; every group must be")
    if kind in (kvi.FullAttentionSpec, kvi.MLAAttentionSpec):
        return FullAttentionSpec(spec.block_size, spec.num_kv_heads, spec.head_size, n_layers,
                                 dtype=spec.dtype)
    if kind is kvi.SlidingWindowSpec:
        return SlidingWindowSpec(spec.block_size, spec.num_kv_heads, spec.head_size, n_layers,
                                 sliding_window=spec.sliding_window, dtype=spec.dtype)
    if kind is kvi.MambaSpec:
        conv, ssm = spec.shapes[0], spec.shapes[-1]
        return MambaSpec(spec.block_size, tuple(conv), tuple(ssm), n_layers,
                         dtype=spec.dtypes[0], ssm_dtype=spec.dtypes[-1])
    raise ValueError(f"KVTritonConnector: KV cache group {i} has a {kind.__name__}, which the "
                     "CPU tier cannot address; supported: FullAttentionSpec, MLAAttentionSpec, "
                     "SlidingWindowSpec, MambaSpec")


def layout_from_vllm(vllm_config: Any, kv_cache_config: Any) -> tuple[KVLayout, int]:
    """The layout of ``kv_cache_config``'s groups (in vLLM's group order) and vLLM's scheduler
    block size in tokens; ``ValueError`` for a group the tier cannot address."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    groups = [_group_spec(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups)]
    if not groups:
        raise ValueError("KVTritonConnector: the KV cache config has no groups")
    layout = KVLayout(groups, hash_block_size=hash_block, name="vllm")
    if layout.scheduler_block_size != scheduler_block:
        raise ValueError(f"KVTritonConnector: vLLM's scheduler block is {scheduler_block} "
                         f"tokens, the groups' LCM is {layout.scheduler_block_size}")
    return layout, scheduler_block


def cpu_blocks_for_bytes(kv_cache_config: Any, cpu_bytes: int) -> int:
    """CPU blocks in ``cpu_bytes`` for this GPU KV cache, the null block 0 included (so one fewer
    holds KV); ``ValueError`` if not even one would."""
    tensors = kv_cache_config.kv_cache_tensors
    if not tensors:
        raise ValueError("KVTritonConnector: the KV cache config has no KV cache tensors")
    gpu_bytes = tensors[0].size
    n = kv_cache_config.num_blocks * cpu_bytes // gpu_bytes
    if n < 2:
        per_block = -(-gpu_bytes // kv_cache_config.num_blocks)
        raise ValueError(f"KVTritonConnector: cpu_bytes_per_rank={cpu_bytes} is too small for "
                         f"one CPU block besides the null block; a block takes {per_block} "
                         f"bytes, so give at least {2 * per_block}")
    return n
