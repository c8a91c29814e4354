"""vLLM 0.33's own offloading policies beside kvtriton's request-scoped queues, on one event
sequence.

kvtriton's ``reqlru`` and ``reqarc`` (``kvtriton.eviction.request_lru``, ``request_arc``) order the
CPU tier's blocks as vLLM 0.33's ``LRUCachePolicy`` and ``ARCCachePolicy`` order its chunks. Here
one random sequence of events drives both: on vLLM's side the calls its ``CPUOffloadingManager``
makes into the policy (``VllmSide``), on kvtriton's the calls its planner makes into the CPU pool
and its queue (``KvtritonSide``). An event is a JSON-ready list:

- ``["admit", rid, keys, positions, groups]``: a request is admitted holding ``keys`` (group
  after group, head to tail), each ending at token ``positions[i]`` of group ``groups[i]``. vLLM:
  the request records access to all of them (``on_request_access``; those cached and ready count
  as reused). kvtriton: ``on_request_admitted``.
- ``["store", sid, rid, keys]``: a store of ``keys`` for ``rid`` takes its blocks, evicting what
  it must. vLLM: ``on_store_miss``, ``evict`` (protecting the batch), ``insert``. kvtriton:
  ``on_store_started``, then the pool hands out the blocks.
- ``["complete", sid, ok]``: the store landed (``mark_evictable``; kvtriton caches and frees the
  blocks, tail first) or failed (``remove``; kvtriton frees the blocks unhashed).
- ``["load", lid, rid, keys]`` / ``["unload", lid]``: a CPU hit holds cached, ready blocks, and
  lets them go.
- ``["finish", rid, num_tokens]``: vLLM: ``on_request_finished`` with the keys the request
  recorded up to ``num_tokens``, those it stored and those it reused; kvtriton:
  ``on_request_finished``.

``random_events`` draws a sequence against kvtriton's side (what is cached, ready and held
decides what may come next): shared prefixes and conversations that continue earlier requests,
two KV groups in some, out-of-order and failed stores, CPU hits, aborted requests. Two
constraints keep it inside what the planner tells a queue (``request_lru``'s docstring lists what
that leaves out of vLLM's connector): a key is stored for the newest live request holding it, and
a request's later CPU hits are of keys it found cached at admission. A trace is each store's
evicted keys in order, then the order the rest would go in (a drain). ``replay_vllm`` replays
sequences on vLLM 0.33's classes in a subprocess (the source tree at ``KVTRITON_VLLM033_PATH``,
``.venv/vllm033`` by default, first on its path) and ``first_difference`` names the first event
whose evictions differ.

Run: ``python -m bench.conformance.native_policies [--sequences N] [--events N] [--seed S]
[--json out.json]``: the differential for both policies, plus kvtriton's own ``lru`` and ``arc``
against vLLM's (they differ by design; the counts say how often).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import OneLineParser, machine_info, record_output

__all__ = ["POLICY_QUEUES", "KvtritonSide", "VllmSide", "compare", "differential",
           "first_difference",
           "random_events", "replay_kvtriton", "replay_vllm", "vllm033_path", "vllm033_problem"]

REPO = Path(__file__).resolve().parents[2]
#: vLLM's policy name -> the kvtriton queue that orders blocks as it does.
POLICY_QUEUES = {"lru": "reqlru", "arc": "reqarc"}
#: Tokens per block: a key's position is the token its block ends at.
BLOCK_TOKENS = 16

Event = list[Any]
Trace = list[list[int]]


def vllm033_path() -> Path:
    """Where vLLM 0.33's source tree is: ``KVTRITON_VLLM033_PATH``, else ``.venv/vllm033``."""
    return Path(os.environ.get("KVTRITON_VLLM033_PATH") or REPO / ".venv" / "vllm033")


def vllm033_problem(path: Path | None = None) -> str | None:
    """Why vLLM 0.33's policies cannot be loaded from ``path`` (None: they can)."""
    path = vllm033_path() if path is None else path
    policies = path / "vllm" / "v1" / "kv_offload" / "cpu" / "policies"
    if not (policies / "lru.py").is_file() or not (policies / "arc.py").is_file():
        return (f"no vLLM 0.33 source tree at {path} (set KVTRITON_VLLM033_PATH to a folder "
                "holding vllm/v1/kv_offload/cpu/policies/)")
    if "order_request_keys" not in (policies / "base.py").read_text():
        return f"the vLLM tree at {path} predates 0.33 (no request-scoped policy hooks)"
    return None


