"""kvtriton's scheduler side against vLLM's own ``SimpleCPUOffloadScheduler``, step for step.

One real vLLM ``Scheduler`` runs a random schedule (shared prefixes, repeated prompts, chunked
prefill, decode, preemption, aborts, the finish flush, transfer reports 0-2 steps late). Its
connector is ``TeeConnector``: every call goes to vLLM's manager, whose answers drive the
scheduler, and to kvtriton's ``SchedulerSide`` with the same policy (re-store off, head-first
freeing, LRU), whose answers are compared: lookup hits, stored GPU blocks, loaded blocks (and the
hashes their CPU blocks hold), every request's store cursor, and the CPU tier's contents after
every call that changes them.

Differences are recognised by construction, each by its own evidence, and counted:

- ``per_request_allocation`` (described in ``KVTritonConnector``'s docstring):
  vLLM allocates CPU blocks per request inside its scan, evicting cached blocks as it goes, so a
  later request of the same step sees some hashes as no longer cached; kvtriton classifies the
  whole step against the tier as it stands before allocating. It shows two ways: vLLM stores a
  block whose hash an earlier allocation of the step evicted (the hash was cached before the
  step and is not after it); or, once the budget is spent, vLLM's cursor stops at such a hash
  (a block it would now store) where kvtriton's passes it as cached. The gap is recognised only
  if vLLM's cursor stopped at a hash that was evicted during the step; vLLM storing, later, a
  block at a position inside a recognised gap is the same difference.
- ``in_flight_duplicate`` (kvtriton's deliberate improvement, also in the docstring): vLLM dedups
  stores by GPU block id, kvtriton by hash too; two GPU blocks with one hash (vLLM never merges
  them) are both copied by vLLM, into two CPU blocks, and once by kvtriton.

vLLM storing more can leave it without budget for a block kvtriton stores, so a block only
kvtriton stored is allowed on such a step if vLLM used its whole budget. The first stored-block
difference ends the comparison of a seed (the tiers then hold different blocks); anything not
recognised fails the test: among them, a cursor that moves where the budget was spent before the
scan reached it (vLLM's stays put), and a finish flush that ignores the table vLLM hands to
``request_finished_all_groups`` (a request aborted before a step carried its table, its CPU load
pending or allocated again after a preemption, must flush its GPU prefix hits as vLLM's manager
does).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

from kvtriton.sim.vllm_scheduler import (
    _default_token,
    make_scheduler,
    tiny_model_dir,
    vllm_request,
)
from kvtriton.specs import FullAttentionSpec
from kvtriton.vllm.config import parse_extra_config
from kvtriton.vllm.metadata import KVTritonWorkerMetadata
from kvtriton.vllm.scheduler_side import SchedulerSide

BS = 16
SEEDS = int(os.environ.get("KVTRITON_DIFF_SEEDS", "200"))


class Diverged(Exception):
    """kvtriton answered differently from vLLM's manager."""


@dataclass
class Record:
    steps_compared: int = 0
    known_at: int | None = None  # step of the recognised difference that ended the comparison
    known: set[str] = field(default_factory=set)  # its classes
    lagging_steps: int = 0  # compared steps with a vLLM cursor behind kvtriton's
    exhausted_steps: int = 0  # compared steps whose allocations evicted cached CPU blocks
    lookups: int = 0
    stores: int = 0
    loads: int = 0
    unknown: list[str] = field(default_factory=list)


@dataclass
class TeeMetadata(KVConnectorMetadata):
    ref: Any
    kvt: Any


@dataclass
class TeeWorkerMetadata(KVConnectorWorkerMetadata):
    ref: Any
    kvt: Any

    def aggregate(self, other):
        raise AssertionError("the differential test runs one worker: nothing to aggregate")


class TeeConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's manager (answers) and kvtriton's scheduler side (compared), fed the same calls."""

    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)
        cpu_bytes = self._kv_transfer_config.kv_connector_extra_config["cpu_bytes_per_rank"]
        sched_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.ref = SimpleCPUOffloadScheduler(vllm_config, kv_cache_config, cpu_bytes,
                                             scheduler_block_size=sched_block,
                                             hash_block_size=hash_block)
        self.kvt = SchedulerSide(vllm_config, kv_cache_config, parse_extra_config(
            {"cpu_bytes_per_rank": cpu_bytes, "restore": False, "cpu_free_order": "head_first"}))
        assert self.ref.num_cpu_blocks == self.kvt.num_cpu_blocks
        self.rec = Record()
        self.live = True  # kvtriton still in step with vLLM
        self.step = 0
        self.lag: dict[str, tuple[int, int]] = {}  # rid -> (vLLM cursor, kvtriton cursor)
        self.kvt_in_flight: dict[int, list[bytes]] = {}  # kvtriton store event -> its hashes

    # ---- what the two tiers hold ----------------------------------------------------------------

    def _ref_cached(self) -> set[bytes]:
        pool = self.ref.cpu_block_pool
        return {b.block_hash for b in pool.blocks if b.block_hash is not None} | {
            h for hs in pool.cached_block_hashes_by_block.values() for h in hs}

    def _kvt_cached(self) -> set[bytes]:
        pool, keys = self.kvt.cpu_pool, self.kvt.keys
        return {keys.hash_of(k) for b in range(1, pool.num_blocks) for k in pool.block_keys(b)}

    def _compare(self, what: str, a, b) -> None:
        if a != b:
            raise Diverged(f"step {self.step}: {what}: vLLM {a!r} != kvtriton {b!r}")

    def _check_cpu(self, when: str) -> None:
        ref, kvt = self._ref_cached(), self._kvt_cached()
        if ref != kvt:
            raise Diverged(f"step {self.step}: CPU contents after {when}: vLLM holds "
                           f"{len(ref - kvt)} blocks kvtriton lacks, kvtriton {len(kvt - ref)}")

    def _guard(self, fn, *args):
        """Run a kvtriton call while in step; a difference (or an error) ends the comparison."""
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

    # ---- the scheduler's calls ------------------------------------------------------------------

    def bind_gpu_block_pool(self, gpu_block_pool):
        self.ref.bind_gpu_block_pool(gpu_block_pool)
        self.kvt.bind_gpu_block_pool(gpu_block_pool)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        out = self.ref.get_num_new_matched_tokens(request, num_computed_tokens)

        def check():
            self.rec.lookups += 1
            got = self.kvt.get_num_new_matched_tokens(request, num_computed_tokens)
            self._compare(f"lookup {request.request_id}", tuple(out), tuple(got))

        self._guard(check)
        return out

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.ref.update_state_after_alloc(request, blocks, num_external_tokens)
        self._guard(self.kvt.update_state_after_alloc, request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        before = self._ref_cached() if self.live else set()
        # vLLM's scan budget: its free CPU blocks (a queued finish flush holds its own already).
        free = self.ref.cpu_block_pool.get_num_free_blocks()
        flushed = sum(len(t.gpu_block_ids) for t in self.ref._pending_finished_stores)
        ref = self.ref.build_connector_meta(scheduler_output)
        kvt = self._guard(self._build_kvt, scheduler_output, ref, before, free, flushed)
        self.step += 1
        return TeeMetadata(ref, kvt)

    def _cursors(self) -> tuple[dict[str, int], dict[str, int]]:
        """Each tracked request's store cursor, by vLLM and by kvtriton (0: no row)."""
        ref = {rid: st.num_stored_blocks[0] for rid, st in self.ref._reqs_to_store.items()
               if not st.finished}
        kvt = {}
        for rid in ref:
            try:
                kvt[rid] = self.kvt.planner.cursor(rid, 0)
            except ValueError:  # preempted: the row is gone until it resumes
                kvt[rid] = 0
        return ref, kvt

    def _build_kvt(self, so, ref, before, free, flushed):
        in_flight = {h for hs in self.kvt_in_flight.values() for h in hs}
        kvt = self.kvt.build_connector_meta(so)
        gpu = self.kvt.gpu_pool.vllm_pool.blocks
        after = self._ref_cached()
        evicted = before - after
        self.rec.exhausted_steps += bool(evicted)
        h_ref = [gpu[b].block_hash for b in ref.store_gpu_blocks]
        h_kvt = [gpu[b].block_hash for b in kvt.store.gpu_blocks]
        used_budget = len(h_ref) - flushed >= free
        if h_ref != h_kvt:
            extra, missing = Counter(h_ref) - Counter(h_kvt), Counter(h_kvt) - Counter(h_ref)
            if not extra and not missing:
                # The same blocks in another order: vLLM reached one first through a request
                # whose cursor lags (kvtriton stores it through a later request).
                i = next(i for i, (a, b) in enumerate(zip(h_ref, h_kvt, strict=True)) if a != b)
                if not self._at_lagged_position(ref.store_gpu_blocks[i]):
                    raise Diverged(f"step {self.step}: the same blocks stored in another order")
                self.rec.known_at, self.rec.known = self.step, {"per_request_allocation"}
                self.live = False
                return kvt
            where = {gpu[b].block_hash: b for b in ref.store_gpu_blocks}
            classes = set()
            for h in extra:
                if h in evicted:
                    classes.add("per_request_allocation")
                elif h in in_flight or h in h_kvt:
                    classes.add("in_flight_duplicate")
                elif self._at_lagged_position(where[h]):
                    classes.add("per_request_allocation")
                else:
                    raise Diverged(f"step {self.step}: vLLM stored GPU block {where[h]}, "
                                   "kvtriton did not, and no recognised cause explains it")
            if missing and (not used_budget or not extra):
                # Only vLLM's own extra stores can have spent the budget these needed.
                raise Diverged(f"step {self.step}: kvtriton stored {sum(missing.values())} "
                               f"blocks vLLM did not; vLLM stored {len(extra)} extra and used "
                               f"{len(h_ref) - flushed} of {free} free blocks")
            self.rec.known_at = self.step
            self.rec.known = classes
            self.live = False
            return kvt
        if kvt.store.event >= 0:
            self.kvt_in_flight[kvt.store.event] = h_kvt
        self.rec.stores += len(kvt.store)
        self._compare("load GPU blocks", ref.load_gpu_blocks, kvt.load.gpu_blocks)
        ref_cpu = self.ref.cpu_block_pool.blocks
        self._compare("loaded hashes", [ref_cpu[b].block_hash for b in ref.load_cpu_blocks],
                      [self.kvt.keys.hash_of(self.kvt.cpu_pool.block_hash(b))
                       for b in kvt.load.cpu_blocks])
        self._compare("load requests", sorted(ref.load_event_to_reqs.get(ref.load_event, [])),
                      sorted(kvt.load_event_to_reqs.get(kvt.load.event, [])))
        self.rec.loads += len(kvt.load)
        self._check_cpu("build_connector_meta")
        self._check_cursors(evicted)
        self.rec.steps_compared += 1
        return kvt

    def _check_cursors(self, evicted: set[bytes]) -> None:
        ref, kvt = self._cursors()
        lag = {}
        for rid, c in ref.items():
            if c == kvt[rid]:
                continue
            old = self.lag.get(rid)
            # An old gap may only close; a new one needs vLLM behind, stopped at a hash that
            # this step's allocations evicted (per-request allocation).
            ok = c < kvt[rid] and ((old is not None and old[0] <= c)
                                   or self._stopped_at_evicted(rid, c, evicted))
            if not ok:
                raise Diverged(f"step {self.step}: {rid}'s cursor: vLLM {c}, kvtriton "
                               f"{kvt[rid]}")
            lag[rid] = (c, kvt[rid])
        self.lag = lag
        self.rec.lagging_steps += bool(lag)

    def _stopped_at_evicted(self, rid: str, cursor: int, evicted: set[bytes]) -> bool:
        st = self.ref._reqs_to_store.get(rid)
        if st is None or cursor >= len(st.block_ids[0]):
            return False
        blocks = self.ref._gpu_block_pool.blocks
        return blocks[st.block_ids[0][cursor]].block_hash in evicted

    def _at_lagged_position(self, gpu_block: int) -> bool:
        """Whether ``gpu_block`` sits, in a lagging request's table, between vLLM's cursor and
        kvtriton's: a position kvtriton passed while vLLM's budget was out."""
        for rid, (lo, hi) in self.lag.items():
            st = self.ref._reqs_to_store.get(rid)
            if st is not None and gpu_block in st.block_ids[0][lo:hi]:
                return True
        return False

    def update_connector_output(self, connector_output):
        wm = connector_output.kv_connector_worker_meta
        ref_out = KVConnectorOutput(finished_recving=connector_output.finished_recving,
                                    kv_connector_worker_meta=wm.ref if wm else None)
        self.ref.update_connector_output(ref_out)
        kvt_out = KVConnectorOutput(finished_recving=connector_output.finished_recving,
                                    kv_connector_worker_meta=wm.kvt if wm else None)

        def apply():
            self.kvt.update_connector_output(kvt_out)
            if wm is not None:
                for ev in wm.kvt.completed_store_events:
                    self.kvt_in_flight.pop(ev, None)
            self._check_cpu("update_connector_output")

        self._guard(apply)

    def request_finished(self, request, block_ids):
        raise AssertionError("the scheduler calls request_finished_all_groups (SupportsHMA)")

    def request_finished_all_groups(self, request, block_ids):
        rid = request.request_id
        out = self.ref.request_finished_all_groups(request, block_ids)

        def finish():
            self.kvt.request_finished(request, block_ids)
            self._check_cpu(f"request_finished({rid})")

        self._guard(finish)
        return out

    def has_pending_push_work(self):
        return self.ref.has_pending_stores()

    # The worker role does not exist in this test: no model runs.
    def start_load_kv(self, forward_context, **kwargs):
        raise AssertionError

    def wait_for_layer_load(self, layer_name):
        raise AssertionError

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        raise AssertionError

    def wait_for_save(self):
        raise AssertionError


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


