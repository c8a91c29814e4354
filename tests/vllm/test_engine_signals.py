"""A setup turned on by name and continuation hints, in vLLM's whole engine (``LLM``) on CPU.

One engine runs the simulator's ``eager+hints`` setup, named in ``kv_connector_extra_config``,
with a CPU tier of eight blocks. Hints go in the way vLLM passes per-request connector data,
``SamplingParams(extra_args={"kv_transfer_params": {"kvtriton_hint": ...}})``. Each round serves
an older and a newer four-block prompt, then a three-block filler whose stores evict three
blocks: which request's blocks the tier still holds shows what the hint did. The round without
hints is the negative control (LRU: the older request's blocks go); a malformed hint must
behave as no hint, with one warning naming the request and the value. One more engine start
shows a start-up error (a tier larger than the machine) stopping the engine with the
connector's one-line message.
"""

from __future__ import annotations

import logging
import os
import random

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")
os.environ["HF_HUB_OFFLINE"] = "1"

from bench.vllm.engine_run import shutdown_engine
from helpers.vllm_driver import cpu_hashes
from kvtriton.vllm.signals import HINT_KEY

BS = 32
BLOCK_BYTES = 2 * 2 * BS * 32 * 4 * 2  # K and V, 2 KV heads of 32, fp32, 2 layers: 32 KiB
PROMPT_BLOCKS = 4
TIER_BLOCKS = 2 * PROMPT_BLOCKS
SETUP = "eager+hints"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _llm(model_dir, extra):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector in this process
    kv = KVTransferConfig(kv_connector="KVTritonConnector",
                          kv_connector_module_path="kvtriton.vllm", kv_role="kv_both",
                          kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
               block_size=BS, enable_prefix_caching=True, kv_cache_memory_bytes=4 << 20,
               max_model_len=2048, max_num_batched_tokens=256, max_num_seqs=8, seed=0,
               dtype="float32", kv_transfer_config=kv)


@pytest.fixture(scope="module")
def engine(model_dir):
    """The ``eager+hints`` engine, its connector's scheduler side and its log lines."""
    ours = logging.getLogger("kvtriton")
    records, level = _Records(), ours.level
    ours.addHandler(records)
    ours.setLevel(logging.INFO)
    llm = _llm(model_dir, {"setup": SETUP, "cpu_bytes_per_rank": (TIER_BLOCKS + 1) * BLOCK_BYTES})
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    try:
        yield llm, side, records
    finally:
        shutdown_engine(llm)
        ours.removeHandler(records)
        ours.setLevel(level)


def _serve(llm, side, prompt: list[int], hint=None) -> set[bytes]:
    """Serve one prompt (8 greedy tokens: its stores complete within the run); the hashes the
    CPU tier gained."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None if hint is None else {"kv_transfer_params": {HINT_KEY: hint}}
    before = cpu_hashes(side)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                 SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True,
                                extra_args=extra), use_tqdm=False)
    return cpu_hashes(side) - before


def _round(llm, side, seed, old_hint, new_hint) -> dict[str, int]:
    """The blocks of the older and the newer request the tier keeps after the filler."""
    assert llm.reset_prefix_cache(reset_connector=True)
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 999) for _ in range(n * BS)]
               for n in (PROMPT_BLOCKS, PROMPT_BLOCKS, PROMPT_BLOCKS - 1)]
    older = _serve(llm, side, prompts[0], old_hint)
    newer = _serve(llm, side, prompts[1], new_hint)
    assert len(older) == len(newer) == PROMPT_BLOCKS
    _serve(llm, side, prompts[2])
    held = cpu_hashes(side)
    return {"older": len(older & held), "newer": len(newer & held)}


def test_the_setup_is_on_by_name(engine):
    _, side, records = engine
    assert side.config.setup == SETUP and side.cpu_pool.eviction.name == "lru+hints"
    assert any(f"setup {SETUP} (" in line for line in records.lines), records.lines


@pytest.mark.parametrize(("old_hint", "new_hint", "kept"), [
    (None, None, {"older": 1, "newer": 4}),  # the negative control: LRU
    (None, "close", {"older": 4, "newer": 1}),  # the closed session's blocks go first
    ("continue", None, {"older": 4, "newer": 1}),  # the continued turn's blocks are kept
], ids=["no_hints", "close", "continue"])
def test_hints_in_kv_transfer_params_decide_what_the_tier_keeps(engine, old_hint, new_hint,
                                                                kept):
    llm, side, _ = engine
    before = dict(side.signals.counters)
    assert _round(llm, side, 10, old_hint, new_hint) == kept
    for hint in ("continue", "close"):
        got = side.signals.counters[f"hints_{hint}"] - before[f"hints_{hint}"]
        assert got == [old_hint, new_hint].count(hint)


def test_a_malformed_hint_is_warned_and_served_as_no_hint(engine):
    llm, side, records = engine
    malformed = side.signals.counters["malformed_hints"]
    start = len(records.lines)
    assert _round(llm, side, 11, None, "stop") == {"older": 1, "newer": 4}
    warned = [line for line in records.lines[start:] if HINT_KEY in line]
    assert len(warned) == 1 and "'stop'" in warned[0] and "request " in warned[0], warned
    assert side.signals.counters["malformed_hints"] == malformed + 1


def test_startup_error_stops_the_engine_with_one_line(model_dir):
    """A tier larger than the machine: refused when the connector is built, before the host
    pool is allocated (no ``OverflowError`` from ``mmap``)."""
    with pytest.raises(Exception) as e:  # vLLM may wrap it: the text is checked
        _llm(model_dir, {"setup": SETUP, "cpu_bytes_per_rank": 2**70})
    chain, err = [], e.value
    while err is not None:
        chain.append(str(err))
        err = err.__cause__ or err.__context__
    assert any("kv_connector_extra_config['cpu_bytes_per_rank'] = 1180591620717411303424" in m
               and "exceeds this machine's memory" in m for m in chain), chain
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()
