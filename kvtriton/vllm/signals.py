"""What a server knows of the CPU tier's future, applied to its eviction: continuation hints and
the waiting-queue lookahead (the ``hints`` and ``waiting`` axes of ``kvtriton.setups``).

Hints. A request's ``kv_transfer_params`` (vLLM's per-request connector data: the offline API's
``SamplingParams(extra_args={"kv_transfer_params": {...}})``, the OpenAI server's request body)
may carry ``"kvtriton_hint": "continue" | "close"``. When the request finishes, ``continue``
protects its blocks in the CPU tier (``HintedQueue``: up to a share of the tier, the oldest hint
let go first), ``close`` makes the blocks it held last the first to go, and no hint returns its
blocks to the plain eviction order: as ``kvtriton.sim.loop.ServingLoop`` applies a workload's
hints. "Held last" is counted per key from admissions: a block a later request was admitted
with belongs to that request's future, not to the closed one. That scopes a close without a
session id, so the connector takes none. Hinted admission (``lazy+hinted``) gets the hint from
here too. A hint that is not one of the two is a warning naming the request, counted in
``malformed_hints``; the request is served as if it had none. A hint sent to a setup that uses
none (neither ``hints`` nor ``hinted`` admission) changes nothing: it is counted in
``hints_ignored``, not as applied, with one warning per connector. Client values in a warning are
cut to ``LOGGED_CHARS`` characters (``shorten``): a log line's length must not be the client's.

Lookahead. vLLM calls ``on_new_request`` when a request joins the waiting queue,
``update_state_after_alloc`` when it leaves it admitted and ``request_finished`` when it leaves
it aborted: the connector sees the queue's membership without a scheduler of its own. The keys
of a waiting request's prompt blocks are protected while some waiting request holds them, the
newest arrival let go first when the protected share is full; as in the simulator, a request
counts once, from its arrival to its first admission (a preempted request is not counted again).

Key ids are recycled (``kvtriton.vllm.keys``): the keys held here are reported by
``referenced_keys`` and recycled ones return to the plain order (``forget``).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from kvtriton.eviction import CLOSED, NORMAL, PROTECTED, HintedQueue, make_eviction_queue
from kvtriton.pool import BlockPool
from kvtriton.setups import TierPolicy
from kvtriton.vllm.keys import KeyIds
from kvtriton.vllm.requests import lookup_request

__all__ = ["HINTS", "HINT_KEY", "LOGGED_CHARS", "TierSignals", "request_hint", "shorten"]

logger = logging.getLogger(__name__)

#: The ``kv_transfer_params`` key of a request's continuation hint, and its values.
HINT_KEY = "kvtriton_hint"
HINTS = ("continue", "close")

#: How much of one client-supplied value a log line shows.
LOGGED_CHARS = 200


def shorten(text: str, limit: int = LOGGED_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was: what a log line shows of a
    value a client chose (a request id, a hint), so that one request cannot write a megabyte of
    log per request."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters, cut at {limit})"


def request_hint(vreq: Any) -> tuple[str | None, bool]:
    """``vreq``'s continuation hint (None: none) and whether a malformed one was dropped."""
    params = getattr(vreq, "kv_transfer_params", None)
    if not isinstance(params, dict) or params.get(HINT_KEY) is None:
        return None, False
    hint = params[HINT_KEY]
    if isinstance(hint, str) and hint in HINTS:
        return hint, False
    logger.warning("KVTritonConnector: request %s: kv_transfer_params[%r] = %s is not one of "
                   "%s; served without a hint", shorten(str(vreq.request_id)), HINT_KEY,
                   shorten(repr(hint)), ", ".join(map(repr, HINTS)))
    return None, True


def _grown(arr: np.ndarray, n: int, fill: int) -> np.ndarray:
    if n <= len(arr):
        return arr
    out = np.full(max(n, 2 * len(arr)), fill, dtype=arr.dtype)
    out[:len(arr)] = arr
    return out


