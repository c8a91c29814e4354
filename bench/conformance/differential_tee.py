"""The differential's connector (``bench.conformance.differential``): ``TeeConnector`` feeds every
scheduler call to vLLM's ``SimpleCPUOffloadScheduler``, whose answers drive the scheduler, and to
kvtriton's ``SchedulerSide``, whose answers are compared with them while the two are in step
(``InStepComparison``) and held to the models of ``bench.conformance.differential_models`` always
(``OwnRules``). vLLM loads it by ``kv_connector_module_path``; this module needs vLLM, the
differential's driver does not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

from bench.conformance.differential_checks import (
    BS,
    GROUP0,
    Diverged,
    InStepComparison,
    OwnRules,
    Record,
)
from bench.conformance.differential_models import HashOrigins, RuleBroken, TierModel
from bench.conformance.differential_mutations import fired
from kvtriton.vllm.config import parse_extra_config
from kvtriton.vllm.scheduler_side import SchedulerSide

__all__ = ["TeeConnector", "TeeMetadata", "TeeWorkerMetadata"]


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

class TeeConnector(OwnRules, InStepComparison, KVConnectorBase_V1, SupportsHMA):
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
            {"cpu_bytes_per_rank": cpu_bytes, "setup": "eager"}))
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
        return [h + GROUP0 for h in request.block_hashes]

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