def run_seed(model_dir, seed: int) -> Record:
    rng = np.random.default_rng(seed)
    s = make_scheduler(model_dir, [FullAttentionSpec(BS, 1, 8, 1)],
                       num_gpu_blocks=int(rng.integers(20, 65)),
                       cpu_blocks=int(rng.choice([6, 12, 24, 48, 160])),
                       max_num_batched_tokens=int(rng.choice([64, 128, 256])), max_num_seqs=8,
                       kv_connector="TeeConnector",
                       kv_connector_module_path=__name__)  # vLLM imports TeeConnector from here
    tee: TeeConnector = s.connector
    pending = _prompts(rng, int(rng.integers(10, 26)))
    stores: list[tuple[int, int, int]] = []  # (due step, vLLM event, kvtriton event)
    loads: list[tuple[int, list[str]]] = []
    for step in range(800):
        while pending and rng.random() < 0.15:
            p, mx = pending.pop()
            s.add_request(vllm_request(f"s{seed}r{len(pending)}", p, mx, BS))
        if rng.random() < 0.03 and s.requests:
            victim = sorted(s.requests)[int(rng.integers(len(s.requests)))]
            s.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        so = s.schedule()
        meta: TeeMetadata = so.kv_connector_metadata
        delay = int(rng.integers(0, 3))
        if meta.ref.store_event >= 0:
            kvt_ev = meta.kvt.store.event if meta.kvt is not None else -1
            stores.append((step + delay, meta.ref.store_event, kvt_ev))
        if meta.ref.load_event >= 0:
            loads.append((step + delay, meta.ref.load_event_to_reqs[meta.ref.load_event]))
        done_stores = [(r, k) for d, r, k in stores if d <= step]
        stores = [x for x in stores if x[0] > step]
        done_loads = {r for d, rs in loads if d <= step for r in rs}
        loads = [x for x in loads if x[0] > step]
        ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            sampled.append([] if req.num_computed_tokens < req.num_tokens
                           else [_default_token(rid, req.num_tokens)])
        wm = TeeWorkerMetadata(
            SimpleCPUOffloadWorkerMetadata({r: 1 for r, _ in done_stores}),
            KVTritonWorkerMetadata({k: 1 for _, k in done_stores if k >= 0}),
        ) if done_stores else None
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=sampled,
                                kv_connector_output=KVConnectorOutput(
                                    finished_recving=done_loads or None,
                                    kv_connector_worker_meta=wm))
        s.update_from_output(so, out)
        if not pending and not s.has_requests() and not stores and not loads:
            break
    else:
        raise AssertionError(f"seed {seed}: the schedule did not drain")
    if tee.live:
        tee.kvt.planner.check_invariants(idle=True)
    return tee.rec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"), 8192)


