"""Soak: 100,000 scheduler steps of a random multi-turn workload through the planner and pools.

The simulator's scheduler (``kvtriton.sim.batch_scheduler.BatchScheduler``) drives
``OffloadPlanner`` with a fused scan and re-store on: conversations come back turn after turn with a
longer prompt (a GPU or CPU prefix hit, or a load when the GPU lost it), prefill is chunked by a
token budget, the GPU pool is small enough that requests are preempted, the CPU pool small enough
that it evicts blocks of running requests (re-stored later), and store and load reports arrive one
to four steps late, out of order. A conversation that reaches the context cap starts over, so the
set of distinct blocks is bounded (``--fresh`` gives restarted conversations new content instead,
which measures what every never-seen block costs: dense key ids are never recycled).

Every ``--sample`` steps it records the process RSS (``/proc/self/status``), Python's allocated
memory blocks and tracked object count (``gc``), and the size of every pool, planner and selector
structure. Steady state is judged on the samples after the warm-up (the first 10% of the steps):
RSS and object counts must not trend up and no structure may grow, from the first quarter to the
last. Writes ``bench/results/soak.json``.

Run: ``python -m bench.conformance.planner_soak [--steps 100000] [--sample 1000] [--fresh] [--seed
0]``.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import sys
import time
from dataclasses import dataclass

import numpy as np

from bench.common import write_result
from kvtriton.hashing import HashIndex, chain_hashes, request_keys
from kvtriton.planner import OffloadPlanner, PlannerConfig, Request
from kvtriton.pool import BlockPool
from kvtriton.sim.batch_scheduler import BatchScheduler
from kvtriton.sim.scheduler import SeqBlocks
from kvtriton.specs import FullAttentionSpec, KVLayout

LAYOUT = KVLayout([FullAttentionSpec(16, 8, 128, 32)], name="llama3-8b-like")
B = 16
GPU_BLOCKS = 512  # four full-length requests: preemptions happen
CPU_BLOCKS = 2048  # a third of the conversations' blocks: the CPU evicts running requests
MAX_RUNNING = 12
TOKEN_BUDGET = 512
CONVERSATIONS = 48
MAX_CONTEXT = 2048  # tokens; past it a conversation starts over
SYSTEM_PROMPT = 256  # tokens shared by every conversation


@dataclass(slots=True, eq=False, kw_only=True)
class Seq(SeqBlocks):
    conv: int
    output_left: int = 0  # output tokens still to sample


class Soak:
    """The scheduler, its workload and its delayed worker reports."""

    def __init__(self, seed: int, fresh: bool) -> None:
        self.rng = random.Random(seed)
        self.fresh = fresh
        self.gpu = BlockPool(GPU_BLOCKS + 1)
        self.planner = OffloadPlanner(LAYOUT, self.gpu, CPU_BLOCKS,
                                      PlannerConfig(scan="fused", restore=True))
        self.cpu = self.planner.cpu_pool
        self.sched = BatchScheduler(LAYOUT, self.gpu, self.planner, token_budget=TOKEN_BUDGET,
                                    max_running=MAX_RUNNING)
        self.index = HashIndex()
        self.epoch = [0] * CONVERSATIONS  # which content a conversation has (bumped by --fresh)
        self.turn = [0] * CONVERSATIONS
        self._keys: dict[tuple[int, int], np.ndarray] = {}
        self.arrivals: list[tuple[int, int, int]] = []  # (step, tiebreak, conversation)
        self.reports: list[tuple[int, int, str, object]] = []  # (due step, tiebreak, kind, what)
        self.n = 0
        self.step_no = 0
        self.requests = 0
        self.finished = 0
        for c in range(CONVERSATIONS):
            heapq.heappush(self.arrivals, (self.rng.randrange(200), self._tick(), c))

    def _tick(self) -> int:
        self.n += 1
        return self.n

    @property
    def counts(self) -> dict[str, int]:
        s = self.sched
        return dict(requests=self.requests, finished=self.finished, preemptions=s.preemptions,
                    gpu_hit_tokens=s.gpu_hit_tokens, cpu_hit_tokens=s.cpu_hit_tokens,
                    prompt_tokens=s.prompt_tokens)

    # ---- workload ----------------------------------------------------------------------------

    def _conv_keys(self, c: int) -> np.ndarray:
        """Keys of conversation c's whole token stream (cached per content epoch)."""
        k = (c, self.epoch[c])
        keys = self._keys.get(k)
        if keys is None:
            ident = c + CONVERSATIONS * self.epoch[c]
            toks = list(range(SYSTEM_PROMPT)) + list(
                range(10**6 * (ident + 1), 10**6 * (ident + 1) + MAX_CONTEXT - SYSTEM_PROMPT))
            keys = request_keys(LAYOUT, self.index, chain_hashes(toks, B))
            if self.fresh:
                self._keys.pop((c, self.epoch[c] - 1), None)
            self._keys[k] = keys
        return keys

    def _arrive(self, c: int) -> None:
        self.turn[c] += 1
        prompt = SYSTEM_PROMPT + 96 * self.turn[c] + self.rng.randrange(48)
        output = self.rng.randrange(8, 64)
        if prompt + output > MAX_CONTEXT:  # the conversation starts over
            self.turn[c] = 1
            self.epoch[c] += self.fresh
            prompt = SYSTEM_PROMPT + 96 + self.rng.randrange(48)
        keys = self._conv_keys(c)[:, :(prompt + output) // B]
        self.requests += 1
        req = Request(f"c{c}t{self.turn[c]}n{self.requests}", keys, prompt, prompt)
        self.sched.add(Seq(req, conv=c, output_left=output))

    @staticmethod
    def _sampled(seq: Seq) -> bool:
        """A token was sampled for ``seq``; whether it was its last."""
        if seq.output_left <= 0:
            return True
        seq.output_left -= 1
        return False

    # ---- one step ------------------------------------------------------------------------------

    def step(self) -> None:
        s = self.step_no
        while self.arrivals and self.arrivals[0][0] <= s:
            self._arrive(heapq.heappop(self.arrivals)[2])
        scheduled, meta = self.sched.schedule_step()
        rng = self.rng
        if meta.store.event >= 0:
            heapq.heappush(self.reports, (s + rng.randint(1, 4), self._tick(), "store",
                                          meta.store.event))
        if meta.load.event >= 0:
            heapq.heappush(self.reports, (s + rng.randint(1, 3), self._tick(), "load",
                                          meta.load_event_to_reqs[meta.load.event]))
        for seq in self.sched.advance(scheduled, self._sampled):
            self.finished += 1
            heapq.heappush(self.arrivals, (self.step_no + self.rng.randrange(5, 60),
                                           self._tick(), seq.conv))
        self._deliver()
        self.step_no += 1

    def _deliver(self) -> None:
        """Reports due by this step, stores in random order (one report each)."""
        stores, loads = [], []
        while self.reports and self.reports[0][0] <= self.step_no:
            _, _, kind, what = heapq.heappop(self.reports)
            if kind == "store":
                stores.append(what)
            else:
                loads += what
        self.rng.shuffle(stores)
        self.sched.deliver(loads, stores, self.step_no)

    # ---- measurement ---------------------------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        """Every structure that could leak, by size."""
        p, sel, sched = self.planner, self.planner.selector, self.sched
        return {
            "gpu_used": self.gpu.num_used_blocks, "gpu_free": self.gpu.num_free_blocks,
            "gpu_cached_keys": self.gpu.num_cached_keys,
            "cpu_used": self.cpu.num_used_blocks, "cpu_free": self.cpu.num_free_blocks,
            "cpu_cached_keys": self.cpu.num_cached_keys,
            # The planner's and selector's private containers, read on purpose: the soak exists
            # to see whether any of them grows.
            "planner_requests": len(p._requests), "planner_stores": len(p._stores._states),
            "planner_rows": len(p._stores._row_req),
            "planner_free_rows": len(p._stores._free_rows),
            "planner_next_row": p._stores._next_row, "planner_loads": len(p._loads._loads),
            "planner_abandoned": len(p._loads._abandoned) + len(p._stores._abandoned),
            "planner_load_events": len(p._loads._event_reqs),
            "planner_jobs": len(p._stores._jobs),
            "planner_reports": len(p._stores._reports),
            "planner_pending_hits": len(p.pending_hits()),
            "selector_row_keys": len(sel._row_keys),
            "selector_extra_owners": len(sel._extra_owners),
            "selector_wanted_buf": len(sel._wanted_buf),
            "selector_key_capacity": len(sel._in_cpu),
            "selector_table_cells": int(sel._block_table.size),
            "hash_index": len(self.index),
            "driver_live": len(sched.running) + len(sched.waiting) + len(sched.loading),
            "driver_reports": len(self.reports),
        }


# What is sampled and judged: counts that follow the load, and capacities that only ever grow.
FLUCTUATING = ("rss_kib", "py_blocks", "py_objects", "gpu_cached_keys", "cpu_cached_keys",
               "planner_requests", "planner_stores", "planner_loads", "planner_jobs",
               "planner_free_rows", "selector_row_keys", "selector_extra_owners", "driver_live",
               "driver_reports")
MONOTONE = ("planner_next_row", "selector_key_capacity", "selector_table_cells",
            "selector_wanted_buf", "hash_index")


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _trend(samples: list[dict], key: str, start: int) -> dict:
    """``key`` over the samples from ``start``: first- and last-quarter means, and the rise of a
    least-squares line across them (what a leak shows as, whatever the noise)."""
    steps = np.array([s["step"] for s in samples[start:]], dtype=np.float64)
    xs = np.array([s[key] for s in samples[start:]], dtype=np.float64)
    q = max(1, len(xs) // 4)
    slope = np.polyfit(steps, xs, 1)[0] if len(xs) > 1 else 0.0
    return {"first_quarter": float(xs[:q].mean()), "last_quarter": float(xs[-q:].mean()),
            "mean": float(xs.mean()), "min": float(xs.min()), "max": float(xs.max()),
            "fitted_rise": float(slope * (steps[-1] - steps[0]))}


def run(steps: int, sample: int, seed: int, fresh: bool) -> dict:
    soak = Soak(seed, fresh)
    samples = []
    gc.collect()
    t0 = time.perf_counter()
    for i in range(steps):
        soak.step()
        if i % sample == sample - 1 or i == 0:
            gc.collect()
            samples.append({"step": i + 1, "wall_s": time.perf_counter() - t0,
                            "rss_kib": _rss_kib(), "py_blocks": sys.getallocatedblocks(),
                            "py_objects": len(gc.get_objects()), **soak.sizes()})
    wall = time.perf_counter() - t0
    warm = next(i for i, s in enumerate(samples) if s["step"] >= steps // 10)
    trends = {k: _trend(samples, k, warm) for k in (*FLUCTUATING, *MONOTONE)}
    # Counts that go up and down with the load: the fitted rise across the run within 5% of
    # their mean (plus two, for counts near zero). Capacities that only grow: not after warm-up.
    stable = {k: trends[k]["fitted_rise"] <= 0.05 * trends[k]["mean"] + 2 for k in FLUCTUATING}
    stable.update({k: samples[-1][k] == samples[warm][k] for k in MONOTONE})
    stats = soak.planner.stats.as_dict()
    return {
        "steps": steps, "sample_every": sample, "seed": seed, "fresh_content": fresh,
        "wall_s": wall, "us_per_step": wall / steps * 1e6,
        "conditions": {"layout": LAYOUT.describe(), "gpu_blocks": GPU_BLOCKS,
                       "cpu_blocks": CPU_BLOCKS, "max_running": MAX_RUNNING,
                       "token_budget": TOKEN_BUDGET, "conversations": CONVERSATIONS,
                       "max_context": MAX_CONTEXT, "planner": "fused scan, re-store on"},
        "workload": soak.counts,
        "planner_stats": stats,
        "start": samples[0], "after_warmup": samples[warm], "end": samples[-1],
        "trends": trends, "stable": stable, "all_stable": all(stable.values()),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--sample", type=int, default=1000, help="steps between samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fresh", action="store_true",
                    help="restarted conversations get new content (unbounded distinct blocks)")
    ap.add_argument("--name", default=None, help="result name (default: soak or soak_fresh)")
    args = ap.parse_args(argv)
    if args.steps < 10 or args.sample < 1:
        ap.error("--steps must be >= 10 and --sample >= 1")
    res = run(args.steps, args.sample, args.seed, args.fresh)
    name = args.name or ("soak_fresh" if args.fresh else "soak")
    path = write_result(name, res)
    st, s0, s1, w = res["planner_stats"], res["after_warmup"], res["end"], res["workload"]
    print(f"{res['steps']:,} steps in {res['wall_s']:.1f} s ({res['us_per_step']:.0f} us/step); "
          f"{w['requests']:,} requests, {w['finished']:,} finished, {w['preemptions']:,} "
          f"preemptions")
    print(f"planner: {st['blocks_stored']:,} blocks stored ({st['scan_restored']:,} re-stored), "
          f"{st['blocks_loaded']:,} loaded, {st['running_evictions']:,} CPU evictions of "
          f"running requests' blocks, {w['cpu_hit_tokens']:,} CPU hit tokens")
    print(f"RSS {res['start']['rss_kib'] / 1024:.1f} MiB at start, "
          f"{s0['rss_kib'] / 1024:.1f} MiB after warm-up, {s1['rss_kib'] / 1024:.1f} MiB at end; "
          f"Python objects {s0['py_objects']:,} -> {s1['py_objects']:,}")
    for k in ("gpu_used", "cpu_used", "cpu_cached_keys", "planner_stores", "planner_next_row",
              "selector_key_capacity", "hash_index"):
        print(f"  {k:24s} {res['start'][k]:>8,} {s0[k]:>8,} {s1[k]:>8,}")
    unstable = [k for k, ok in res["stable"].items() if not ok]
    print("stable from warm-up to end" if not unstable else f"GROWING: {', '.join(unstable)}")
    print(f"wrote {path}")
    return 0 if not unstable or args.fresh else 1


if __name__ == "__main__":
    sys.exit(main())
