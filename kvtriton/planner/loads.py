"""The load lifecycle: a CPU hit found at lookup, accepted at allocation, issued, reported.

1. ``lookup``: the longest CPU hit past the local prefix; its CPU blocks stay pinned (a *pending
   hit*) until the scheduler allocates the request.
2. ``plan`` then ``commit``: the accepted part of the hit becomes a load into the request's GPU
   blocks; the pins of the rest are released. ``plan`` checks the allocation and changes
   nothing, so a bad one leaves every pin where it was.
3. ``issue``: every accepted load not yet issued goes into the step's one load transfer, under a
   new load event.
4. ``finish``: a worker's report (success or failure) releases the load's pins.

``reset`` releases what was never issued; loads already issued are kept, now *abandoned*, until
their reports arrive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from kvtriton.lookup import Hit, find_longest_hit
from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.stats import PlannerStats
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.pool_interface import GpuPool
from kvtriton.records import Request, Transfer
from kvtriton.specs import KVLayout
from kvtriton.validation import block_id_array

__all__ = ["Loads"]

# The planner's logger: its records carry one name whichever lifecycle emits them.
logger = logging.getLogger("kvtriton.planner.planner")


@dataclass(slots=True)
class _PendingHit:
    """A CPU hit between lookup and allocation: its pinned CPU blocks by group (NULL_BLOCK where
    a group needs none), its length and the local prefix it starts after."""

    blocks: tuple[list[int], ...]
    num_tokens: int
    num_computed_tokens: int


@dataclass(slots=True)
class _Load:
    """Pairs of one request's load: CPU block ``cpu[i]`` -> GPU block ``gpu[i]`` of a group;
    ``event`` is None until ``issue``."""

    gpu: list[int]
    cpu: list[int]
    groups: list[int]
    event: int | None = None


def _hit_blocks(blocks: tuple[list[int], ...]) -> list[int]:
    """The CPU blocks a hit pins: every group's, the null block left out."""
    return [b for grp in blocks for b in grp if b != NULL_BLOCK]


