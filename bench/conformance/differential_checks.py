"""What the differential (``bench.conformance.differential``) checks of kvtriton's scheduler side,
as mixins of its connector (``bench.conformance.differential_tee.TeeConnector``, whose state they
read):

- ``OwnRules``: kvtriton against the models kept from the connector's boundary
  (``bench.conformance.differential_models``), every step, in step or apart: its tier, its lookups,
  its stores, cursors and loads, its finish flushes and its books.
- ``InStepComparison``: kvtriton against vLLM's manager while the two are in step, each
  difference recognised only with its evidence, and whether the two are back in step.

``Record`` is one seed's outcome; ``Diverged`` an unrecognised difference.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from bench.conformance.differential_models import expected_flush

__all__ = ["BS", "GROUP0", "Diverged", "InStepComparison", "OwnRules", "Record"]

BS = 16
GROUP0 = (0).to_bytes(4, "big")  # vLLM's group id suffix of the one group here


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
    # Under a planted bug (bench.conformance.differential_mutations): whether it changed what
    # kvtriton did in a call made while the pair was in step, and in one made while apart.
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


class OwnRules:
    """kvtriton against its own tier's rules (always)."""

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

    def _own_hit(self, request, num_computed_tokens) -> int:
        """The hit the rules give on kvtriton's own tier (``TierModel``): the run of cached
        blocks from the computed prefix, at most up to the block before the last token."""
        start = num_computed_tokens // BS
        stop = min(len(request.block_hashes), (request.num_tokens - 1) // BS)
        return self.tier.cached_run(self._position_hashes(request)[start:max(start, stop)]) \
            * BS

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


class InStepComparison:
    """kvtriton against vLLM's manager (in step)."""

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
