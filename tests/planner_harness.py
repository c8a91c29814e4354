"""A tiny scheduler around ``OffloadPlanner`` for tests: exact control over every step.

It does what a vLLM scheduler does around a connector, and nothing more: a GPU prefix-cache
lookup, the planner's lookup, allocation, ``update_state_after_alloc``, ``build_meta`` before the
step's tokens count as computed, caching of full blocks, and finish (blocks freed tail first).
Transfers complete only when the test says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtriton.hashing import HashIndex, chain_hashes
from kvtriton.planner import OffloadPlanner, PlannerConfig, PlannerMeta, Request, StepOutput
from kvtriton.planner.records import request_keys
from kvtriton.pool import BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout

LLAMA_TINY = KVLayout([FullAttentionSpec(16, 1, 8, 1)], name="tiny")


def tokens_for(prefix: int, n: int) -> list[int]:
    """Deterministic token ids; equal ``prefix`` seeds give equal prefixes."""
    return list(range(prefix * 1_000_003, prefix * 1_000_003 + n))


@dataclass
class Running:
    req: Request
    tables: list[list[int]]
    new: list[list[int]] = field(default_factory=list)
    cached: int = 0  # blocks of group 0 already cached in the GPU pool


class Harness:
    def __init__(self, layout: KVLayout = LLAMA_TINY, num_gpu_blocks: int = 256,
                 cpu: int | BlockPool = 64, config: PlannerConfig | None = None) -> None:
        self.layout = layout
        self.index = HashIndex()
        self.gpu = BlockPool(num_gpu_blocks)
        self.planner = OffloadPlanner(layout, self.gpu, cpu, config)
        self.cpu = self.planner.cpu_pool
        self.running: dict[str, Running] = {}
        self.order: list[str] = []

    def request(self, rid: str, tokens: list[int], output: int = 0) -> Request:
        hashes = chain_hashes(tokens, self.layout.hash_block_size)
        keys = request_keys(self.layout, self.index, hashes)
        return Request(rid, keys, num_prompt_tokens=len(tokens) - output,
                       num_tokens=len(tokens) - output)

    # ---- scheduling -----------------------------------------------------------------------

    def admit(self, req: Request, accept: int | None = None) -> tuple[int, int]:
        """Schedule a new request: GPU hit, CPU hit (``accept`` caps what the scheduler takes),
        allocation. Returns (gpu_hit_tokens, cpu_tokens_accepted)."""
        B = self.layout.groups[0].block_size
        r = B // self.layout.hash_block_size
        prim = req.keys[0, r - 1::r].tolist()
        gpu_hit = []
        for k in prim:
            b = self.gpu.get_cached_block(k)
            if b is None:
                break
            gpu_hit.append(b)
        gpu_hit = gpu_hit[:max(0, (req.num_tokens - 1) // B)]
        local = len(gpu_hit) * B
        ext, _ = self.planner.get_num_new_matched_tokens(req, local)
        if accept is not None:
            ext = min(ext, accept)
        n_blocks = -(-req.num_tokens // B)
        self.gpu.touch(gpu_hit)
        new = self.gpu.get_new_blocks(n_blocks - len(gpu_hit))
        table = gpu_hit + new
        self.planner.update_state_after_alloc(req, (table,), ext)
        req.num_computed_tokens = local + ext
        run = Running(req, [table], [list(table)], cached=len(gpu_hit))
        self.running[req.request_id] = run
        self.order.append(req.request_id)
        self._cache_full(run, upto=req.num_computed_tokens)
        return local, ext

    def _cache_full(self, run: Running, upto: int) -> None:
        B = self.layout.groups[0].block_size
        r = B // self.layout.hash_block_size
        table = run.tables[0]
        while run.cached < min(upto // B, len(table), run.req.keys.shape[1] // r):
            i = run.cached
            keys = run.req.keys[0, i * r:(i + 1) * r].tolist()
            if self.gpu.block_hash(table[i]) is None:
                self.gpu.cache_block(table[i], keys[-1], keys[:-1])
            run.cached += 1

    def step(self, scheduled: dict[str, int] | None = None, decode: bool = False,
             **extra) -> PlannerMeta:
        """One step: ``scheduled[rid]`` tokens per request (default: the rest of the prompt, or 1
        when ``decode``). build_meta sees the tokens computed before this step."""
        if scheduled is None:
            scheduled = {}
            for rid, run in self.running.items():
                left = run.req.num_tokens - run.req.num_computed_tokens
                scheduled[rid] = left if left > 0 else (1 if decode else 0)
        B = self.layout.groups[0].block_size
        new_ids = {}
        for rid, n in scheduled.items():
            run = self.running[rid]
            req = run.req
            grow = req.num_computed_tokens + n - req.num_tokens
            if grow > 0:  # decode: the sequence gets longer
                req.num_tokens += grow
                need = -(-req.num_tokens // B) - len(run.tables[0])
                if need > 0:
                    blocks = self.gpu.get_new_blocks(need)
                    run.tables[0] += blocks
                    run.new[0] += blocks
            if run.new[0]:
                new_ids[rid] = (run.new[0],)
                run.new = [[]]
        order = [r for r in self.order if r in scheduled]
        step = StepOutput(num_scheduled_tokens=dict(scheduled), new_block_ids=new_ids,
                          order=order, **extra)
        meta = self.planner.build_meta(step)
        for rid, n in scheduled.items():
            run = self.running[rid]
            if self.planner.load_pending(rid):
                continue
            run.req.num_computed_tokens += n
            self._cache_full(run, run.req.num_computed_tokens)
        return meta

    def complete(self, meta: PlannerMeta, stores: bool = True, loads: bool = True) -> None:
        world = self.planner.config.world_size
        finished = []
        if loads and meta.load.event >= 0:
            finished = meta.load_event_to_reqs.get(meta.load.event, [])
        done = {meta.store.event: world} if stores and meta.store.event >= 0 else {}
        self.planner.update_connector_output(finished_loads=list(finished),
                                             completed_stores=done)

    def finish(self, rid: str) -> None:
        run = self.running.pop(rid)
        self.order.remove(rid)
        self.planner.request_finished(run.req)
        self.gpu.free_blocks(list(reversed(run.tables[0])))

    def preempt(self, rid: str) -> None:
        run = self.running[rid]
        self.gpu.free_blocks(list(reversed(run.tables[0])))
        run.tables = [[]]
        run.cached = 0
        run.req.num_computed_tokens = 0

    # ---- inspection -----------------------------------------------------------------------

    def cpu_prefix_blocks(self, req: Request) -> int:
        """Leading primary keys of ``req`` present in the CPU pool."""
        n = 0
        for k in req.keys[0].tolist():
            if k not in self.cpu:
                break
            n += 1
        return n

    def primary_keys(self, req: Request) -> np.ndarray:
        r = self.layout.groups[0].block_size // self.layout.hash_block_size
        return req.keys[0, r - 1::r]