def test_same_blocks_as_vllms_manager_on_random_schedules(model_dir):
    records = [run_seed(model_dir, seed) for seed in range(SEEDS)]
    unknown = [(i, u) for i, r in enumerate(records) for u in r.unknown]
    known = [r for r in records if r.known_at is not None]
    by_class = Counter(c for r in known for c in r.known)
    total = Record()
    for r in records:
        for name in ("steps_compared", "lagging_steps", "exhausted_steps", "lookups", "stores",
                     "loads"):
            setattr(total, name, getattr(total, name) + getattr(r, name))
    print(f"\n{SEEDS} seeds: {SEEDS - len(known) - len(unknown)} identical to the end, "
          f"{len(known)} ended at a recognised difference {dict(by_class)}, {len(unknown)} "
          f"other differences; {total.steps_compared} steps compared "
          f"({total.exhausted_steps} with CPU evictions during allocation, "
          f"{total.lagging_steps} with a vLLM cursor lagging), {total.lookups} lookups, "
          f"{total.stores} stores, {total.loads} loads")
    assert not unknown, "\n".join(f"seed {i}: {u}" for i, u in unknown[:10])
    # The schedules must exercise what they are meant to: CPU loads, exhausted steps.
    assert total.loads > 0 and total.exhausted_steps > 0
    assert len(known) < SEEDS // 2