# ---- kvtriton's side -------------------------------------------------------------------------


class KvtritonSide:
    """A CPU pool of ``capacity`` blocks with the named eviction queue, driven as the planner
    drives it (``queue``: a queue object instead, e.g. a mutant for a negative control)."""

    def __init__(self, eviction: str, capacity: int, queue=None) -> None:
        from kvtriton.eviction import make_eviction_queue
        from kvtriton.eviction.base import request_observer
        from kvtriton.pool import BlockPool

        self.queue = make_eviction_queue(eviction) if queue is None else queue
        self.pool = BlockPool(capacity + 1, eviction=self.queue, medium="CPU")
        self.observer = request_observer(self.queue)
        self.in_flight: dict[int, tuple[list[int], list[int]]] = {}
        self.storing: set[int] = set()
        self.loads: dict[int, list[int]] = {}
        self._evicted: list[int] = []
        self.pool.add_listener(on_evict=lambda key, _b: self._evicted.append(key))

    def cached(self, key: int) -> bool:
        """Whether ``key`` is cached or being stored."""
        return key in self.pool or key in self.storing

    def ready(self, key: int) -> bool:
        return key in self.pool

    @property
    def room(self) -> int:
        """Blocks a store can take now (free, cached or not)."""
        return self.pool.num_free_blocks

    def apply(self, ev: Event) -> list[int] | None:
        """Apply one event; a store returns the keys it evicted, in order."""
        kind, pool, obs = ev[0], self.pool, self.observer
        if kind == "admit":
            if obs is not None:
                obs.on_request_admitted(ev[1], np.array(ev[2], dtype=np.int64),
                                        np.array(ev[3], dtype=np.int64))
        elif kind == "store":
            _, sid, _rid, keys = ev
            if obs is not None:
                obs.on_store_started(keys)
            self._evicted.clear()
            self.in_flight[sid] = (pool.get_new_blocks(len(keys)), list(keys))
            self.storing.update(keys)
            return list(self._evicted)
        elif kind == "complete":
            blocks, keys = self.in_flight.pop(ev[1])
            self.storing.difference_update(keys)
            if ev[2]:
                pool.cache_blocks(blocks, [(k,) for k in keys])
            pool.free_blocks(blocks[::-1])
        elif kind == "load":
            _, lid, rid, keys = ev
            blocks = [pool.get_cached_block(k) for k in keys]
            pool.touch(blocks, user=rid)
            self.loads[lid] = blocks
        elif kind == "unload":
            pool.free_blocks(self.loads.pop(ev[1]))
        elif kind == "finish":
            if obs is not None:
                obs.on_request_finished(ev[1], ev[2])
        else:
            raise ValueError(f"unknown event {ev!r}")
        return None

    def drain(self) -> list[int]:
        """The cached free blocks' keys in the order they would be evicted."""
        keys = map(self.pool.block_hash, self.pool.iter_free())
        return [k for k in keys if k is not None]


def replay_kvtriton(eviction: str, capacity: int, events: Sequence[Event], queue=None) -> Trace:
    """``events`` on ``KvtritonSide``: each store's evictions, then the drain."""
    side = KvtritonSide(eviction, capacity, queue)
    trace = [ev for ev in map(side.apply, events) if ev is not None]
    return [*trace, side.drain()]


# ---- the events --------------------------------------------------------------------------------


class _Request:
    __slots__ = ("chain", "keys", "number", "positions", "reused", "rid")

    def __init__(self, rid: str, number: int, chain: list[tuple[int, ...]]) -> None:
        self.rid, self.number, self.chain = rid, number, chain
        groups = len(chain[0])
        self.keys = [chain[i][g] for g in range(groups) for i in range(len(chain))]
        self.positions = [(i + 1) * BLOCK_TOKENS for g in range(groups)
                          for i in range(len(chain))]
        self.reused: list[int] = []


