"""The re-store design's scenario, run for real: the mid-chain hole and what re-store does about it.

A running request stores its 10 blocks; the CPU then evicts its 3rd block. With the cursor-only
control the hole stays, and a new request with the same prefix hits only the blocks before it;
with re-store on, the next step copies the block again from the GPU. Writes the CPU presence of
each block after every phase and the resulting hit to ``bench/results/hole_demo.json``.

Run: ``python -m bench.planner.hole_demo``.
"""

from __future__ import annotations

import sys

from bench.common import OneLineParser, write_result
from kvtriton.hashing import HashIndex, chain_hashes, request_keys
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request, StepOutput
from kvtriton.pool import BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout

LAYOUT = KVLayout([FullAttentionSpec(16, 8, 128, 32)], name="llama3-8b")
BLOCKS = 10
EVICTED = 2  # the 3rd block


def run(restore: bool) -> dict:
    index = HashIndex()
    gpu = BlockPool(64)
    planner = OffloadPlanner(LAYOUT, gpu, 32, PlannerConfig(restore=restore))
    cpu = planner.cpu_pool
    tokens = list(range(BLOCKS * 16 + 1))
    keys = request_keys(LAYOUT, index, chain_hashes(tokens, 16))
    req = Request("running", keys, num_prompt_tokens=len(tokens), num_tokens=len(tokens))
    table = gpu.get_new_blocks(BLOCKS + 1)
    planner.update_state_after_alloc(req, (table,), 0)
    req.num_computed_tokens = len(tokens)  # prefilled in an earlier step
    for pos in range(BLOCKS):
        gpu.cache_block(table[pos], int(keys[0, pos]))
    primaries = [int(k) for k in keys[0, :BLOCKS]]

    def presence() -> list[bool]:
        return [k in cpu for k in primaries]

    def step(first: bool) -> int:
        new = {"running": (list(table),)} if first else {}
        meta = planner.build_meta(StepOutput({"running": 1}, new))
        if meta.store.event >= 0:
            planner.update_connector_output(completed_stores={meta.store.event: 1})
        return len(meta.store)

    phases = {}
    stored = step(first=True)
    phases["stored"] = {"present": presence(), "blocks_copied": stored}
    cpu.evict_cached(cpu.get_cached_block(primaries[EVICTED]))
    phases["evicted"] = {"present": presence(), "blocks_copied": 0}
    copied = step(first=False)
    phases["next_step"] = {"present": presence(), "blocks_copied": copied}
    probe = Request("probe", keys, num_prompt_tokens=len(tokens), num_tokens=len(tokens))
    hit, _ = planner.get_num_new_matched_tokens(probe, 0)
    return {"restore": restore, "phases": phases, "probe_hit_tokens": hit,
            "probe_hit_blocks": hit // 16, "chain_holes": planner.stats.chain_holes}


def main(argv: list[str] | None = None) -> dict:
    OneLineParser(prog="python -m bench.planner.hole_demo",
                  description=__doc__.splitlines()[0]).parse_args(argv or [])
    rows = [run(restore=False), run(restore=True)]
    for r in rows:
        name = "re-store" if r["restore"] else "control"
        bar = "".join("#" if p else "." for p in r["phases"]["next_step"]["present"])
        print(f"  {name:9s} CPU after the next step [{bar}]  a new request with the same "
              f"prefix hits {r['probe_hit_blocks']} of {BLOCKS} blocks")
    path = write_result("hole_demo", {"blocks": BLOCKS, "evicted_position": EVICTED,
                                      "rows": rows})
    print(f"wrote {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