def _distinct_by_depth(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys of a (groups, positions) array and each one's first position."""
    by_position = keys.T.ravel()  # position-major: a key's first occurrence is its shallowest
    uniq, first = np.unique(by_position, return_index=True)
    return uniq, (first // max(1, keys.shape[0])).astype(np.int32)


class TierSignals:
    """The hints and lookahead of one connector's CPU tier. ``policy``: the setup; with neither
    axis on, only the hints' counts are kept (hinted admission still reads the hint)."""

    def __init__(self, policy: TierPolicy, keys: KeyIds, suffixes: list[bytes]) -> None:
        self.hints_on = policy.hints
        self.lookahead_on = policy.lookahead
        #: Whether the setup does anything with a hint: the hints axis or hinted admission.
        self.uses_hints = self.hints_on or (policy.planner is not None
                                            and policy.planner.admission == "hinted")
        self._setup = policy.composition or policy.name
        self._warned_ignored = False
        self._keys = keys
        self._suffixes = suffixes
        self._queue: HintedQueue | None = None
        base = make_eviction_queue(policy.cpu_eviction)
        if self.hints_on:
            self._queue = HintedQueue(base, policy.hint_protect_share)
        elif self.lookahead_on:
            # The newest arrival is admitted last: its blocks are the first to let go.
            self._queue = HintedQueue(base, policy.waiting_protect_share, demote="newest")
        self._base = base
        self.pool: BlockPool | None = None
        self._holder = np.full(0, -1, dtype=np.int64)  # key -> serial of its last admitted holder
        self._serial: dict[str, int] = {}  # rid -> its serial, from admission to finish
        self._next_serial = 0
        self._waiting: dict[str, np.ndarray] = {}  # rid -> its distinct keys while it waits
        self._depths: dict[str, np.ndarray] = {}
        self._count = np.zeros(0, dtype=np.int32)  # key -> waiting requests holding it
        # hints_continue / hints_close: hints the setup applied; hints_ignored: well-formed hints
        # a setup without hints received (kvtriton.vllm.stats.STATS says what each counts).
        self.counters = {"hints_continue": 0, "hints_close": 0, "hints_ignored": 0,
                         "malformed_hints": 0}

    def cpu_pool(self, num_blocks: int, *, enable_events: bool) -> BlockPool:
        """The CPU tier's pool, with the hinted queue when a setup uses one."""
        queue = self._base if self._queue is None else self._queue
        self.pool = BlockPool(num_blocks, eviction=queue, medium="CPU",
                              enable_events=enable_events)
        return self.pool

    def _free_block(self, key: int) -> int | None:
        b = self.pool.get_cached_block(key)
        return b if b is not None and self.pool.is_free(b) else None

    def _set(self, keys: np.ndarray, level: int, depths: np.ndarray | None) -> None:
        if len(keys):
            self._queue.hint(keys, level, self._free_block, depths)

    # ---- the request's life -------------------------------------------------------------------

    def arrived(self, vreq: Any) -> None:
        """``vreq`` joined the waiting queue (``on_new_request``)."""
        rid = vreq.request_id
        if not self.lookahead_on or rid in self._waiting:
            return
        keys, depths = _distinct_by_depth(lookup_request(vreq, self._keys, self._suffixes).keys)
        self._waiting[rid], self._depths[rid] = keys, depths
        self._count = _grown(self._count, self._keys.capacity, 0)
        self._count[keys] += 1
        first = self._count[keys] == 1
        self._set(keys[first], PROTECTED, depths[first])

    def _left_waiting(self, rid: str) -> None:
        keys = self._waiting.pop(rid, None)
        if keys is None:
            return
        depths = self._depths.pop(rid)
        self._count[keys] -= 1
        last = self._count[keys] == 0
        self._set(keys[last], NORMAL, depths[last])

    def admitted(self, rid: str, keys: np.ndarray) -> None:
        """``rid`` was given blocks, holding ``keys`` (``update_state_after_alloc``)."""
        self._left_waiting(rid)
        if not self.hints_on:
            return
        serial = self._serial.get(rid)
        if serial is None:
            serial = self._serial[rid] = self._next_serial
            self._next_serial += 1
        self._holder = _grown(self._holder, self._keys.capacity, -1)
        self._holder[keys.ravel()] = serial

    def finished(self, vreq: Any, keys: np.ndarray | None) -> str | None:
        """``vreq`` finished or was aborted, holding ``keys`` (its hashed positions per group;
        None if it never got any): apply its hint; returns the hint."""
        rid = vreq.request_id
        self._left_waiting(rid)
        hint, malformed = request_hint(vreq)
        self.counters["malformed_hints"] += malformed
        if hint is not None:
            if self.uses_hints:
                self.counters[f"hints_{hint}"] += 1
            else:
                self._ignored(rid, hint)
        serial = self._serial.pop(rid, None)
        if not self.hints_on or keys is None or not keys.size:
            return hint
        uniq, depths = _distinct_by_depth(keys)
        if hint == "close":
            # Keys a later admitted request holds are its future, not this closed session's.
            self._holder = _grown(self._holder, self._keys.capacity, -1)
            holder = self._holder[uniq]
            mine = (holder == -1) if serial is None else (holder == serial) | (holder == -1)
            self._set(uniq[mine], CLOSED, depths[mine])
        else:
            self._set(uniq, PROTECTED if hint == "continue" else NORMAL, depths)
        return hint

    def _ignored(self, rid: str, hint: str) -> None:
        self.counters["hints_ignored"] += 1
        if self._warned_ignored:
            return
        self._warned_ignored = True
        logger.warning("KVTritonConnector: request %s: kv_transfer_params[%r] = %r, but setup %r "
                       "uses no hints (add 'hints', or 'hinted' with 'lazy'); hints are ignored "
                       "and counted in the stats' hints_ignored (warned once)",
                       shorten(str(rid)), HINT_KEY, hint, self._setup)

    # ---- key ids -------------------------------------------------------------------------------

    def referenced_keys(self) -> list[np.ndarray]:
        """Key ids held here that no pool or request may hold: the waiting requests' keys."""
        return list(self._waiting.values())

    def forget(self, keys: np.ndarray) -> None:
        """``keys`` will name other blocks: they start over in the plain order, holderless."""
        if self._queue is not None and len(keys):
            self._queue.hint(keys, NORMAL, lambda _key: None)
        inside = keys[keys < len(self._holder)]
        self._holder[inside] = -1

    @property
    def protected_blocks(self) -> int:
        return self._queue.protected_blocks if self._queue is not None else 0

    @property
    def protect_overflow(self) -> int:
        return self._queue.protect_overflow if self._queue is not None else 0
