"""One client claiming the CPU tier's protected segment, in vLLM's whole engine (``LLM`` on CPU):
what do the other clients lose?

A session id and a ``continue`` hint are a client's word. Each finished turn that carries one
claims protection for its blocks (``kvtriton.tier_signals``, "Claims"). An attacker that sends a
fresh session id (``eager+sessions``) or ``continue`` (``lazy+hints``) with every request tries to
fill the protected segment with blocks nobody comes back for, pushing every other client's
prefixes out of the tier.

A run serves ``victims`` conversations of ``turns`` turns, none with a session id or hint: each
turn's prompt is the previous one, its output and a new user message. After each round of victim
turns the attacker sends ``attack`` requests of ``attack_tokens`` random tokens. Three arms per
setup, each in the same engine after ``reset_prefix_cache(reset_connector=True)``:

- ``quiet``: the victims alone;
- ``plain``: the attacker's requests without a session id or hint (the load, not the claim);
- ``claims``: the same requests, each with a fresh session id or ``continue``.

The measure is the victims' CPU-hit tokens (the connector's ``cpu_hit_tokens`` over the
victims' rounds only), with their prefix-cache hit tokens on GPU and CPU together beside it.
The target (issue 50): with ``claims`` the victims lose at most 20% of what they get with
``plain``. The loss against ``quiet`` is reported beside it, but it is no target: without the
attacker's load the victims' prefixes stay on the GPU, so their CPU hits there are few. The
victims' outputs are compared across the arms: the tier must never change a token.

Run: ``python -m bench.vllm.claims_attack [--victims N] [--turns N] [--attack N] [--json out]``.
The test (``tests/vllm/test_claims_attack.py``) runs it at the size of the issue's report.
"""

from __future__ import annotations

import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import OneLineParser, write_result

__all__ = ["ARMS", "SETUPS", "AttackSize", "findings", "run_setup"]

#: Each setup with how its attacker claims: a fresh session id, or ``continue``.
SETUPS = {"eager+sessions": "session_id", "lazy+hints": "hint"}
ARMS = ("quiet", "plain", "claims")
#: The most the victims may lose under ``claims`` against ``plain`` (issue 50).
TARGET_LOSS = 0.20
BS = 32
BLOCK_BYTES = 2 * 2 * BS * 32 * 4 * 2  # K and V, 2 KV heads of 32, fp32, 2 layers: 32 KiB


@dataclass(frozen=True, slots=True)
class AttackSize:
    """The engine and the traffic. ``gpu_blocks``/``cpu_blocks``: the two pools, blocks of
    ``BS`` tokens; the victims' prompts start with ``system_tokens`` of their own and add
    ``user_tokens`` a turn; each request generates ``output_tokens``."""
    gpu_blocks: int = 66
    cpu_blocks: int = 150
    victims: int = 6
    turns: int = 4
    attack: int = 16
    attack_tokens: int = 163
    system_tokens: int = 96
    user_tokens: int = 64
    output_tokens: int = 8
    seed: int = 0


