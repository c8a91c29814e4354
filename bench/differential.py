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
- ``key_collision``: vLLM stores (or flushes) a block at a position kvtriton cannot bind
  (``kvtriton.vllm.keys``: that position is never stored for this request). The evidence is
  taken from vLLM's requests, never from kvtriton's own list of unbound ids (a position it
  failed to bind would excuse itself): the request hashed that position while admitted, after
  another request had made the same hash (``HashOrigins``).
- ``failed_store``: the driver reports some of kvtriton's stores failed (in a share of the
  seeds; vLLM's worker has no failure report, so its stores complete): kvtriton's tier lacks
  those blocks.

Anything else is *unrecognised*, and fails the test. After a recognised difference the tiers
hold different blocks: the pair is *apart*. Every step, in step or apart, kvtriton is held to
models kept from what crosses the connector's boundary alone (``bench.differential_models``):
its CPU tier's contents, pins and free queue against ``TierModel`` (the tier's LRU rules:
stores take the head, completions free head first, failures free unhashed); a lookup hit is the
longest run the model holds, capped to recompute the last token; a step's load is exactly the
hits accepted since the last step, CPU blocks of the hit into the GPU blocks past the local
hit; a store copies hashed blocks neither cached nor in flight onto the head of the free queue,
within the free blocks, and a scan that spent its budget moves no later cursor; a finish flush
is every confirmed block past the cursor that the model does not hold (``expected_flush``); and
the planner's and the pool's stated invariants hold. kvtriton is fed answers it can serve (an
accepted hit no longer than its own). The pair is *in step* again, and compared again, as soon
as both hold the same CPU contents in the same eviction order, the same stores in flight, the
same loads in flight and the same cursors.

``run_seed`` runs one seed, ``main`` many (the bench study: outcome counts per seed in JSON);
``MUTATIONS`` (``bench.differential_mutations``) are known bug classes, each of which the
comparison must catch wherever it changes an answer, planted from the start or at the first
recognised difference (``mutation_table``).

