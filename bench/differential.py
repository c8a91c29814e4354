"""kvtriton's scheduler side against vLLM's own ``SimpleCPUOffloadScheduler``, step for step.

One real vLLM ``Scheduler`` runs a random schedule (shared prefixes, repeated prompts, chunked
prefill, decode, preemption, aborts, the finish flush, transfer reports 0-2 steps late; then the
GPU prefix cache is dropped and earlier prompts come back, so most schedules load from the CPU
tier). Its connector is ``TeeConnector``: every call goes to vLLM's manager, whose answers drive
the scheduler, and to kvtriton's ``SchedulerSide`` with the same policy (re-store off, head-first
freeing, LRU).

While the two are *in step* (every seed starts so) each answer is compared: lookup hits, stored
GPU blocks, loaded blocks and the hashes their CPU blocks hold, every request's store cursor,
each finish flush, and the CPU tier's contents after every call that changes them. Known
differences (``KVTritonConnector``'s docstring) are accepted only with their evidence:

- ``per_request_allocation``: vLLM allocates CPU blocks per request inside its scan, evicting as
  it goes; kvtriton classifies the whole step against the tier as it stood before allocating.
  vLLM may store a block kvtriton passed as cached only if the block was cached before the step,
  this step's allocations evicted it, and kvtriton's cursor is past it. A cursor gap (kvtriton
  ahead) opens only where vLLM spent its whole budget and stopped at a hash the step evicted, and
  every position kvtriton passed must have been cached, in flight or stored by it when it passed
  it. vLLM storing, later, a block inside a gap, and a finish flush that starts at vLLM's lagging
  cursor (its extra blocks all inside the gap), are the same difference.
- ``budget``: a block only kvtriton stored, where vLLM spent its whole budget on stores kvtriton
  did not make and its cursor has not passed that block (vLLM defers it).
- ``in_flight_duplicate``: vLLM copies a GPU block whose hash kvtriton has in flight, or stores
  this step, from *another* GPU block (vLLM dedups by GPU block id, kvtriton by hash too).
- ``key_collision``: vLLM stores (or flushes) a block at a position whose key kvtriton reserved
  and could not bind, another request having made the same hash first (``kvtriton.vllm.keys``:
  that position is never stored for this request).

Anything else is *unrecognised*, and fails the test. After a recognised difference the tiers
hold different blocks: the pair is *apart*. kvtriton is then checked against its own tier with
the rules both must share (a lookup hit is the longest cached run, capped to recompute the last
token; a store copies hashed blocks neither cached nor in flight, within the free blocks; a
cursor passes only cached, in-flight or stored positions; a load reads the hashes of its
request's positions) and fed answers it can serve (an accepted hit no longer than its own). The
pair is *in step* again, and compared again, as soon as both hold the same CPU contents in the
same eviction order, the same stores in flight, the same loads in flight and the same cursors.

``run_seed`` runs one seed, ``main`` many (the bench study: outcome counts per seed in JSON);
``MUTATIONS`` are known bug classes, each of which the comparison must catch.

Run: ``python -m bench.differential [--seeds N] [--first S] [--json out.json]`` (3,000 seeds
by default, about 7 minutes on one core).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

BS = 16


class Diverged(Exception):
    """kvtriton answered differently from vLLM's manager, or broke a rule of its own tier."""


@dataclass
class Record:
    seed: int = -1
    steps: int = 0
    steps_compared: int = 0  # steps in step with vLLM, compared whole
    steps_apart: int = 0  # steps after a recognised difference, checked against own rules
    differences: Counter = field(default_factory=Counter)  # recognised, by class
    first_difference_at: int | None = None
    resyncs: int = 0
    apart_at_end: bool = False
    gaps_opened: int = 0
    lagging_steps: int = 0
    exhausted_steps: int = 0
    lookups: int = 0
    stores: int = 0
    loads: int = 0  # blocks loaded by kvtriton (compared in step, checked apart)
    unknown: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if self.unknown:
            return "unrecognised"
        return "recognised" if self.differences else "identical"