def _llm(model_dir: Path, size: AttackSize, setup: str) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the connector in this process
    extra = {"setup": setup, "cpu_bytes_per_rank": (size.cpu_blocks + 1) * BLOCK_BYTES}
    kv = KVTransferConfig(kv_connector="KVTritonConnector",
                          kv_connector_module_path="kvtriton.vllm", kv_role="kv_both",
                          kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    return LLM(model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True,
               block_size=BS, enable_prefix_caching=True,
               kv_cache_memory_bytes=size.gpu_blocks * BLOCK_BYTES, max_model_len=2048,
               max_num_batched_tokens=512, max_num_seqs=16, seed=0, dtype="float32",
               kv_transfer_config=kv)


def _generate(llm: Any, prompts: list[list[int]], size: AttackSize,
              params: list[dict | None]) -> tuple[list[list[int]], int]:
    """Serve ``prompts`` with their ``kv_transfer_params``; their outputs and their prefix-cache
    hit tokens, GPU and CPU together."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = [SamplingParams(temperature=0, max_tokens=size.output_tokens, detokenize=False,
                               ignore_eos=True,
                               extra_args=None if p is None else {"kv_transfer_params": p})
                for p in params]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                        use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            sum(o.num_cached_tokens or 0 for o in outs))


def _attack_params(kind: str, arm: str, serial: int) -> dict | None:
    if arm != "claims":
        return None
    from kvtriton.vllm.releases import HINT_KEY, SESSION_KEY

    return ({SESSION_KEY: f"attacker-{serial}"} if kind == "session_id"
            else {HINT_KEY: "continue"})


def run_arm(llm: Any, side: Any, size: AttackSize, kind: str, arm: str,
            first_id: int = 0) -> dict:
    """One arm on a reset tier: the victims' CPU-hit tokens, their outputs, the book's
    claim counts. The attacker's session ids count from ``first_id``: fresh in every arm of
    one engine, as the attack sends them (an id seen in an earlier arm, with the same context,
    would be a session that came back)."""
    assert llm.reset_prefix_cache(reset_connector=True)
    start = side.counters()
    rng = random.Random(size.seed)
    prompts = [[rng.randrange(1, 999) for _ in range(size.system_tokens + size.user_tokens)]
               for _ in range(size.victims)]
    # The attacker's prompts fresh in every arm too: a context sent again would come back.
    attack_rng = random.Random(f"{size.seed + 1}-{first_id}")
    victim_hits = victim_cached = 0
    outputs: list[list[int]] = []
    serial = first_id
    for turn in range(size.turns):
        before = side.counters()["cpu_hit_tokens"]
        outs, cached = _generate(llm, prompts, size, [None] * size.victims)
        victim_hits += side.counters()["cpu_hit_tokens"] - before
        victim_cached += cached
        outputs.extend(outs)
        prompts = [p + o + [rng.randrange(1, 999) for _ in range(size.user_tokens)]
                   for p, o in zip(prompts, outs, strict=True)]
        if arm == "quiet" or turn == size.turns - 1:
            continue
        attack = [[attack_rng.randrange(1, 999) for _ in range(size.attack_tokens)]
                  for _ in range(size.attack)]
        params = []
        for _ in attack:
            params.append(_attack_params(kind, arm, serial))
            serial += 1
        _generate(llm, attack, size, params)
    # What the bounds did, from the connector's stats (kvtriton.vllm.stats), over this arm.
    done = {k: v - start.get(k, 0) for k, v in side.counters().items()
            if k.startswith(("claims_", "session_turns", "hints_continue"))}
    return {"arm": arm, "victim_cpu_hit_tokens": int(victim_hits),
            "victim_cached_tokens": int(victim_cached),
            "attack_requests": serial - first_id,
            "claims_made": done.get("session_turns", 0) + done.get("hints_continue", 0),
            "claims_proven": done.get("claims_proven", 0),
            "claims_let_go": {"unproven": done.get("claims_unproven_let_go", 0),
                              "over_share": done.get("claims_over_share_let_go", 0)},
            "outputs": outputs}


def run_setup(model_dir: Path, setup: str, size: AttackSize,
              arms: Sequence[str] = ARMS) -> list[dict]:
    """``arms`` of ``setup`` in one engine; rows without the outputs, which must agree."""
    from bench.vllm.engine_run import shutdown_engine

    llm = _llm(model_dir, size, setup)
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    try:
        rows = []
        for arm in arms:
            rows.append(run_arm(llm, side, size, SETUPS[setup], arm,
                                sum(r["attack_requests"] for r in rows)))
    finally:
        shutdown_engine(llm)
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    for r in rows:
        del r["outputs"]
        r.update(setup=setup, outputs_identical=same)
    return rows


def losses(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Per setup, the victims' loss under ``claims`` against ``plain`` and against ``quiet``
    (a share of their CPU-hit tokens there, over every run of each arm; None where they had
    none)."""
    out: dict[str, dict[str, float]] = {}
    for setup in dict.fromkeys(r["setup"] for r in rows):
        hits: dict[str, int] = {}
        for r in rows:
            if r["setup"] == setup:
                hits[r["arm"]] = hits.get(r["arm"], 0) + r["victim_cpu_hit_tokens"]
        out[setup] = {f"vs_{ref}": (None if not hits.get(ref)
                                    else round(1 - hits["claims"] / hits[ref], 4))
                      for ref in ("plain", "quiet")}
    return out


def findings(_name: str, doc: dict) -> dict:
    lost = losses(doc["rows"])
    return {"loss": lost, "target_loss": TARGET_LOSS,
            "met": all(v["vs_plain"] is not None and v["vs_plain"] <= TARGET_LOSS
                       for v in lost.values()),
            "outputs_identical": all(r["outputs_identical"] for r in doc["rows"])}


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.vllm.claims_attack",
                           description=__doc__.split("\n\n")[0])
    d = AttackSize()
    parser.add_argument("--victims", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--attack", type=int, default=32)
    parser.add_argument("--gpu-blocks", type=int, default=2 * d.gpu_blocks)
    parser.add_argument("--cpu-blocks", type=int, default=2 * d.cpu_blocks)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for name, value in (("--victims", args.victims), ("--turns", args.turns),
                        ("--attack", args.attack), ("--gpu-blocks", args.gpu_blocks),
                        ("--cpu-blocks", args.cpu_blocks)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    setups = args.setups.split(",")
    for s in setups:
        if s not in SETUPS:
            parser.error(f"--setups: {s!r} is not one of {', '.join(SETUPS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.vllm.engine_run import tiny_llama

    size = AttackSize(gpu_blocks=args.gpu_blocks, cpu_blocks=args.cpu_blocks,
                      victims=args.victims, turns=args.turns, attack=args.attack)
    model = tiny_llama(Path(os.environ.get("KVTRITON_MODEL_CACHE", "/tmp")) / "kvt-tiny-llama")
    t0 = time.perf_counter()
    rows = [row for s in setups for row in run_setup(model, s, size)]
    wall = time.perf_counter() - t0
    for r in rows:
        print(f"{r['setup']:15} {r['arm']:6} victims' CPU-hit tokens "
              f"{r['victim_cpu_hit_tokens']:6,} (all hits {r['victim_cached_tokens']:6,})  "
              f"claims {r['claims_made']} "
              f"(proven {r['claims_proven']}, let go {r['claims_let_go']})")
    doc = {"size": asdict(size), "wall_s": round(wall, 1), "rows": rows}
    found = findings("claims_attack", doc)
    for setup, v in found["loss"].items():
        print(f"{setup}: victims lose {v['vs_plain']:.1%} against the plain attacker, "
              f"{v['vs_quiet']:.1%} against no attacker (target <= {TARGET_LOSS:.0%})")
    if args.json:
        write_result(args.json.stem, doc, args.json.parent, findings)
    return 0 if found["met"] and found["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
