"""vLLM's whole engine (``LLM``) on token prompts, with or without ``KVTritonConnector``.

The end-to-end tests and ``bench.vllm.engine`` run through here: ``tiny_llama`` writes a small
Llama checkpoint with random weights (``transformers``; no download, about 1 MB), ``run_turns``
serves batches of token prompts in order (a multi-turn workload: each batch may extend the
prompts of the one before) with greedy sampling and returns every output's tokens and
logprobs, with the connector's counters after each batch. Between batches a turn may be
``"reset_gpu"`` (vLLM's ``reset_prefix_cache()``: the GPU prefix cache only) or ``"reset_all"``
(``reset_prefix_cache(reset_connector=True)``: the CPU tier too, transfers in flight or
not), or a callable, called there (in this process only). ``patch`` runs before the
engine starts and returns its undo: the tests' fault injection (``tests/helpers/faults.py``)
patches the transfer engine through it.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless
``multiprocess=True``; the connector is then in the engine-core and worker processes, and only
the outputs come back. Several engines can run one after the other in one process:
``run_turns`` shuts each down, its KV connector included.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EngineRun", "run_turns", "tiny_llama"]


def tiny_llama(path: str | Path, *, seed: int = 0, vocab_size: int = 1000,
               num_layers: int = 2, max_model_len: int = 4096,
               sliding_window: int | None = None, hidden_size: int = 128,
               intermediate_size: int | None = None, num_heads: int = 4,
               num_kv_heads: int = 2) -> Path:
    """A Llama (``sliding_window``: a Mistral, every layer windowed) with random weights from
    ``seed``, saved with ``save_pretrained`` into ``path``; reused if there (the folder's name
    should say its size). ``intermediate_size`` defaults to twice ``hidden_size``."""
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size,
              intermediate_size=intermediate_size or 2 * hidden_size,
              num_hidden_layers=num_layers, num_attention_heads=num_heads,
              num_key_value_heads=num_kv_heads,
              max_position_embeddings=max_model_len)
    torch.manual_seed(seed)
    if sliding_window is None:
        model = LlamaForCausalLM(LlamaConfig(**kw))
    else:
        model = MistralForCausalLM(MistralConfig(sliding_window=sliding_window, **kw))
    model.save_pretrained(path)
    return path


@dataclass
class EngineRun:
    """What one engine run gave: per batch, per prompt, the sampled tokens and their logprobs."""

    tokens: list[list[list[int]]] = field(default_factory=list)
    logprobs: list[list[list[float]]] = field(default_factory=list)
    connector_stats: dict[str, Any] = field(default_factory=dict)  # SchedulerSide.counters()
    stats_by_turn: list[dict[str, Any]] = field(default_factory=list)  # after each batch
    # Per reset: whether stores were pending (queued or in flight) then, and what it returned.
    resets: list[tuple[bool, bool]] = field(default_factory=list)
    worker_stats: dict[str, Any] = field(default_factory=dict)
    transfers: dict[str, Any] = field(default_factory=dict)  # WorkerSide.transfer_totals()
    kv_cache_blocks: int = 0
    layout: str = ""  # the connector's view of vLLM's KV cache groups
    startup_s: float = 0.0
    wall_s: float = 0.0
    # In this process: steps run after the last batch while the scheduler had work, and then
    # whether stores were pending, loads in flight and the GPU pool's free blocks.
    drain_steps: int = 0
    idle: dict[str, Any] = field(default_factory=dict)


def _drain(core: Any, max_steps: int = 10_000) -> int:
    """Step the engine core while its scheduler has work (vLLM's ``has_requests``: the
    connector's pending stores count), as the engine-core process's loop does; ``LLM.generate``
    in this process stops at its last output, leaving stores reported late unregistered.
    Returns the steps run."""
    n = 0
    while core.scheduler.has_requests():
        if n == max_steps:
            raise RuntimeError(f"the engine still had work after {max_steps} idle steps")
        core.step()
        n += 1
    return n


def _llm_kwargs(model_dir: str | Path, connector: dict[str, Any] | None, *, block_size: int,
                kv_cache_memory_bytes: int, max_model_len: int, max_num_batched_tokens: int,
                max_num_seqs: int, dtype: str) -> dict[str, Any]:
    from vllm.config import KVTransferConfig

    kv = None
    if connector is not None:
        kv = KVTransferConfig(kv_connector="KVTritonConnector",
                              kv_connector_module_path="kvtriton.vllm", kv_role="kv_both",
                              kv_load_failure_policy="recompute",
                              kv_connector_extra_config=dict(connector))
    return dict(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
                block_size=block_size, enable_prefix_caching=True,
                kv_cache_memory_bytes=kv_cache_memory_bytes, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                seed=0, dtype=dtype, kv_transfer_config=kv)


Prompt = Sequence[int] | tuple[Sequence[int], int]


def run_turns(model_dir: str | Path, turns: Sequence[Sequence[Prompt] | str | Callable], *,
              connector: dict[str, Any] | None, max_tokens: int = 8, block_size: int = 32,
              kv_cache_memory_bytes: int = 4 << 20, max_model_len: int = 2048,
              max_num_batched_tokens: int = 256, max_num_seqs: int = 8,
              dtype: str = "float32", patch: Callable[[], Callable[[], None]] | None = None,
              multiprocess: bool = False) -> EngineRun:
    """Serve ``turns`` in order with greedy sampling, on vLLM with ``KVTritonConnector``
    configured by ``connector`` (its ``kv_connector_extra_config``; None: no CPU tier). A turn
    is a batch of prompts (token lists, or ``(tokens, max_tokens)`` pairs; ``max_tokens``
    otherwise) or a reset (module docstring). ``kv_cache_memory_bytes`` sizes the GPU (on CPU:
    host) KV cache; ``block_size`` is in tokens (a multiple of 32 on CPU). fp32 by default:
    in bf16 the rounding of a prompt computed in other batch shapes (which CPU hits change)
    flips tokens of a random model's near-uniform logits."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    if patch is not None and multiprocess:
        raise ValueError("patch changes this process's engine: not with multiprocess=True")
    undo = patch() if patch is not None else None
    try:
        return _run(model_dir, turns, connector, max_tokens, multiprocess,
                    dict(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                         max_model_len=max_model_len,
                         max_num_batched_tokens=max_num_batched_tokens,
                         max_num_seqs=max_num_seqs, dtype=dtype))
    finally:
        if undo is not None:
            undo()


def _run(model_dir, turns, connector, max_tokens, multiprocess, engine_kw) -> EngineRun:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    try:
        llm = LLM(**_llm_kwargs(model_dir, connector, **engine_kw))
    except BaseException:
        # vLLM keeps the KV connector of a worker it built in a process global: an engine that
        # failed at start would hand it to the next engine of this process.
        from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        raise
    run = EngineRun(startup_s=time.perf_counter() - t0)
    core = None if multiprocess else llm.llm_engine.engine_core.engine_core
    conn = None if core is None else core.scheduler.connector
    try:
        t1 = time.perf_counter()
        for turn in turns:
            if callable(turn):  # a test's action between batches (kill a store, say)
                turn()
                continue
            if isinstance(turn, str):
                if turn not in ("reset_gpu", "reset_all"):
                    raise ValueError(f"turn {turn!r}: expected a batch, 'reset_gpu' or "
                                     "'reset_all'")
                pending = conn is not None and conn.scheduler_side.has_pending_stores()
                ok = llm.reset_prefix_cache(reset_connector=turn == "reset_all")
                run.resets.append((pending, ok))
                continue
            prompts, params = [], []
            for p in turn:
                tokens, n = (p if isinstance(p, tuple) else (p, max_tokens))
                prompts.append(TokensPrompt(prompt_token_ids=list(tokens)))
                params.append(SamplingParams(temperature=0, max_tokens=n, detokenize=False,
                                             logprobs=0, ignore_eos=True))
            outs = llm.generate(prompts, params, use_tqdm=False)
            run.tokens.append([list(o.outputs[0].token_ids) for o in outs])
            run.logprobs.append([[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                                 o.outputs[0].logprobs,
                                                                 strict=True)]
                                 for o in outs])
            if conn is not None:
                run.stats_by_turn.append(conn.scheduler_side.counters())
        run.wall_s = time.perf_counter() - t1
        if core is not None:
            run.drain_steps = _drain(core)
            pool = core.scheduler.kv_cache_manager.block_pool
            run.kv_cache_blocks = pool.num_gpu_blocks
            if conn is not None:
                side = conn.scheduler_side
                run.idle = {"stores_pending": side.has_pending_stores(),
                            "loads_in_flight": len(side.planner.loads_in_flight()),
                            "gpu_free": pool.get_num_free_blocks()}
                side.planner.check_invariants(idle=True)
                run.connector_stats = conn.scheduler_side.counters()
                run.layout = conn.scheduler_side.layout.describe()
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                worker = get_kv_transfer_group().worker_side
                run.worker_stats = worker.counters()
                run.transfers = worker.transfer_totals()
    finally:
        shutdown_engine(llm)
    return run


def shutdown_engine(llm: Any) -> None:
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        ensure_kv_transfer_shutdown()
        del llm
        gc.collect()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.vllm.engine_run SPEC.json OUT.json``: ``run_turns`` with the keyword
    arguments in SPEC (``model_dir``, ``turns`` and the rest) in a fresh process, its
    ``EngineRun`` written to OUT as JSON. The multi-process engine needs this: its worker
    processes re-import the launching module, which a test runner's is not fit for."""
    import json
    import sys
    from dataclasses import asdict

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m bench.vllm.engine_run SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    spec["turns"] = [t if isinstance(t, str) else
                     [tuple(p) if isinstance(p, list) and len(p) == 2 and isinstance(p[1], int)
                      and isinstance(p[0], list) else p for p in t]
                     for t in spec["turns"]]
    run = run_turns(spec.pop("model_dir"), spec.pop("turns"), **spec)
    Path(args[1]).write_text(json.dumps(asdict(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