def random_events(seed: int, eviction: str, *, num_events: int = 200,
                  capacity: int | None = None, queue=None) -> tuple[int, list[Event]]:
    """A random valid event sequence, drawn against ``KvtritonSide(eviction, capacity, queue)``,
    and the capacity (random when None)."""
    rng = random.Random(seed)
    capacity = rng.randint(6, 40) if capacity is None else capacity
    groups = rng.choice((1, 1, 2))
    side = KvtritonSide(eviction, capacity, queue)
    events: list[Event] = []
    chains: list[list[tuple[int, ...]]] = []
    live: dict[str, _Request] = {}
    next_id = [0]
    n_req = n_store = n_load = 0

    def emit(ev: Event) -> None:
        events.append(ev)
        side.apply(ev)

    def fresh_position() -> tuple[int, ...]:
        next_id[0] += 1
        return tuple(next_id[0] * 4 + g for g in range(groups))

    def admit() -> None:
        nonlocal n_req, n_load
        base = rng.choice(chains) if chains and rng.random() < 0.8 else []
        shared = base[:rng.randint(0, len(base))] if rng.random() < 0.5 else base
        chain = shared + [fresh_position() for _ in range(rng.randint(0 if shared else 1, 6))]
        n_req += 1
        req = _Request(f"r{n_req}", n_req, chain)
        chains.append(chain)
        live[req.rid] = req
        emit(["admit", req.rid, req.keys, req.positions, [k % 4 for k in req.keys]])
        req.reused = [k for k in req.keys if side.ready(k)]
        hit = []
        for pos in chain:  # a CPU hit: the leading run of cached, ready positions
            if not all(side.ready(k) for k in pos):
                break
            hit += pos
        if hit and rng.random() < 0.7:
            n_load += 1
            emit(["load", n_load, req.rid, hit])

    def newest_holder(key: int) -> str:
        return max((r for r in live.values() if key in r.keys), key=lambda r: r.number).rid

    def store() -> None:
        nonlocal n_store
        if not live or not side.room:
            return
        req = rng.choice(list(live.values()))
        todo = [k for k in req.keys if not side.cached(k) and newest_holder(k) == req.rid]
        n = min(len(todo), side.room, rng.randint(1, 5))
        if n:
            n_store += 1
            emit(["store", n_store, req.rid, todo[:n]])

    def later_hit() -> None:
        nonlocal n_load
        if not live:
            return
        req = rng.choice(list(live.values()))
        keys = [k for k in req.reused if side.ready(k)][:rng.randint(1, 4)]
        if keys:
            n_load += 1
            emit(["load", n_load, req.rid, keys])

    def finish(req: _Request) -> None:
        del live[req.rid]
        last = req.positions[-1]
        tokens = last if rng.random() < 0.8 else rng.randint(0, last)
        emit(["finish", req.rid, tokens])

    while len(events) < num_events:
        x = rng.random()
        if x < 0.14 and len(live) < 5:
            admit()
        elif x < 0.50:
            store()
        elif x < 0.70 and side.in_flight:
            emit(["complete", rng.choice(list(side.in_flight)), rng.random() < 0.9])
        elif x < 0.76:
            later_hit()
        elif x < 0.86 and side.loads:
            emit(["unload", rng.choice(list(side.loads))])
        elif x < 0.96 and live:
            finish(rng.choice(list(live.values())))
        elif not live:
            admit()
    for req in list(live.values()):
        finish(req)
    for sid in list(side.in_flight):
        emit(["complete", sid, True])
    for lid in list(side.loads):
        emit(["unload", lid])
    return capacity, events


def first_difference(events: Sequence[Event], ours: Trace, theirs: Trace) -> str | None:
    """Where two traces of ``events`` part (None: they agree): the store or the drain, with
    both sides' evictions."""
    stores = [ev for ev in events if ev[0] == "store"] + [["drain"]]
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            where = stores[i] if i < len(stores) else ["?"]
            return f"{' '.join(map(str, where[:3]))}: kvtriton evicts {a}, vLLM {b}"
    if len(ours) != len(theirs):
        return f"{len(ours)} trace entries on kvtriton's side, {len(theirs)} on vLLM's"
    return None


# ---- vLLM's side (runs where vLLM 0.33 imports) -----------------------------------------------