def _tee_classes():
    """The connector classes, built on first use: importing this module needs no vLLM."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
        SupportsHMA,
    )
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    from kvtriton.vllm.config import parse_extra_config
    from kvtriton.vllm.scheduler_side import SchedulerSide

    @dataclass
    class TeeMetadata(KVConnectorMetadata):
        ref: Any
        kvt: Any

    @dataclass
    class TeeWorkerMetadata(KVConnectorWorkerMetadata):
        ref: Any
        kvt: Any

        def aggregate(self, other):
            raise AssertionError("the differential runs one worker: nothing to aggregate")

    class TeeConnector(KVConnectorBase_V1, SupportsHMA):
        """vLLM's manager (answers) and kvtriton's scheduler side (compared), fed the same
        calls."""

        def __init__(self, vllm_config, role, kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
            cpu_bytes = self._kv_transfer_config.kv_connector_extra_config["cpu_bytes_per_rank"]
            sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
            self.ref = SimpleCPUOffloadScheduler(vllm_config, kv_cache_config, cpu_bytes,
                                                 scheduler_block_size=sched_block,
                                                 hash_block_size=hash_block)
            self.kvt = SchedulerSide(vllm_config, kv_cache_config, parse_extra_config(
                {"cpu_bytes_per_rank": cpu_bytes, "restore": False,
                 "cpu_free_order": "head_first"}))
            assert self.ref.num_cpu_blocks == self.kvt.num_cpu_blocks
            self.rec = Record()
            self.live = True  # no unrecognised difference yet: kvtriton is still checked
            self.in_step = True  # both tiers hold the same: answers are compared
            self.step = 0
            self.lag: dict[str, tuple[int, int]] = {}  # rid -> (vLLM cursor, kvtriton cursor)
            # kvtriton's store events in flight -> their (GPU block, hash) pairs
            self.kvt_in_flight: dict[int, list[tuple[int, bytes]]] = {}
            self.kvt_hits: dict[str, int] = {}  # rid -> kvtriton's last lookup hit
            self.kvt_cursor: dict[str, int] = {}  # rid -> kvtriton's cursor after last step
            self.ev_pairs: list[tuple[int, int]] = []  # store events in flight, by issuing step
            self.collided: set[int] = set()  # GPU blocks at key-collision positions (this step)
            self.kvt_finished_loads: set[str] | None = None  # set by the driver when apart

        # ---- what the tiers hold --------------------------------------------------------------

        def _gpu_hash(self, b: int) -> bytes | None:
            return self.ref._gpu_block_pool.blocks[b].block_hash

        def _ref_cached(self) -> set[bytes]:
            pool = self.ref.cpu_block_pool
            return {b.block_hash for b in pool.blocks if b.block_hash is not None} | {
                h for hs in pool.cached_block_hashes_by_block.values() for h in hs}

        def _kvt_cached(self) -> set[bytes]:
            pool, keys = self.kvt.cpu_pool, self.kvt.keys
            return {keys.hash_of(k) for b in range(1, pool.num_blocks)
                    for k in pool.block_keys(b)}

        def _ref_free_order(self) -> list[bytes | None]:
            return [b.block_hash for b in
                    self.ref.cpu_block_pool.free_block_queue.get_all_free_blocks()]

        def _kvt_free_order(self) -> list[bytes | None]:
            pool, keys = self.kvt.cpu_pool, self.kvt.keys
            out = []
            for b in pool.iter_free():
                k = pool.block_hash(b)
                out.append(None if k is None else keys.hash_of(k))
            return out

        def _kvt_in_flight_hashes(self) -> tuple[set[bytes], dict[bytes, set[int]]]:
            """Hashes kvtriton has in flight (issued or queued as a flush), and per hash the GPU
            blocks they are copied from."""
            by_hash: dict[bytes, set[int]] = {}
            pairs = [p for ps in self.kvt_in_flight.values() for p in ps]
            pairs += [(b, self._gpu_hash(b)) for b in
                      self.kvt.planner.queued_flush().gpu_blocks]
            for b, h in pairs:
                by_hash.setdefault(h, set()).add(b)
            return set(by_hash), by_hash

        def _kvt_rows(self) -> dict[str, tuple[list[int], int]]:
            """kvtriton's own table (group 0) and cursor of each request holding a row."""
            stores = self.kvt.planner._stores
            sel = stores._selector
            return {rid: (sel.table(st.row, 0), sel.cursor(st.row, 0))
                    for rid, st in stores._states.items() if st.admitted and not st.finished}

        def _collided(self, rid: str, table: list[int]) -> set[int]:
            """GPU blocks of ``rid``'s table at positions whose key kvtriton reserved and could
            not bind: another request made the hash first (``kvtriton.vllm.keys``), so kvtriton
            never stores that position for this request."""
            m = self.kvt._mirrors.get(rid)
            if m is None or not m.unbound:
                return set()
            unbound = set(m.unbound)
            keys = m.req.keys[0][:len(table)].tolist()
            return {table[p] for p, k in enumerate(keys) if k in unbound}

        def _ref_cursors(self) -> dict[str, tuple[list[int], int]]:
            return {rid: (st.block_ids[0], st.num_stored_blocks[0])
                    for rid, st in self.ref._reqs_to_store.items() if not st.finished}

        def _compare(self, what: str, a, b) -> None:
            if a != b:
                raise Diverged(f"step {self.step}: {what}: vLLM {a!r} != kvtriton {b!r}")

        def _check_cpu(self, when: str) -> None:
            ref, kvt = self._ref_cached(), self._kvt_cached()
            if ref != kvt:
                raise Diverged(f"step {self.step}: CPU contents after {when}: vLLM holds "
                               f"{len(ref - kvt)} blocks kvtriton lacks, kvtriton "
                               f"{len(kvt - ref)}")

        def _recognise(self, classes: set[str]) -> None:
            """A recognised difference: the tiers now differ, so the pair is apart."""
            self.rec.differences.update(classes)
            if self.rec.first_difference_at is None:
                self.rec.first_difference_at = self.step
            self.in_step = False
            self.lag = {}

        def _guard(self, fn, *args):
            """Run a kvtriton call while no unrecognised difference occurred; one (or an error)
            ends the seed's checks."""
            if not self.live:
                return None
            try:
                return fn(*args)
            except Diverged as e:
                self.rec.unknown.append(str(e))
            except Exception as e:  # an exception is a difference too, recorded with its text
                self.rec.unknown.append(f"step {self.step}: kvtriton raised {e!r}")
            self.live = False
            return None

        # ---- the scheduler's calls ------------------------------------------------------------

        def bind_gpu_block_pool(self, gpu_block_pool):
            self.ref.bind_gpu_block_pool(gpu_block_pool)
            self.kvt.bind_gpu_block_pool(gpu_block_pool)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            out = self.ref.get_num_new_matched_tokens(request, num_computed_tokens)

            def check():
                rid = request.request_id
                got = self.kvt.get_num_new_matched_tokens(request, num_computed_tokens)
                self.kvt_hits[rid] = got[0]
                if self.in_step:
                    self.rec.lookups += 1
                    self._compare(f"lookup {rid}", tuple(out), tuple(got))
                else:
                    want = self._own_hit(request, num_computed_tokens)
                    if got[0] != want:
                        raise Diverged(f"step {self.step}: lookup {rid}: kvtriton hit "
                                       f"{got[0]} tokens, its own tier holds a run of {want}")

            self._guard(check)
            return out

        def _own_hit(self, request, num_computed_tokens) -> int:
            """The hit the rules give on kvtriton's own tier: the run of cached blocks from the
            computed prefix, at most up to the block before the last token."""
            cached = self._kvt_cached()
            hashes = request.block_hashes
            start = num_computed_tokens // BS
            stop = min(len(hashes), (request.num_tokens - 1) // BS)
            n = 0
            suffix = (0).to_bytes(4, "big")
            while start + n < stop and hashes[start + n] + suffix in cached:
                n += 1
            return n * BS

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            self.ref.update_state_after_alloc(request, blocks, num_external_tokens)
            ext = num_external_tokens
            if not self.in_step:
                # vLLM accepted its own hit; kvtriton is given what its tier can serve.
                ext = min(ext, self.kvt_hits.get(request.request_id, 0))
            self._guard(self.kvt.update_state_after_alloc, request, blocks, ext)

        def build_connector_meta(self, scheduler_output):
            ref_before = self._ref_cached() if self.live else set()
            kvt_before = self._kvt_cached() if self.live else set()
            in_flight, by_hash = self._kvt_in_flight_hashes() if self.live else (set(), {})
            # vLLM's scan budget: its free CPU blocks (a queued finish flush holds its own).
            free = self.ref.cpu_block_pool.get_num_free_blocks()
            flushed = sum(len(t.gpu_block_ids) for t in self.ref._pending_finished_stores)
            ref = self.ref.build_connector_meta(scheduler_output)
            kvt = self._guard(self._build_kvt, scheduler_output, ref, ref_before, kvt_before,
                              in_flight, by_hash, free, flushed)
            self.step += 1
            return TeeMetadata(ref, kvt)

        def _restarted(self, so) -> set[str]:
            """Requests whose row starts over this step (preempted or resumed)."""
            out = set(so.preempted_req_ids or ())
            out |= set(so.scheduled_cached_reqs.resumed_req_ids)
            out |= {r.req_id for r in so.scheduled_new_reqs}
            return out

        def _build_kvt(self, so, ref, ref_before, kvt_before, in_flight, by_hash, free,
                       flushed):
            kvt_free = self.kvt.cpu_pool.num_free_blocks
            kvt = self.kvt.build_connector_meta(so)
            h_kvt = [self._gpu_hash(b) for b in kvt.store.gpu_blocks]
            self._check_own_stores(kvt, h_kvt, kvt_before, in_flight, kvt_free)
            rows = self._kvt_rows()
            self._check_own_cursors(so, rows, set(h_kvt), kvt_before, in_flight, by_hash)
            self._check_own_loads(kvt)
            if kvt.store.event >= 0:
                self.kvt_in_flight[kvt.store.event] = list(zip(kvt.store.gpu_blocks, h_kvt,
                                                               strict=True))
            if kvt.store.event >= 0 or ref.store_event >= 0:
                self.ev_pairs.append((ref.store_event, kvt.store.event))
            self.ev_pairs = [(r, k) for r, k in self.ev_pairs
                             if r in self.ref._store_event_to_blocks or k in self.kvt_in_flight]
            self.rec.stores += len(kvt.store)
            self.rec.loads += len(kvt.load)
            if self.in_step:
                self._compare_step(ref, kvt, h_kvt, ref_before, in_flight, by_hash, free,
                                   flushed, rows)
                if self.in_step:
                    self.rec.steps_compared += 1
                    return kvt
                self.rec.steps_apart += 1
                return kvt
            self.rec.steps_apart += 1
            if self._same_state(ref, kvt):
                self.in_step = True
                self.rec.resyncs += 1
            return kvt

        # ---- kvtriton against its own tier (always) -------------------------------------------

        def _check_own_stores(self, kvt, h_kvt, kvt_before, in_flight, kvt_free) -> None:
            gpu = self.kvt.gpu_pool.vllm_pool.blocks
            for b, h in zip(kvt.store.gpu_blocks, h_kvt, strict=True):
                if h is None or gpu[b].is_null:
                    raise Diverged(f"step {self.step}: kvtriton stored GPU block {b}, which "
                                   "holds no hash")
            # A queued finish flush joins the batch; it is in flight already.
            scanned = [h for h in h_kvt if h not in in_flight]
            if len(set(scanned)) != len(scanned) or set(scanned) & kvt_before:
                raise Diverged(f"step {self.step}: kvtriton stored a block twice, or one its "
                               "tier held")
            if len(scanned) > kvt_free:
                raise Diverged(f"step {self.step}: kvtriton stored {len(scanned)} blocks with "
                               f"{kvt_free} free")

        def _check_own_cursors(self, so, rows, stored, kvt_before, in_flight, by_hash) -> None:
            """Every position a cursor passed this step was cached, in flight, stored now or
            holds no hash to store; a cursor moves back only when its row starts over."""
            restarted = self._restarted(so)
            cursors = {}
            self.collided = set()
            for rid, (table, cur) in rows.items():
                self.collided |= self._collided(rid, table)
                before = 0 if rid in restarted else self.kvt_cursor.get(rid, 0)
                if cur < before:
                    raise Diverged(f"step {self.step}: {rid}'s cursor moved back "
                                   f"({before} -> {cur})")
                for p in range(before, cur):
                    b = table[p]
                    h = self._gpu_hash(b)
                    if h is None or h in kvt_before or h in stored or h in in_flight \
                            or b in self.collided:
                        continue
                    raise Diverged(f"step {self.step}: {rid}'s cursor passed position {p} "
                                   f"(GPU block {b}), neither cached, in flight nor stored")
                cursors[rid] = cur
            self.kvt_cursor = cursors

        def _check_own_loads(self, kvt) -> None:
            keys, cpu = self.kvt.keys, self.kvt.cpu_pool
            for b_gpu, b_cpu in zip(kvt.load.gpu_blocks, kvt.load.cpu_blocks, strict=True):
                want = self._gpu_hash(b_gpu)
                got = keys.hash_of(cpu.block_hash(b_cpu))
                if want is not None and want != got:
                    raise Diverged(f"step {self.step}: kvtriton loads CPU block {b_cpu} "
                                   f"into GPU block {b_gpu}, which holds another hash")

        # ---- kvtriton against vLLM (in step) --------------------------------------------------

        def _compare_step(self, ref, kvt, h_kvt, before, in_flight, by_hash, free, flushed,
                          rows) -> None:
            after = self._ref_cached()
            evicted = before - after
            self.rec.exhausted_steps += bool(evicted)
            h_ref = [self._gpu_hash(b) for b in ref.store_gpu_blocks]
            ref_spent = self.ref.cpu_block_pool.get_num_free_blocks() == 0
            ref_rows = self._ref_cursors()
            if h_ref != h_kvt:
                extra, missing = Counter(h_ref) - Counter(h_kvt), Counter(h_kvt) - Counter(h_ref)
                if not extra and not missing:
                    # The same blocks in another order: vLLM reached one first through a request
                    # whose cursor lags (kvtriton stores it through a later request).
                    i = next(i for i, (a, b) in enumerate(zip(h_ref, h_kvt, strict=True))
                             if a != b)
                    if not self._at_lagged_position(ref.store_gpu_blocks[i]):
                        raise Diverged(f"step {self.step}: the same blocks stored in another "
                                       "order")
                    self._recognise({"per_request_allocation"})
                    return
                kvt_blocks = set(kvt.store.gpu_blocks)
                classes = set()
                for h, n in extra.items():
                    # vLLM's copies of h that kvtriton did not make (two GPU blocks may hold h).
                    for b in [b for b in ref.store_gpu_blocks
                              if self._gpu_hash(b) == h and b not in kvt_blocks][:n]:
                        classes.add(self._why_only_vllm(b, h, evicted, rows, by_hash, kvt))
                if missing:
                    kwhere = {self._gpu_hash(b): b for b in kvt.store.gpu_blocks}
                    deferred = all(self._ref_deferred(kwhere[h], ref_rows) for h in missing)
                    if not (extra and ref_spent and deferred):
                        raise Diverged(f"step {self.step}: kvtriton stored "
                                       f"{sum(missing.values())} blocks vLLM did not; vLLM "
                                       f"stored {len(extra)} extra, used "
                                       f"{len(h_ref) - flushed} of {free} free blocks, "
                                       f"deferred them: {deferred}")
                    classes.add("budget")
                self._recognise(classes)
                return
            self._compare("load GPU blocks", ref.load_gpu_blocks, kvt.load.gpu_blocks)
            ref_cpu = self.ref.cpu_block_pool.blocks
            self._compare("loaded hashes", [ref_cpu[b].block_hash for b in ref.load_cpu_blocks],
                          [self.kvt.keys.hash_of(self.kvt.cpu_pool.block_hash(b))
                           for b in kvt.load.cpu_blocks])
            self._compare("load requests",
                          sorted(ref.load_event_to_reqs.get(ref.load_event, [])),
                          sorted(kvt.load_event_to_reqs.get(kvt.load.event, [])))
            self._check_cpu("build_connector_meta")
            self._check_cursors(evicted, ref_spent, ref_rows, rows)

        def _why_only_vllm(self, b, h, evicted, rows, by_hash, kvt) -> str:
            """The recognised difference behind vLLM storing GPU block ``b`` (hash ``h``) where
            kvtriton did not, from its evidence; ``Diverged`` if none is found."""
            if h in evicted and self._kvt_passed(b, rows):
                return "per_request_allocation"
            if any(o != b for o in by_hash.get(h, ())) or any(
                    o != b and self._gpu_hash(o) == h for o in kvt.store.gpu_blocks):
                return "in_flight_duplicate"
            if self._at_lagged_position(b):
                return "per_request_allocation"
            if b in self.collided:
                return "key_collision"
            raise Diverged(f"step {self.step}: vLLM stored GPU block {b}, kvtriton did not, "
                           "and no recognised cause explains it")

        def _kvt_passed(self, gpu_block: int, rows) -> bool:
            """Whether a kvtriton cursor is past ``gpu_block`` in its request's table."""
            return any(gpu_block in table[:cur] for table, cur in rows.values())

        def _ref_deferred(self, gpu_block: int, ref_rows) -> bool:
            """Whether ``gpu_block`` sits at or past vLLM's cursor in a request's table."""
            return any(gpu_block in table[cur:] for table, cur in ref_rows.values())

        def _check_cursors(self, evicted, ref_spent, ref_rows, rows) -> None:
            lag = {}
            for rid, (table, c) in ref_rows.items():
                k = rows[rid][1] if rid in rows else 0
                if c == k:
                    continue
                old = self.lag.get(rid)
                # An old gap may only close; a new one needs vLLM behind, its budget spent,
                # stopped at a hash that this step's allocations evicted.
                ok = c < k and ((old is not None and old[0] <= c)
                                or (ref_spent and c < len(table)
                                    and self._gpu_hash(table[c]) in evicted))
                if not ok:
                    raise Diverged(f"step {self.step}: {rid}'s cursor: vLLM {c}, kvtriton {k}")
                self.rec.gaps_opened += old is None
                lag[rid] = (c, k)
            self.lag = lag
            self.rec.lagging_steps += bool(lag)

        def _at_lagged_position(self, gpu_block: int) -> bool:
            """Whether ``gpu_block`` sits, in a lagging request's table, between vLLM's cursor
            and kvtriton's: a position kvtriton passed while vLLM's budget was out."""
            for rid, (lo, hi) in self.lag.items():
                st = self.ref._reqs_to_store.get(rid)
                if st is not None and gpu_block in st.block_ids[0][lo:hi]:
                    return True
            return False

        def _same_state(self, ref, kvt) -> bool:
            """Whether both tiers hold the same now: contents and eviction order, stores and
            loads in flight, cursors."""
            if self._ref_free_order() != self._kvt_free_order():
                return False
            if self._ref_cached() != self._kvt_cached():
                return False
            # The same stores in flight, paired by the step that issued them (they complete
            # together) and in the same order (their CPU blocks are freed in it).
            gpu = self._gpu_hash
            for ref_ev, kvt_ev in self.ev_pairs:
                t = self.ref._store_event_to_blocks.get(ref_ev)
                ref_hs = [] if t is None else [gpu(b) for b in t.gpu_block_ids]
                kvt_hs = [h for _, h in self.kvt_in_flight.get(kvt_ev, ())]
                if ref_hs != kvt_hs:
                    return False
            ref_loads = sorted(r for r, st in self.ref._reqs_to_load.items()
                               if st.load_event is not None)
            if ref_loads != sorted(self.kvt.planner.loads_in_flight()):
                return False
            rows = self._kvt_rows()
            ref_rows = self._ref_cursors()
            return set(rows) == set(ref_rows) and all(
                rows[r][1] == c for r, (_, c) in ref_rows.items())

        def update_connector_output(self, connector_output):
            wm = connector_output.kv_connector_worker_meta
            ref_out = KVConnectorOutput(finished_recving=connector_output.finished_recving,
                                        kv_connector_worker_meta=wm.ref if wm else None)
            self.ref.update_connector_output(ref_out)
            loads = connector_output.finished_recving
            if self.kvt_finished_loads is not None:
                loads, self.kvt_finished_loads = self.kvt_finished_loads or None, None
            kvt_out = KVConnectorOutput(finished_recving=loads,
                                        kv_connector_worker_meta=wm.kvt if wm else None)

            def apply():
                self.kvt.update_connector_output(kvt_out)
                if wm is not None:
                    for ev in wm.kvt.completed_store_events:
                        self.kvt_in_flight.pop(ev, None)
                if self.in_step:
                    self._check_cpu("update_connector_output")

            self._guard(apply)

        def request_finished(self, request, block_ids):
            raise AssertionError("the scheduler calls request_finished_all_groups (SupportsHMA)")

        def request_finished_all_groups(self, request, block_ids):
            rid = request.request_id
            n_ref = len(self.ref._pending_finished_stores)
            lag = self.lag.get(rid)
            ref_table = self.ref._reqs_to_store[rid].block_ids[0] \
                if rid in self.ref._reqs_to_store else []
            out = self.ref.request_finished_all_groups(request, block_ids)
            ref_flush = [b for t in self.ref._pending_finished_stores[n_ref:]
                         for b in t.gpu_block_ids]

            def finish():
                n_kvt = len(self.kvt.planner.queued_flush().gpu_blocks)
                self.collided = self._collided(rid, block_ids[0])
                self.kvt.request_finished(request, block_ids)
                kvt_flush = self.kvt.planner.queued_flush().gpu_blocks[n_kvt:]
                if not self.in_step:
                    return
                if ref_flush != kvt_flush:
                    self._check_flush(rid, lag, ref_table, ref_flush, kvt_flush)
                    return
                self._check_cpu(f"request_finished({rid})")

            self._guard(finish)
            return out

        def _check_flush(self, rid, lag, table, ref_flush, kvt_flush) -> None:
            """Flushes that differ: each block only vLLM flushed sits inside a cursor gap or
            copies a hash kvtriton has in flight from another GPU block; kvtriton's own extra
            ones only where vLLM's budget ran out."""
            _, by_hash = self._kvt_in_flight_hashes()
            lo, hi = lag if lag is not None else (0, 0)
            gap = set(table[lo:hi])
            classes = set()
            for b in set(ref_flush) - set(kvt_flush):
                if b in gap:
                    classes.add("per_request_allocation")
                elif any(o != b for o in by_hash.get(self._gpu_hash(b), ())):
                    classes.add("in_flight_duplicate")
                elif b in self.collided:
                    classes.add("key_collision")
                else:
                    raise Diverged(f"step {self.step}: flush of {rid}: vLLM {ref_flush}, "
                                   f"kvtriton {kvt_flush}; GPU block {b} is neither in a "
                                   f"cursor gap ({lo}-{hi}) nor a duplicate in flight")
            own = set(kvt_flush) - set(ref_flush)
            if own and (not classes or self.ref.cpu_block_pool.get_num_free_blocks() > 0):
                raise Diverged(f"step {self.step}: flush of {rid}: vLLM {ref_flush}, kvtriton "
                               f"{kvt_flush}: kvtriton flushed blocks vLLM had room for")
            if classes:
                self._recognise(classes)

        def has_pending_push_work(self):
            # Apart, kvtriton may hold a flush vLLM does not: the engine steps until both issued.
            return self.ref.has_pending_stores() or (self.live
                                                     and self.kvt.has_pending_stores())

        # The worker role does not exist here: no model runs.
        def start_load_kv(self, forward_context, **kwargs):
            raise AssertionError

        def wait_for_layer_load(self, layer_name):
            raise AssertionError

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise AssertionError

        def wait_for_save(self):
            raise AssertionError

    return TeeConnector, TeeWorkerMetadata


_CLASSES: tuple | None = None


def __getattr__(name: str):
    # vLLM imports the connector by name from this module (kv_connector_module_path).
    global _CLASSES
    if name in ("TeeConnector", "TeeWorkerMetadata"):
        if _CLASSES is None:
            _CLASSES = _tee_classes()
        return _CLASSES[0] if name == "TeeConnector" else _CLASSES[1]
    raise AttributeError(name)


def _prompts(rng: np.random.Generator, n: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt, max_tokens): three prefix families, some prompts repeated exactly."""
    families = [rng.integers(1, 30000, int(rng.integers(2, 9)) * BS).tolist() for _ in range(3)]
    out: list[tuple[list[int], int]] = []
    for _ in range(n):
        if out and rng.random() < 0.15:
            p, _ = out[int(rng.integers(len(out)))]
        else:
            head = families[int(rng.integers(3))] if rng.random() < 0.8 else []
            p = head + rng.integers(1, 30000, int(rng.integers(1, 80))).tolist()
        out.append((list(p), int(rng.integers(1, 40))))
    return out


def _returning(rng: np.random.Generator, earlier: list[tuple[list[int], int]]
               ) -> list[tuple[list[int], int]]:
    """Earlier prompts coming back (some with a new tail): CPU hits once the GPU cache is gone."""
    out = []
    for _ in range(int(rng.integers(3, 9))):
        p, mx = earlier[int(rng.integers(len(earlier)))]
        if rng.random() < 0.5:
            p = p[:len(p) // BS * BS] + rng.integers(1, 30000, int(rng.integers(1, 40))).tolist()
        out.append((list(p), mx))
    return out


def run_seed(model_dir, seed: int, max_steps: int = 1200) -> Record:
    """One random schedule through vLLM's scheduler with ``TeeConnector``; its record."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from kvtriton.sim.vllm_scheduler import _default_token, make_scheduler, vllm_request
    from kvtriton.specs import FullAttentionSpec
    from kvtriton.vllm.metadata import KVTritonWorkerMetadata

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tee_worker_meta = __getattr__("TeeWorkerMetadata")
    rng = np.random.default_rng(seed)
    s = make_scheduler(model_dir, [FullAttentionSpec(BS, 1, 8, 1)],
                       num_gpu_blocks=int(rng.integers(20, 65)),
                       cpu_blocks=int(rng.choice([6, 12, 24, 48, 160])),
                       max_num_batched_tokens=int(rng.choice([64, 128, 256])), max_num_seqs=8,
                       kv_connector="TeeConnector", kv_connector_module_path=__name__)
    tee = s.connector
    tee.rec.seed = seed
    first = _prompts(rng, int(rng.integers(10, 26)))
    pending = list(first)
    prefix = "r"
    # The second phase draws from its own stream: the first phase is the same schedule as
    # before it existed, whatever the second does.
    rng2 = np.random.default_rng([seed, 2])
    second = _returning(rng2, first)
    stores: list[tuple[int, int, int]] = []  # (due step, vLLM event, kvtriton event)
    loads: list[tuple[int, list[str], list[str]]] = []  # (due, vLLM's requests, kvtriton's)
    phase = 1
    for step in range(max_steps):
        r = rng if phase == 1 else rng2
        while pending and r.random() < 0.15:
            p, mx = pending.pop()
            s.add_request(vllm_request(f"s{seed}{prefix}{len(pending)}", p, mx, BS))
        if r.random() < 0.03 and s.requests:
            victim = sorted(s.requests)[int(r.integers(len(s.requests)))]
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        meta = so.kv_connector_metadata
        delay = int(r.integers(0, 3))
        if meta.ref.store_event >= 0 or (meta.kvt is not None and meta.kvt.store.event >= 0):
            kvt_ev = meta.kvt.store.event if meta.kvt is not None else -1
            stores.append((step + delay, meta.ref.store_event, kvt_ev))
        kvt_load = [] if meta.kvt is None or meta.kvt.load.event < 0 else \
            meta.kvt.load_event_to_reqs[meta.kvt.load.event]
        ref_load = [] if meta.ref.load_event < 0 else \
            meta.ref.load_event_to_reqs[meta.ref.load_event]
        if ref_load or kvt_load:
            loads.append((step + delay, list(ref_load), list(kvt_load)))
        done_stores = [(r_, k) for d, r_, k in stores if d <= step]
        stores = [x for x in stores if x[0] > step]
        done_loads = {r_ for d, rs, _ in loads if d <= step for r_ in rs}
        tee.kvt_finished_loads = {r_ for d, _, ks in loads if d <= step for r_ in ks}
        loads = [x for x in loads if x[0] > step]
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            sampled.append([] if req.num_computed_tokens < req.num_tokens
                           else [_default_token(rid, req.num_tokens)])
        wm = tee_worker_meta(
            SimpleCPUOffloadWorkerMetadata({r_: 1 for r_, _ in done_stores if r_ >= 0}),
            KVTritonWorkerMetadata({k: 1 for _, k in done_stores if k >= 0}),
        ) if done_stores else None
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r_: i for i, r_ in enumerate(ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(
                                    finished_recving=done_loads or None,
                                    kv_connector_worker_meta=wm))
        s.update_from_output(so, out)
        if tee.kvt_finished_loads:  # vLLM had no output to hand on: kvtriton's loads alone
            tee.update_connector_output(KVConnectorOutput())
        tee.kvt_finished_loads = None
        if not pending and not s.has_requests() and not stores and not loads:
            if phase == 2 or not tee.live:  # a failed seed: kvtriton holds pins unreported
                break
            # Drop the GPU prefix cache (the CPU tiers keep theirs): returning prompts load.
            if not s.reset_prefix_cache():
                raise AssertionError(
                    f"seed {seed}: the GPU cache did not reset when idle: {tee.rec}, kvtriton "
                    f"stores {tee.kvt.planner.store_events_in_flight()}, loads "
                    f"{tee.kvt.planner.loads_in_flight()}, hits {tee.kvt.planner.pending_hits()}"
                    f", vLLM loads {list(tee.ref._reqs_to_load)}")
            pending, phase, prefix = list(second), 2, "q"
    else:
        raise AssertionError(f"seed {seed}: the schedule did not drain")
    tee.rec.steps = tee.step
    tee.rec.apart_at_end = not tee.in_step
    if tee.live:
        tee._guard(lambda: tee.kvt.planner.check_invariants(idle=True))
    return tee.rec


# ---- known bug classes, each of which the comparison must catch ---------------------------------

@contextlib.contextmanager
def _patched(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, make(old))
    try:
        yield
    finally:
        setattr(obj, name, old)


def _no_deferred_stop(old):
    def advance(self, rows, ready, c, chosen, deferred, dups, budget):
        return old(self, rows, ready, c, chosen, deferred[:0], dups, budget)
    return advance


def _one_past_deferred(old):
    def advance(self, rows, ready, c, chosen, deferred, dups, budget):
        pos = c.position.copy()
        pos[deferred] += 1
        return old(self, rows, ready, dataclasses.replace(c, position=pos), chosen, deferred,
                   dups, budget)
    return advance


def _moves_after_budget(old):
    def advance(self, rows, ready, c, chosen, deferred, dups, budget):
        return old(self, rows, ready, c, chosen, deferred, dups, len(chosen) + 1)
    return advance


def _flags_never_cleared(old):
    def set_in_flight(self, gpu_blocks, keys, value):
        if value:
            old(self, gpu_blocks, keys, value)
    return set_in_flight


class _ShiftedCursor:
    """A selector whose cursors read one further on (for the flush only)."""

    def __init__(self, sel):
        self._sel = sel

    def __getattr__(self, name):
        return getattr(self._sel, name)

    def cursor(self, row, group):
        return self._sel.cursor(row, group) + 1


def _flush_wrong_cursor(old):
    def queue_flush(self, rid, req, st):
        sel = self._selector
        self._selector = _ShiftedCursor(sel)
        try:
            return old(self, rid, req, st)
        finally:
            self._selector = sel
    return queue_flush


def _mutation(attr_path: str, make):
    def apply():
        from kvtriton.planner import scan, stores
        owners = {"FusedSelector": scan.FusedSelector, "Stores": stores.Stores}
        cls_name, name = attr_path.split(".")
        return _patched(owners[cls_name], name, make)
    return apply


#: name -> a context manager factory that applies the bug while it is open.
MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "cursor_not_stopped_by_deferred": _mutation("FusedSelector._advance_cursors",
                                                _no_deferred_stop),
    "cursor_one_past_deferred": _mutation("FusedSelector._advance_cursors", _one_past_deferred),
    "cursor_moves_after_budget_spent": _mutation("FusedSelector._advance_cursors",
                                                 _moves_after_budget),
    "in_flight_flags_never_cleared": _mutation("FusedSelector.set_in_flight",
                                               _flags_never_cleared),
    "flush_from_wrong_cursor": _mutation("Stores._queue_flush", _flush_wrong_cursor),
}