class Loads:
    """Pending hits, loads, abandoned loads and load events of one planner."""

    def __init__(self, layout: KVLayout, config: PlannerConfig, gpu_pool: GpuPool,
                 cpu_pool: BlockPool, stats: PlannerStats) -> None:
        self._layout = layout
        self._fine_grained = config.fine_grained
        self._gpu_pool = gpu_pool
        self._cpu_pool = cpu_pool
        self._stats = stats
        self._ratio = [g.block_size // layout.hash_block_size for g in layout.groups]
        self._all_full = all(g.kind == "full" for g in layout.groups)
        self._pending_hits: dict[str, _PendingHit] = {}
        # Requests whose load failed: they recompute, and are not offered a CPU hit again until
        # they finish (a copy that keeps failing would otherwise load, fail and retry forever).
        self._failed: set[str] = set()
        # Refresh on GPU hits: requests whose GPU-hit prefix already refreshed the CPU copies.
        self._refresh = config.refresh_on_gpu_hit
        self._refreshed: set[str] = set()
        self._loads: dict[str, _Load] = {}
        # Loads abandoned by reset() but still in flight, oldest first per request.
        self._abandoned: dict[str, list[_Load]] = {}
        self._event_reqs: dict[int, list[str]] = {}
        self._next_event = 0

    def _unpin_hit(self, hit: _PendingHit) -> None:
        blocks = _hit_blocks(hit.blocks)
        if blocks:
            self._cpu_pool.free_blocks(blocks)

    def _repin(self, rid: str, stale: _PendingHit | None, blocks: list[int]) -> None:
        """Pin ``blocks``, the new hit of ``rid``, in place of its ``stale`` one: only the
        difference moves. A waiting request is looked up again every step with much the same
        hit; releasing all of it and pinning it again would pass each block through the free
        queue, where a full protected segment (``HintedQueue``) demotes another block for every
        protected one that comes back, and the pushes and removals would be most of a
        waiting-heavy run's time."""
        old = [] if stale is None else _hit_blocks(stale.blocks)
        if old and blocks:
            old_set, new_set = set(old), set(blocks)
            kept = old_set & new_set
            # Sets cannot tell multiplicities apart: a hit naming a block twice moves whole.
            if kept and len(old_set) == len(old) and len(new_set) == len(blocks):
                old = [b for b in old if b not in kept]
                blocks = [b for b in blocks if b not in kept]
        if old:
            self._cpu_pool.free_blocks(old)
        if blocks:
            self._cpu_pool.touch(blocks, user=rid)

    def _release(self, ld: _Load) -> None:
        self._cpu_pool.free_blocks(ld.cpu)
        self._gpu_pool.free_blocks(ld.gpu)

    # ---- lookup and acceptance ------------------------------------------------------------

    def lookup(self, req: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """The CPU hit of ``req`` past ``num_computed_tokens``, pinned until ``commit``.

        ``ValueError``, changing nothing, while a load of ``req`` is accepted and not yet
        reported: a request waiting for its load is not looked up again (vLLM keeps it in
        ``WAITING_FOR_REMOTE_KVS``), and a second hit could not become a second load."""
        rid = req.request_id
        if (ld := self._loads.get(rid)) is not None:
            raise ValueError(f"request {rid!r} waits for its CPU load ({self._describe(ld)}); "
                             "look it up again once that load is reported")
        stale = self._pending_hits.pop(rid, None)
        self._stats.lookups += 1
        if self._refresh and rid not in self._refreshed and num_computed_tokens:
            # The refresh takes and frees back the free CPU copies of the GPU hit: the stale
            # hit's blocks must be free again for it to see them, as on a first lookup.
            if stale is not None:
                self._unpin_hit(stale)
                stale = None
            self._refresh_gpu_hit(req, num_computed_tokens)
        try:
            hit = self._find_hit(req, num_computed_tokens)
        except BaseException:
            if stale is not None:  # as before the lookup: no pin of a hit no longer pending
                self._unpin_hit(stale)
            raise
        self._repin(rid, stale, [] if hit is None else _hit_blocks(hit.blocks))
        if hit is None:
            return 0, False
        self._pending_hits[rid] = _PendingHit(hit.blocks, hit.num_tokens, num_computed_tokens)
        return hit.num_tokens, True

    def _find_hit(self, req: Request, num_computed_tokens: int) -> Hit | None:
        """``req``'s longest CPU hit past ``num_computed_tokens`` (a ``find_longest_hit``
        result), or None where it has none; pins nothing."""
        if req.request_id in self._failed:
            return None
        layout = self._layout
        if num_computed_tokens % layout.scheduler_block_size:
            # A load fills whole blocks, so it cannot start inside a local block.
            self._stats.lookups_unaligned += 1
            return None
        hbs = layout.hash_block_size
        skip = num_computed_tokens // hbs
        cap = req.num_tokens - 1 - num_computed_tokens
        n_keys = min(req.keys.shape[1], req.num_tokens // hbs)
        if cap <= 0 or skip >= n_keys:
            return None
        keys = req.keys[:, skip:n_keys].tolist()
        hit = find_longest_hit(layout, self._cpu_pool, keys, cap,
                               fine_grained=self._fine_grained)
        self._count_holes(keys, hit.num_tokens // hbs)
        return hit if hit.num_tokens else None

    def _refresh_gpu_hit(self, req: Request, num_computed_tokens: int) -> None:
        """The CPU copies of ``req``'s GPU-hit prefix are used again: take each free one and
        free it back (tail first, so the chain head stays longest), once per request. Without
        it an eager tier's recency is its store time: a prefix hot in the GPU ages out of the
        CPU though every request uses it, and is gone when the GPU evicts it."""
        rid = req.request_id
        self._refreshed.add(rid)
        pool = self._cpu_pool
        n = min(num_computed_tokens // self._layout.hash_block_size, req.keys.shape[1])
        blocks = []
        for keys in req.keys[:, :n].tolist():
            for k in keys:
                b = pool.get_cached_block(k)
                if b is not None and pool.is_free(b):
                    blocks.append(b)
        if blocks:
            blocks = list(dict.fromkeys(blocks))
            pool.touch(blocks, user=rid)
            pool.free_blocks(blocks[::-1])
            self._stats.gpu_hit_refreshed += len(blocks)

    def _count_holes(self, keys: list[list[int]], hit_hash_blocks: int) -> None:
        """Blocks of the first full-attention group present in the CPU past the first miss."""
        cpu_pool = self._cpu_pool
        for g, spec in enumerate(self._layout.groups):
            if spec.kind != "full":
                continue
            r = self._ratio[g]
            primaries = keys[g][r - 1::r]
            first_miss = hit_hash_blocks // r
            if first_miss < len(primaries) and primaries[first_miss] not in cpu_pool:
                holes = cpu_pool.count_present(primaries[first_miss + 1:])
                self._stats.chain_holes += holes
                self._stats.lookups_with_holes += holes > 0
            return

    def plan(self, req: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
             ) -> _Load | None:
        """Check an allocation of ``req`` and turn ``num_external_tokens`` of its pending hit into
        the load ``commit`` applies (None: no load). Changes nothing.

        ``ValueError`` for a GPU table that is not one list of block ids in the GPU pool per group,
        a load that needs a block the table does not hold (too short, the null block, a block
        named twice or one not allocated), a token count that is not a hash-block multiple within
        the hit, a second load while one of ``req`` is not yet reported, no pending hit, or a
        shorter hit accepted that the CPU cannot supply.
        """
        rid = req.request_id
        layout = self._layout
        G = layout.num_groups
        if not isinstance(block_ids, tuple | list) or len(block_ids) != G:
            got = (f"{len(block_ids)} tables" if isinstance(block_ids, tuple | list)
                   else repr(block_ids))
            raise ValueError(f"request {rid!r}: block_ids must hold one GPU table per group "
                             f"({G}), got {got}")
        n_gpu = self._gpu_pool.num_blocks
        tables = [block_id_array(t, n_gpu, f"request {rid!r}: group {g} GPU table")
                  for g, t in enumerate(block_ids)]
        if num_external_tokens == 0:
            return None
        if (ld := self._loads.get(rid)) is not None:
            raise ValueError(f"request {rid!r}: num_external_tokens={num_external_tokens}, but "
                             f"its CPU load ({self._describe(ld)}) is not reported yet; a "
                             "request takes one load at a time")
        pending = self._pending_hits.get(rid)
        if pending is None:
            raise ValueError(f"request {rid!r}: {num_external_tokens} external tokens "
                                "accepted but no CPU hit is pending for it")
        hit_blocks, hit_tokens, num_computed = (pending.blocks, pending.num_tokens,
                                                pending.num_computed_tokens)
        if num_external_tokens > hit_tokens or num_external_tokens % layout.hash_block_size:
            raise ValueError(f"request {rid!r}: num_external_tokens={num_external_tokens} is not "
                             f"a hash-block multiple <= the hit of {hit_tokens}")
        if num_external_tokens < hit_tokens and not self._all_full:
            # A shorter hit needs other blocks: the window before its end, the state at its end.
            hbs = layout.hash_block_size
            skip = num_computed // hbs
            keys = req.keys[:, skip:skip + num_external_tokens // hbs].tolist()
            short = find_longest_hit(layout, self._cpu_pool, keys, num_external_tokens)
            if short.num_tokens != num_external_tokens:
                raise ValueError(f"request {rid!r}: the CPU tier cannot supply exactly "
                                    f"{num_external_tokens} of its {hit_tokens}-token hit (a "
                                    "sliding-window or Mamba group has no blocks ending there)")
            hit_blocks = short.blocks
        gpu, cpu, groups = [], [], []
        for g, spec in enumerate(layout.groups):
            take = -(-num_external_tokens // spec.block_size)
            start = num_computed // spec.block_size
            table = tables[g]
            if start + take > len(table):
                raise ValueError(f"request {rid!r}: group {g} table has {len(table)} blocks, "
                                 f"the load needs {start + take}")
            src = np.asarray(hit_blocks[g][:take], dtype=np.int64)
            needed = np.flatnonzero(src != NULL_BLOCK)
            dst = table[start + needed]
            if (null := dst == NULL_BLOCK).any():
                pos = start + int(needed[np.argmax(null)])
                raise ValueError(f"request {rid!r}: group {g} table holds block id 0 (the null "
                                 f"block) at position {pos}, where the load needs a GPU block")
            gpu.append(dst)
            cpu.append(src[needed])
            groups.append(np.full(len(needed), g, dtype=np.int64))
        dst = np.concatenate(gpu)
        if len(np.unique(dst)) != len(dst):
            twice = dst[self._first_dup(dst)].item()
            raise ValueError(f"request {rid!r}: GPU block {twice} is named twice where the load "
                             "writes")
        load = _Load(dst.tolist(), np.concatenate(cpu).tolist(), np.concatenate(groups).tolist())
        ref = self._gpu_pool.ref_cnt
        if (free := next((b for b in load.gpu if not ref[b]), None)) is not None:
            raise ValueError(f"request {rid!r}: GPU block {free} is free; a load writes only "
                             "blocks allocated to the request")
        return load

    @staticmethod
    def _first_dup(a: np.ndarray) -> int:
        _, first, counts = np.unique(a, return_index=True, return_counts=True)
        return int(first[np.argmax(counts > 1)])

    def commit(self, rid: str, load: _Load | None, num_external_tokens: int) -> None:
        """Apply what ``plan`` returned: the pending hit's pins pass to the load (the rest are
        released)."""
        pending = self._pending_hits.pop(rid, None)
        if load is None:
            if pending is not None:
                self._unpin_hit(pending)
            return
        self._cpu_pool.touch(load.cpu, user=rid)
        self._unpin_hit(pending)
        self._gpu_pool.touch(load.gpu)
        self._loads[rid] = load
        self._stats.cpu_hit_tokens += num_external_tokens

    @staticmethod
    def _describe(ld: _Load) -> str:
        when = "queued" if ld.event is None else f"in load event {ld.event}"
        return f"{len(ld.gpu)} blocks, {when}"

    # ---- per step ---------------------------------------------------------------------------

    def issue(self) -> Transfer:
        """The step's load transfer: every accepted load not yet issued, under one new event."""
        load_rids = [rid for rid, ld in self._loads.items() if ld.event is None]
        if not load_rids:
            return Transfer()
        ev = self._next_event
        self._next_event += 1
        load = Transfer(ev)
        for rid in load_rids:
            ld = self._loads[rid]
            ld.event = ev
            load.gpu_blocks += ld.gpu
            load.cpu_blocks += ld.cpu
            load.groups += ld.groups
        self._event_reqs[ev] = load_rids
        self._stats.loads_issued += 1
        return load

    def event_to_reqs(self) -> dict[int, list[str]]:
        """Every load event in flight -> the requests whose loads it still carries (copies)."""
        return {e: list(r) for e, r in self._event_reqs.items()}

    # ---- reports, finish, reset ---------------------------------------------------------------

    def finish(self, rid: str, failed: bool, running: bool = True) -> None:
        """A worker reported the load of ``rid`` done (or failed): release its pins.
        ``running``: ``rid`` has not finished (a failed load then bars its CPU hits)."""
        # A report names a request, not an event. Workers finish a request's loads in the order
        # they were issued, and a load abandoned by reset() is older than any issued after it
        # (the same request may be looked up again while it is in flight), so it goes first.
        abandoned = self._abandoned.get(rid)
        if abandoned:
            ld = abandoned.pop(0)
            if not abandoned:
                del self._abandoned[rid]
        else:
            ld = self._loads.get(rid)
            if ld is None or ld.event is None:
                self._stats.stale_reports += 1
                logger.info("ignoring a load report for request %r with no load in flight", rid)
                return
            del self._loads[rid]
        reqs = self._event_reqs[ld.event]
        reqs.remove(rid)
        if not reqs:
            del self._event_reqs[ld.event]
        self._release(ld)
        if failed:
            self._stats.failed_transfers += 1
            if running:  # a finished request's entry would never be cleared
                self._failed.add(rid)
            logger.warning("load of request %r failed on a worker: %d blocks released, the "
                           "scheduler recomputes them (no CPU hit for it again)", rid,
                           len(ld.gpu))
        else:
            self._stats.blocks_loaded += len(ld.gpu)

    def drop(self, rid: str) -> None:
        """``rid`` finished: release its pending hit and its load if not yet issued (an issued
        load completes normally)."""
        if (pending := self._pending_hits.pop(rid, None)) is not None:
            self._unpin_hit(pending)
        self._failed.discard(rid)
        self._refreshed.discard(rid)
        ld = self._loads.get(rid)
        if ld is not None and ld.event is None:
            del self._loads[rid]
            self._release(ld)

    def reset(self) -> None:
        """Release what was never issued; issued loads become abandoned until reported."""
        for rid, ld in list(self._loads.items()):
            if ld.event is None:
                self._release(ld)
            else:
                self._abandoned.setdefault(rid, []).append(ld)
        self._loads.clear()
        for pending in self._pending_hits.values():
            self._unpin_hit(pending)
        self._pending_hits.clear()
        self._failed.clear()
        self._refreshed.clear()

    # ---- introspection ----------------------------------------------------------------------

    def pending(self, rid: str) -> bool:
        """Whether ``rid`` has a load accepted and not yet reported (issued or not)."""
        return rid in self._loads

    def has_abandoned(self) -> bool:
        return bool(self._abandoned)

    def has_pending_work(self) -> bool:
        return bool(self._loads or self._abandoned)

    def pending_hits(self) -> list[str]:
        """Request ids whose CPU hit is pinned, waiting for ``commit``."""
        return list(self._pending_hits)

    def in_flight(self) -> list[str]:
        """Request ids of the loads issued and not yet reported, once per load, abandoned ones
        included."""
        out = [rid for rid, ld in self._loads.items() if ld.event is not None]
        return out + [rid for rid, lds in self._abandoned.items() for _ in lds]

    def queued(self) -> dict[str, Transfer]:
        """Loads accepted but not yet issued, by request (event -1)."""
        return {rid: Transfer(-1, list(ld.gpu), list(ld.cpu), list(ld.groups))
                for rid, ld in self._loads.items() if ld.event is None}

    def check_invariants(self, *, idle: bool = False) -> None:
        """Raise ``AssertionError`` if the load books disagree with each other; with ``idle``,
        also if they hold anything."""
        issued = [(rid, ld) for rid, ld in self._loads.items() if ld.event is not None]
        issued += [(rid, ld) for rid, lds in self._abandoned.items() for ld in lds]
        carried: dict[int, list[str]] = {}
        for rid, ld in issued:
            assert 0 <= ld.event < self._next_event, f"load of {rid!r}: event {ld.event}"
            carried.setdefault(ld.event, []).append(rid)
        assert {e: sorted(r) for e, r in carried.items()} == {
            e: sorted(r) for e, r in self._event_reqs.items()}, (
            f"load events {self._event_reqs} != the loads in flight {carried}")
        for rid, lds in self._abandoned.items():
            assert lds, f"request {rid!r}: an empty list of abandoned loads"
        for rid, ld in self._loads.items():
            assert len(ld.gpu) == len(ld.cpu) == len(ld.groups), f"load of {rid!r}: pairs"
        if idle:
            for name in ("_pending_hits", "_loads", "_abandoned", "_event_reqs", "_failed"):
                assert not getattr(self, name), f"loads: {name} not empty: {getattr(self, name)}"