class VllmSide:
    """vLLM's ``LRUCachePolicy`` or ``ARCCachePolicy`` driven as its ``CPUOffloadingManager``
    drives it; a key ``k`` of group ``g`` is the ``OffloadKey`` of hash ``k`` (8 bytes, big
    endian, so that vLLM's ties by key bytes go as kvtriton's by key)."""

    def __init__(self, policy: str, capacity: int) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus
        from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

        self._context, self._chunk = ReqContext, ChunkStatus
        self._okey = lambda k, g: make_offload_key(int(k).to_bytes(8, "big"), int(g))
        self.policy = CachePolicyFactory.get_cache_policy_cls(policy)(cache_capacity=capacity)
        self.chunks: dict[bytes, Any] = {}
        self.free = capacity
        self._ids = 0
        self._int: dict[bytes, int] = {}
        self._requests: dict[str, dict[str, Any]] = {}
        self._stores: dict[int, list[bytes]] = {}
        self._loads: dict[int, list[bytes]] = {}

    def apply(self, ev: Event) -> list[int] | None:
        kind, policy = ev[0], self.policy
        if kind == "admit":
            _, rid, keys, positions, groups = ev
            ctx = self._context(req_id=rid)
            okeys = []
            for k, p, g in zip(keys, positions, groups, strict=True):
                ok = self._okey(k, g)
                self._int[ok] = k
                ctx.set_offload_key_position(ok, p)
                okeys.append((p, g, ok))
            by_position = [ok for _, _, ok in sorted(okeys, key=lambda t: t[0])]
            policy.on_request_access(by_position, ctx)
            reused = {ok for ok in by_position if (c := self.chunks.get(ok)) and c.is_ready}
            self._requests[rid] = {"ctx": ctx, "keys": okeys, "inserted": set(),
                                   "reused": reused, "by_int": {k: ok for k, (_, _, ok)
                                                                in zip(keys, okeys, strict=True)}}
        elif kind == "store":
            _, sid, rid, keys = ev
            req = self._requests[rid]
            okeys = [req["by_int"][k] for k in keys]
            policy.on_store_miss(okeys, req["ctx"])
            evicted: list[int] = []
            need = len(okeys) - self.free
            if need > 0:
                out = policy.evict(need, set(okeys))
                if out is None:
                    raise RuntimeError(f"store {sid}: vLLM could not evict {need} chunks")
                for ok, _ in out:
                    del self.chunks[ok]
                    evicted.append(self._int[ok])
                self.free += len(out)
            self.free -= len(okeys)
            for ok in okeys:
                self._ids += 1
                chunk = self._chunk(self._ids)
                self.chunks[ok] = chunk
                policy.insert(ok, chunk, req["ctx"])
            req["inserted"].update(okeys)
            self._stores[sid] = okeys
            return evicted
        elif kind == "complete":
            for ok in self._stores.pop(ev[1]):
                if ev[2]:
                    self.chunks[ok].ref_cnt = 0
                    policy.mark_evictable(ok)
                else:
                    policy.remove(ok)
                    del self.chunks[ok]
                    self.free += 1
        elif kind == "load":
            _, lid, rid, keys = ev
            req = self._requests[rid]
            okeys = [req["by_int"][k] for k in keys]
            for ok in okeys:
                chunk = self.chunks[ok]
                if not chunk.is_ready:
                    raise RuntimeError(f"load {lid}: chunk of {self._int[ok]} is not ready")
                if chunk.ref_cnt == 0:
                    policy.mark_non_evictable(ok)
                chunk.ref_cnt += 1
            req["reused"].update(ok for ok in okeys if ok not in req["inserted"])
            self._loads[lid] = okeys
        elif kind == "unload":
            for ok in self._loads.pop(ev[1]):
                chunk = self.chunks[ok]
                chunk.ref_cnt -= 1
                if chunk.ref_cnt == 0:
                    policy.mark_evictable(ok)
        elif kind == "finish":
            req = self._requests.pop(ev[1])
            used = sorted((t for t in req["keys"] if t[0] <= ev[2]), key=lambda t: t[0])
            groups = sorted({g for _, g, _ in used})
            key_groups = tuple(tuple(ok for _, g, ok in used if g == gi) for gi in groups)
            policy.on_request_finished(key_groups, req["inserted"] - req["reused"],
                                       req["reused"], req["ctx"])
        else:
            raise ValueError(f"unknown event {ev!r}")
        return None

    def drain(self) -> list[int]:
        n = sum(1 for c in self.chunks.values() if c.ref_cnt == 0)
        out = self.policy.evict(n, set()) if n else []
        return [self._int[ok] for ok, _ in out or []]


def _replay_here(runs: list[dict[str, Any]]) -> list[Trace]:
    """Each run (policy, capacity, events) on ``VllmSide``; a run that raises ends its trace
    with ``[-1]`` (its events went invalid for vLLM after the two sides parted)."""
    traces = []
    for run in runs:
        side = VllmSide(run["policy"], run["capacity"])
        trace: Trace = []
        try:
            for ev in run["events"]:
                out = side.apply(ev)
                if out is not None:
                    trace.append(out)
            trace.append(side.drain())
        except (AssertionError, KeyError, RuntimeError):
            trace.append([-1])
        traces.append(trace)
    return traces