def first_caught(model_dir, mutation: str, seeds: int) -> tuple[int, str] | None:
    """The first seed below ``seeds`` at which ``mutation`` is an unrecognised difference, and
    its text; None if it passes them all."""
    with MUTATIONS[mutation]():
        for seed in range(seeds):
            rec = run_seed(model_dir, seed)
            if rec.unknown:
                return seed, rec.unknown[0]
    return None


def summarise(records: list[Record]) -> dict:
    outcomes = Counter(r.outcome for r in records)
    by_class = Counter()
    for r in records:
        by_class.update(r.differences)
    total = {name: sum(getattr(r, name) for r in records)
             for name in ("steps", "steps_compared", "steps_apart", "resyncs", "gaps_opened",
                          "lagging_steps", "exhausted_steps", "lookups", "stores", "loads")}
    first = sorted(r.first_difference_at for r in records if r.first_difference_at is not None)
    return {
        "seeds": len(records),
        "outcomes": {k: outcomes.get(k, 0) for k in ("identical", "recognised", "unrecognised")},
        "differences_by_class": dict(by_class),
        "seeds_with_loads": sum(r.loads > 0 for r in records),
        "seeds_apart_at_end": sum(r.apart_at_end for r in records),
        "seeds_resynced": sum(r.resyncs > 0 for r in records),
        "median_first_difference_step": first[len(first) // 2] if first else None,
        "totals": total,
        "unrecognised": [f"seed {r.seed}: {u}" for r in records for u in r.unknown],
    }


def main(argv: list[str] | None = None) -> int:
    from bench.common import OneLineParser, write_result

    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3000)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--json", default="bench/results/differential.json",
                    help="where the outcome counts go")
    args = ap.parse_args(argv)
    import tempfile

    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(tmp, 8192)
        records = []
        for seed in range(args.first, args.first + args.seeds):
            records.append(run_seed(model_dir, seed))
            if (seed + 1) % 250 == 0:
                print(f"  {seed + 1 - args.first} seeds, "
                      f"{sum(r.outcome == 'unrecognised' for r in records)} unrecognised",
                      flush=True)
    out = summarise(records)
    out["first_seed"] = args.first
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"{out['seeds']} seeds: {out['outcomes']}, differences {out['differences_by_class']}, "
          f"loads in {out['seeds_with_loads']} seeds, {out['elapsed_s']} s")
    for line in out["unrecognised"][:10]:
        print("  " + line)
    path = Path(args.json)
    write_result(path.stem, out, path.parent)
    return 1 if out["outcomes"]["unrecognised"] else 0


if __name__ == "__main__":
    sys.exit(main())