Run: ``python -m bench.differential [--seeds N] [--first S] [--mutations] [--json out.json]``
(3,000 seeds by default, about 15 minutes on one core; ``--mutations`` plants every bug class
two ways in every seed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.differential_mutations import MUTATIONS, fired, reset_fired

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
    failed_stores: int = 0  # kvtriton store events the driver reported failed
    unknown: list[str] = field(default_factory=list)
    unknown_apart: bool = False  # the unrecognised difference came while the pair was apart
    # Under a planted bug (bench.differential_mutations): whether it changed what kvtriton did
    # in a call made while the pair was in step, and in one made while apart.
    fired_in_step: bool = False
    fired_apart: bool = False
    # A digest of every answer kvtriton gave: a planted bug that leaves it as the unmutated
    # run's changed nothing the differential can see.
    answers: str = ""

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

    from bench.differential_models import HashOrigins, RuleBroken, TierModel, expected_flush
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
            self.on_apart: Callable[[], None] | None = None  # called at the first difference
            # What kvtriton's side must do, kept from vLLM's requests and the transfers alone.
            self.origins = HashOrigins()
            self.tier = TierModel(self.kvt.num_cpu_blocks)
            self.lookup_at: dict[str, int] = {}  # rid -> computed tokens its last lookup had
            self.accepted: dict[str, list[int]] = {}  # rid -> GPU blocks its load must fill
            self.fired_seen = fired()
            self._answers = hashlib.blake2b(digest_size=16)

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
            """GPU blocks of ``rid``'s table at positions where a key collision may be: ``rid``
            hashed them while admitted, another request having made the same hash before
            (``HashOrigins``, from vLLM's requests; kvtriton's own list of unbound ids would let
            a position it failed to bind excuse itself)."""
            return {table[p] for p in self.origins.collided(rid) if p < len(table)}

        def _position_hashes(self, request) -> list[bytes]:
            """``request``'s block hashes as the tiers key them (group 0)."""
            return [h + _GROUP0 for h in request.block_hashes]

        def _check_tier(self, when: str) -> None:
            """kvtriton's CPU tier against ``TierModel``: contents, pins and free queue."""
            pool, keys = self.kvt.cpu_pool, self.kvt.keys
            hashes = [None] + [None if (k := pool.block_hash(b)) is None else keys.hash_of(k)
                               for b in range(1, pool.num_blocks)]
            why = self.tier.differs(list(pool.iter_free()), pool.ref_cnt, hashes)
            if why is not None:
                raise Diverged(f"step {self.step}: after {when}, kvtriton's CPU tier: {why}")

        def _check_books(self, when: str) -> None:
            """The planner's and the CPU pool's own stated invariants (the fuzz suite's, short
            of quiescence)."""
            try:
                self.kvt.planner.check_invariants()
                self.kvt.cpu_pool.check_invariants()
            except AssertionError as e:
                raise Diverged(f"step {self.step}: after {when}, kvtriton's books: {e}") from e

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
            if self.on_apart is not None:
                self.on_apart()
                self.on_apart = None

        def _guard(self, fn, *args):
            """Run a kvtriton call while no unrecognised difference occurred; one (or an error)
            ends the seed's checks."""
            if not self.live:
                return None
            in_step = self.in_step
            self._note_fired(in_step)  # acted outside a call (vLLM's allocation binds keys)
            try:
                return fn(*args)
            except Diverged as e:
                self.rec.unknown.append(str(e))
            except RuleBroken as e:
                self.rec.unknown.append(f"step {self.step}: {e}")
            except Exception as e:  # an exception is a difference too, recorded with its text
                self.rec.unknown.append(f"step {self.step}: kvtriton raised {e!r}")
            finally:
                self._note_fired(in_step)
            self.rec.unknown_apart = not self.in_step
            self.live = False
            return None

        def _answer(self, *parts) -> None:
            self._answers.update(repr(parts).encode())

        def answers(self) -> str:
            return self._answers.hexdigest()

        def _note_fired(self, in_step: bool) -> None:
            """Record whether a planted bug acted since the last note, in step or apart."""
            if fired() > self.fired_seen:
                self.fired_seen = fired()
                self.rec.fired_in_step |= in_step
                self.rec.fired_apart |= not in_step

        # ---- the scheduler's calls ------------------------------------------------------------

        def bind_gpu_block_pool(self, gpu_block_pool):
            self.ref.bind_gpu_block_pool(gpu_block_pool)
            self.kvt.bind_gpu_block_pool(gpu_block_pool)

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            out = self.ref.get_num_new_matched_tokens(request, num_computed_tokens)

            def check():
                rid = request.request_id
                self.origins.observe(request)
                got = self.kvt.get_num_new_matched_tokens(request, num_computed_tokens)
                self._answer("lookup", rid, got)
                self.kvt_hits[rid] = got[0]
                self.lookup_at[rid] = num_computed_tokens
                if self.in_step:
                    self.rec.lookups += 1
                    self._compare(f"lookup {rid}", tuple(out), tuple(got))
                else:
                    want = self._own_hit(request, num_computed_tokens)
                    if got[0] != want:
                        raise Diverged(f"step {self.step}: lookup {rid}: kvtriton hit "
                                       f"{got[0]} tokens, its own tier holds a run of {want}")
                start = num_computed_tokens // BS
                hit = self._position_hashes(request)[start:start + got[0] // BS]
                blocks = self.tier.blocks_of(hit)
                if blocks is None:
                    raise Diverged(f"step {self.step}: lookup {rid}: kvtriton hit {got[0]} "
                                   "tokens, blocks its tier's rules do not hold")
                self.tier.lookup(rid, blocks)
                self._check_tier(f"lookup {rid}")

            self._guard(check)
            return out

        def _own_hit(self, request, num_computed_tokens) -> int:
            """The hit the rules give on kvtriton's own tier (``TierModel``): the run of cached
            blocks from the computed prefix, at most up to the block before the last token."""
            start = num_computed_tokens // BS
            stop = min(len(request.block_hashes), (request.num_tokens - 1) // BS)
            return self.tier.cached_run(self._position_hashes(request)[start:max(start, stop)]) \
                * BS

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            self.ref.update_state_after_alloc(request, blocks, num_external_tokens)
            ext = num_external_tokens
            if not self.in_step:
                # vLLM accepted its own hit; kvtriton is given what its tier can serve.
                ext = min(ext, self.kvt_hits.get(request.request_id, 0))

            def alloc():
                rid = request.request_id
                self.origins.admitted(request)
                self.kvt.update_state_after_alloc(request, blocks, ext)
                n = ext // BS
                self.tier.accept(rid, n)
                if n:
                    # The load fills the GPU blocks of the hit's positions, past the local hit.
                    start = self.lookup_at.get(rid, 0) // BS
                    self.accepted[rid] = list(blocks.get_block_ids()[0][start:start + n])
                self._check_tier(f"allocation of {rid}")

            self._guard(alloc)

        def build_connector_meta(self, scheduler_output):
            ref_before = self._ref_cached() if self.live else set()
            # vLLM's scan budget: its free CPU blocks (a queued finish flush holds its own).
            free = self.ref.cpu_block_pool.get_num_free_blocks()
            flushed = sum(len(t.gpu_block_ids) for t in self.ref._pending_finished_stores)
            ref = self.ref.build_connector_meta(scheduler_output)
            kvt = self._guard(self._build_kvt, scheduler_output, ref, ref_before, free, flushed)
            self.step += 1
            return TeeMetadata(ref, kvt)

        def _restarted(self, so) -> set[str]:
            """Requests whose row starts over this step (preempted or resumed)."""
            out = set(so.preempted_req_ids or ())
            out |= set(so.scheduled_cached_reqs.resumed_req_ids)
            out |= {r.req_id for r in so.scheduled_new_reqs}
            return out

        def _build_kvt(self, so, ref, ref_before, free, flushed):
            self.origins.observe_all()
            kvt_before = set(self.tier.where)
            in_flight, by_hash = self._kvt_in_flight_hashes()
            queued = self.kvt.planner.queued_flush().gpu_blocks
            free_before = len(self.tier.free)
            kvt = self.kvt.build_connector_meta(so)
            self._answer("step", kvt.store.gpu_blocks, kvt.store.cpu_blocks, kvt.load.gpu_blocks,
                         kvt.load.cpu_blocks)
            h_kvt = [self._gpu_hash(b) for b in kvt.store.gpu_blocks]
            self._check_own_stores(kvt, h_kvt, kvt_before, in_flight, by_hash, queued)
            rows = self._kvt_rows()
            befores = self._check_own_cursors(so, rows, set(h_kvt), kvt_before, in_flight,
                                              by_hash)
            scanned = kvt.store.gpu_blocks[:len(kvt.store.gpu_blocks) - len(queued)]
            if len(scanned) >= free_before:
                self._check_frozen_rows(so, rows, befores, scanned)
            self._check_own_loads(kvt)
            self._check_tier("build_connector_meta")
            self._check_books("build_connector_meta")
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

        def _check_own_stores(self, kvt, h_kvt, kvt_before, in_flight, by_hash, queued
                              ) -> None:
            """The step's batch: what the scan chose (hashed blocks neither cached nor in
            flight, each once, within the free blocks, on the CPU blocks at the head of the free
            queue), then the queued finish flush, whole."""
            gpu = self.kvt.gpu_pool.vllm_pool.blocks
            for b, h in zip(kvt.store.gpu_blocks, h_kvt, strict=True):
                if h is None or gpu[b].is_null:
                    raise Diverged(f"step {self.step}: kvtriton stored GPU block {b}, which "
                                   "holds no hash")
            n = len(kvt.store.gpu_blocks) - len(queued)
            if n < 0 or kvt.store.gpu_blocks[n:] != queued:
                raise Diverged(f"step {self.step}: kvtriton's batch {kvt.store.gpu_blocks} does "
                               f"not end with the queued finish flush {queued}")
            scanned = h_kvt[:n]
            busy = {b for bs in by_hash.values() for b in bs}
            if len(set(scanned)) != len(scanned) or set(scanned) & (kvt_before | in_flight) \
                    or set(kvt.store.gpu_blocks[:n]) & busy:
                raise Diverged(f"step {self.step}: kvtriton stored a block twice, one its tier "
                               "held or one in flight")
            if n > len(self.tier.free):
                raise Diverged(f"step {self.step}: kvtriton stored {n} blocks with "
                               f"{len(self.tier.free)} free")
            want = self.tier.store(kvt.store.event, scanned)
            if kvt.store.cpu_blocks[:n] != want:
                raise Diverged(f"step {self.step}: kvtriton stores into CPU blocks "
                               f"{kvt.store.cpu_blocks[:n]}, the head of its free queue holds "
                               f"{want}")

        def _check_own_cursors(self, so, rows, stored, kvt_before, in_flight, by_hash
                               ) -> dict[str, int]:
            """Every position a cursor passed this step was cached, in flight, stored now or
            holds no hash to store; a cursor moves back only when its row starts over. Returns
            each row's cursor before the step."""
            restarted = self._restarted(so)
            cursors, befores = {}, {}
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
                befores[rid] = before
            self.kvt_cursor = cursors
            return befores

        def _new_positions(self, rid, table, before) -> list[int]:
            """Positions of ``rid`` from ``before`` to its confirmed end whose GPU block is
            hashed: what a store scan passes over (storing, or not where cached or in flight)."""
            v = self.origins.requests.get(rid)
            if v is None:
                return []
            ready = min((v.num_computed_tokens - v.num_output_placeholders) // BS, len(table),
                        len(v.block_hashes))
            return [p for p in range(before, ready) if self._gpu_hash(table[p]) is not None]

        def _check_frozen_rows(self, so, rows, befores, scanned) -> None:
            """The scan spent its budget (the free blocks): a request it reached after the
            request of the last block it chose keeps its cursor where it was, as vLLM's scan
            stops there."""
            order = [r.req_id for r in so.scheduled_new_reqs] + list(
                so.scheduled_cached_reqs.req_ids)
            order = [r for r in order if so.num_scheduled_tokens.get(r) and r in rows]
            new = {r: {rows[r][0][p] for p in self._new_positions(r, rows[r][0], befores[r])}
                   for r in order}
            # A chosen block is the first request's, in scan order, that has it among its new
            # positions (a block two requests share is stored once).
            last = -1
            for b in scanned:
                last = max(last, next((i for i, r in enumerate(order) if b in new[r]), -1))
            for r in order[last + 1:]:
                if new[r] and rows[r][1] != befores[r]:
                    raise Diverged(f"step {self.step}: {r}'s cursor moved ({befores[r]} -> "
                                   f"{rows[r][1]}) after the scan spent its budget")

        def _check_own_loads(self, kvt) -> None:
            """The step's load: every load accepted since the last step, in acceptance order,
            each exactly the accepted blocks (the hit's CPU blocks into the GPU blocks past the
            local hit), none other; each CPU block holds its GPU block's hash."""
            rids = self.tier.unissued_loads()
            got = kvt.load_event_to_reqs.get(kvt.load.event, []) if kvt.load.event >= 0 else []
            want_gpu = [b for r in rids for b in self.accepted.pop(r, [])]
            want_cpu = [b for r in rids for b in self.tier.loads[r][0]]
            if list(got) != rids or kvt.load.gpu_blocks != want_gpu \
                    or kvt.load.cpu_blocks != want_cpu:
                raise Diverged(f"step {self.step}: kvtriton loads {list(got)}: CPU "
                               f"{kvt.load.cpu_blocks} -> GPU {kvt.load.gpu_blocks}; accepted "
                               f"{rids}: CPU {want_cpu} -> GPU {want_gpu}")
            self.tier.issue_loads()
            for b_gpu, b_cpu in zip(kvt.load.gpu_blocks, kvt.load.cpu_blocks, strict=True):
                want = self._gpu_hash(b_gpu)
                if want is not None and want != self.tier.hash[b_cpu]:
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
                done = list(wm.kvt.completed_store_events) if wm is not None else []
                failed = list(wm.kvt.failed_store_events) if wm is not None else []
                for ev in done + failed:
                    self.kvt_in_flight.pop(ev, None)
                self.tier.reports(list(loads or ()), done, failed)
                self._check_tier("update_connector_output")
                self._check_books("update_connector_output")
                if failed:
                    # The driver failed them: vLLM's tier has these blocks, kvtriton's not.
                    self.rec.failed_stores += len(failed)
                    if self.in_step:
                        self._recognise({"failed_store"})
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
                self.origins.finished(request)
                self.collided = self._collided(rid, block_ids[0])
                # Its pins go before its flush takes blocks (the flush may reuse them).
                self.tier.drop(rid)
                self.accepted.pop(rid, None)
                want = self._own_flush(rid, request, block_ids[0])
                self.kvt.request_finished(request, block_ids)
                queued = self.kvt.planner.queued_flush()
                kvt_flush = queued.gpu_blocks[n_kvt:]
                self._answer("flush", rid, kvt_flush, queued.cpu_blocks[n_kvt:])
                if kvt_flush not in want:
                    raise Diverged(f"step {self.step}: flush of {rid}: kvtriton queued "
                                   f"{kvt_flush}, the rules give {want[0]}")
                taken = self.tier.queue_flush([self._gpu_hash(b) for b in kvt_flush])
                if queued.cpu_blocks[n_kvt:] != taken:
                    raise Diverged(f"step {self.step}: flush of {rid} into CPU blocks "
                                   f"{queued.cpu_blocks[n_kvt:]}, the head of the free queue "
                                   f"holds {taken}")
                self._check_tier(f"request_finished({rid})")
                if not self.in_step:
                    return
                if ref_flush != kvt_flush:
                    self._check_flush(rid, lag, ref_table, ref_flush, kvt_flush)
                    return
                self._check_cpu(f"request_finished({rid})")

            self._guard(finish)
            return out

        def _own_flush(self, rid, request, table) -> list[list[int]]:
            """The finish flushes the rules allow ``rid`` (``expected_flush``): every confirmed
            block from kvtriton's cursor whose hash is neither cached, in flight nor queued,
            within the free blocks; a position where a key collision may be is skipped or not
            (two answers then)."""
            rows = self._kvt_rows()
            st = self.kvt.planner._stores._states.get(rid)
            if rid in rows:
                cursor = rows[rid][1]
            elif st is not None and not st.finished and table:
                cursor = 0  # preempted, allocated again: the row starts over from the table
            else:
                return [[]]
            v = request
            ready = min((v.num_computed_tokens - v.num_output_placeholders) // BS, len(table),
                        len(v.block_hashes))
            in_flight, by_hash = self._kvt_in_flight_hashes()
            busy = {b for bs in by_hash.values() for b in bs}
            args = (table, cursor, ready, self._position_hashes(v), self._gpu_hash)
            rest = (set(self.tier.where) | in_flight, busy, len(self.tier.free))
            collided = {p for p in self.origins.collided(rid) if cursor <= p < ready}
            out = [expected_flush(*args, collided, *rest)]
            if collided:
                out.append(expected_flush(*args, set(), *rest))
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
_GROUP0 = (0).to_bytes(4, "big")  # vLLM's group id suffix of the one group here


def __getattr__(name: str):
    # vLLM imports the connector by name from this module (kv_connector_module_path).
    global _CLASSES
    if name in ("TeeConnector", "TeeWorkerMetadata"):
        if _CLASSES is None:
            _CLASSES = _tee_classes()
        return _CLASSES[0] if name == "TeeConnector" else _CLASSES[1]
    raise AttributeError(name)


#: The share of seeds whose kvtriton store reports may fail, and the share of those seeds' store
#: events that do.
FAILED_STORE_SEEDS = 0.3
FAILED_STORE_SHARE = 0.1


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


def run_seed(model_dir, seed: int, max_steps: int = 1200, plant_apart: str | None = None
             ) -> Record:
    """One random schedule through vLLM's scheduler with ``TeeConnector``; its record.

    ``plant_apart`` names a bug class (``MUTATIONS``) planted at the pair's first recognised
    difference and kept to the end: a bug that acts only while the two sides are apart, where
    kvtriton is held to the models of ``bench.differential_models`` alone."""
    with contextlib.ExitStack() as stack:
        plant = None if plant_apart is None else \
            (lambda: stack.enter_context(MUTATIONS[plant_apart]()))
        return _run_seed(model_dir, seed, max_steps, plant)


def _run_seed(model_dir, seed: int, max_steps: int, plant: Callable[[], None] | None
              ) -> Record:
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import RequestStatus
    from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

    from kvtriton.sim.vllm_scheduler import default_token, make_scheduler, vllm_request
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
    tee.on_apart = plant
    first = _prompts(rng, int(rng.integers(10, 26)))
    pending = list(first)
    prefix = "r"
    # The second phase draws from its own stream: the first phase is the same schedule as
    # before it existed, whatever the second does.
    rng2 = np.random.default_rng([seed, 2])
    second = _returning(rng2, first)
    # Failed stores, in a share of the seeds, from a stream of their own (the schedule stays
    # what it was): kvtriton's worker reports the store failed, vLLM's (which has no failure
    # report) completed.
    rng3 = np.random.default_rng([seed, 3])
    fail_share = FAILED_STORE_SHARE if rng3.random() < FAILED_STORE_SEEDS else 0.0
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
                           else [default_token(rid, req.num_tokens)])
        failed = {k for _, k in done_stores if k >= 0 and fail_share and rng3.random() < fail_share}
        wm = tee_worker_meta(
            SimpleCPUOffloadWorkerMetadata({r_: 1 for r_, _ in done_stores if r_ >= 0}),
            KVTritonWorkerMetadata({k: 1 for _, k in done_stores if k >= 0 and k not in failed},
                                   {k: 1 for k in sorted(failed)}),
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
    tee.rec.answers = tee.answers()
    tee.rec.apart_at_end = not tee.in_step
    if tee.live:
        tee._guard(lambda: tee.kvt.planner.check_invariants(idle=True))
    return tee.rec


# ---- known bug classes, each of which the comparison must catch ---------------------------------

def _planted_row(model_dir, name: str, seeds: list[int], baseline: dict[int, Record],
                 apart: bool) -> dict[str, list[int]]:
    """One way of planting ``name`` over ``seeds`` (from the start, or at the pair's first
    recognised difference when ``apart``): the seeds where it fired, changed an answer, was
    caught (while apart), fired only while apart, passed, or had no effect."""
    row: dict[str, list[int]] = {k: [] for k in (
        "fired", "changed", "caught", "caught_apart", "fired_only_apart", "passed",
        "no_effect")}
    for seed in seeds:
        reset_fired()
        if apart:
            rec = run_seed(model_dir, seed, plant_apart=name)
        else:
            with MUTATIONS[name]():
                rec = run_seed(model_dir, seed)
        changed = rec.answers != baseline[seed].answers
        if not fired():
            if rec.unknown:  # a bug that never acted cannot be what was caught
                raise AssertionError(f"{name} did not fire in seed {seed}, which failed: "
                                     f"{rec.unknown[0]}")
            continue
        row["fired"].append(seed)
        if changed:
            row["changed"].append(seed)
        if rec.unknown:
            row["caught"].append(seed)
            if rec.unknown_apart:
                row["caught_apart"].append(seed)
        elif changed:
            row["passed"].append(seed)
        else:
            row["no_effect"].append(seed)
        if rec.fired_apart and not rec.fired_in_step:
            row["fired_only_apart"].append(seed)
    return row


def mutation_table(model_dir, seeds: range, mutations: list[str] | None = None,
                   baseline: dict[int, Record] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Per bug class (``MUTATIONS``), planted two ways over ``seeds``: from the start
    (``planted``), and at the pair's first recognised difference in the seeds that have one
    (``planted_apart``: a bug that acts only while kvtriton is held to the models alone).

    Each way lists, by seed: ``fired`` (the bug changed what kvtriton did), ``changed`` (an
    answer kvtriton gave differs from the unmutated run's, ``baseline``: seed -> its record,
    run here where missing), ``caught`` and ``caught_apart``, ``fired_only_apart``, and the two
    outcomes that are not a catch: ``passed`` (an answer changed and nothing was caught: the
    differential missed the bug) and ``no_effect`` (fired, every answer as without it: nothing
    any comparison could see)."""
    baseline = dict(baseline or {})
    for seed in seeds:
        if seed not in baseline:
            baseline[seed] = run_seed(model_dir, seed)
    went_apart = [s for s in seeds if baseline[s].first_difference_at is not None]
    out = {}
    for name in mutations or sorted(MUTATIONS):
        out[name] = {"planted": _planted_row(model_dir, name, list(seeds), baseline, False),
                     "planted_apart": _planted_row(model_dir, name, went_apart, baseline, True)}
        if progress is not None:
            progress(f"  {name}: " + "; ".join(
                f"{way}: fired in {len(r['fired'])}, changed {len(r['changed'])}, caught "
                f"{len(r['caught'])} ({len(r['caught_apart'])} apart), passed "
                f"{len(r['passed'])}, no effect {len(r['no_effect'])}"
                for way, r in out[name].items()))
    return out


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
    ap.add_argument("--json", default=None,
                    help="where the outcome counts go (default bench/results/differential.json, "
                         "with --mutations differential_mutations.json)")
    ap.add_argument("--mutations", action="store_true",
                    help="also plant every known bug class over the seeds, from the start and at "
                         "the first recognised difference: per bug the seeds where it fired, "
                         "changed an answer, was caught or passed")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.first < 0:
        ap.error(f"--seeds must be >= 1 and --first >= 0, got {args.seeds} and {args.first}")
    import tempfile

    from kvtriton.sim.vllm_scheduler import tiny_model_dir

    t0 = time.perf_counter()
    seeds = range(args.first, args.first + args.seeds)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_model_dir(tmp, 8192)
        records = []
        for seed in seeds:
            records.append(run_seed(model_dir, seed))
            if (seed + 1 - args.first) % 250 == 0:
                print(f"  {seed + 1 - args.first} seeds, "
                      f"{sum(r.outcome == 'unrecognised' for r in records)} unrecognised",
                      flush=True)
        out = summarise(records)
        out["first_seed"] = args.first
        out["seeds_with_failed_stores"] = sum(r.failed_stores > 0 for r in records)
        print(f"{out['seeds']} seeds: {out['outcomes']}, differences "
              f"{out['differences_by_class']}, loads in {out['seeds_with_loads']} seeds, failed "
              f"stores in {out['seeds_with_failed_stores']}")
        for line in out["unrecognised"][:10]:
            print("  " + line)
        if args.mutations:
            out["mutations"] = mutation_table(
                model_dir, seeds, baseline=dict(zip(seeds, records, strict=True)),
                progress=lambda line: print(line, flush=True))
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(f"{out['elapsed_s']} s")
    name = "differential_mutations.json" if args.mutations else "differential.json"
    path = Path(args.json or f"bench/results/{name}")
    write_result(path.stem, out, path.parent)
    missed = [m for m, ways in out.get("mutations", {}).items()
              if not ways["planted"]["caught"] or any(r["passed"] for r in ways.values())]
    return 1 if out["outcomes"]["unrecognised"] or missed else 0


if __name__ == "__main__":
    sys.exit(main())