def replay_vllm(runs: list[dict[str, Any]], path: Path | None = None,
                timeout_s: float = 300.0) -> list[Trace]:
    """``runs`` (dicts of ``policy``, ``capacity``, ``events``) on vLLM 0.33's policy classes, in
    one subprocess with the vLLM tree at ``path`` first on its path."""
    path = vllm033_path() if path is None else path
    problem = vllm033_problem(path)
    if problem is not None:
        raise FileNotFoundError(problem)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), str(REPO)]),
               VLLM_LOGGING_LEVEL="ERROR")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "runs.json", Path(tmp) / "traces.json"
        src.write_text(json.dumps(runs))
        proc = subprocess.run([sys.executable, "-m", "bench.conformance.native_policies",
                               "--replay-vllm", str(src), str(dst)],
                              cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM replay failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        out = json.loads(dst.read_text())
    where = Path(out["vllm_file"]).resolve()
    if not where.is_relative_to(path.resolve()):
        raise RuntimeError(f"the replay imported vLLM from {where}, not from {path}")
    return out["traces"]


def compare(configs: Sequence[tuple[str, str, Callable[[], Any] | None]], seeds: Sequence[int],
            *, num_events: int = 200, path: Path | None = None) -> list[dict[str, Any]]:
    """For each ``(policy, eviction, queue_factory)``: draw a sequence per seed against kvtriton's
    ``eviction`` queue (``queue_factory()``: a queue object instead, e.g. a mutant), replay it on
    vLLM's ``policy`` and compare, every replay in one subprocess. A row per config: its
    counts and the differences found (seed -> where)."""
    runs, ours = [], []
    for policy, eviction, factory in configs:
        for seed in seeds:
            capacity, events = random_events(seed, eviction, num_events=num_events,
                                             queue=factory() if factory else None)
            runs.append({"policy": policy, "capacity": capacity, "events": events})
            ours.append(replay_kvtriton(eviction, capacity, events,
                                        factory() if factory else None))
    theirs = replay_vllm(runs, path)
    rows = []
    for i, (policy, eviction, _) in enumerate(configs):
        part = slice(i * len(seeds), (i + 1) * len(seeds))
        diffs = {}
        for seed, run, a, b in zip(seeds, runs[part], ours[part], theirs[part], strict=True):
            where = first_difference(run["events"], a, b)
            if where is not None:
                diffs[seed] = where
        rows.append({"policy": policy, "eviction": eviction, "sequences": len(seeds),
                     "events": sum(len(r["events"]) for r in runs[part]),
                     "evictions": sum(len(x) for t in ours[part] for x in t[:-1]),
                     "differences": diffs})
    return rows


def differential(policy: str, seeds: Sequence[int], *, num_events: int = 200,
                 path: Path | None = None) -> dict[str, Any]:
    """``compare`` of vLLM's ``policy`` with the kvtriton queue that follows it."""
    return compare([(policy, POLICY_QUEUES[policy], None)], seeds, num_events=num_events,
                   path=path)[0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m bench.conformance.native_policies",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=200)
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--replay-vllm", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replay_vllm:
        import vllm

        src, dst = args.replay_vllm
        traces = _replay_here(json.loads(src.read_text()))
        dst.write_text(json.dumps({"vllm_file": vllm.__file__, "traces": traces}))
        return 0
    problem = vllm033_problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    seeds = range(args.seed, args.seed + args.sequences)
    configs = [("lru", "reqlru", None), ("arc", "reqarc", None), ("lru", "lru", None),
               ("arc", "arc", None)]
    t0 = time.perf_counter()
    rows = compare(configs, seeds, num_events=args.events)
    wall = time.perf_counter() - t0
    for row in rows:
        print(f"vLLM {row['policy']:3} vs kvtriton {row['eviction']:6}: {row['sequences']} "
              f"sequences, {row['events']} events, {row['evictions']} evictions, "
              f"{len(row['differences'])} differ")
    print(f"{wall:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"vllm": str(vllm033_path()), "wall_s": round(wall, 2),
                                         "machine": machine_info(), "rows": rows}, indent=1))
        record_output(args.json)
    return 0 if not rows[0]["differences"] and not rows[1]["differences"] else 1


if __name__ == "__main__":
    sys.exit(main())
