"""What a server knows of the CPU tier's future, applied to its eviction: continuation hints and
the waiting-queue lookahead (the ``hints`` and ``waiting`` axes of ``kvtriton.setups``).

Hints. A request's ``kv_transfer_params`` (vLLM's per-request connector data: the offline API's
``SamplingParams(extra_args={"kv_transfer_params": {...}})``, the OpenAI server's request body)
may carry ``"kvtriton_hint": "continue" | "close"``. When the request finishes, ``continue``
protects its blocks in the CPU tier (``HintedQueue``: up to a share of the tier, the oldest hint
let go first), ``close`` makes the blocks it held last the first to go, and no hint returns its
blocks to the plain eviction order. The rules are ``kvtriton.tier_signals.SignalBook``'s, which
``kvtriton.sim.loop.ServingLoop`` applies to a workload's hints too. "Held last" is counted per
key from admissions: a block a later request was admitted with belongs to that request's future,
not to the closed one. That scopes a close without a session id, so the connector takes none.
Hinted admission (``lazy+hinted``) gets the hint from here too. A hint that is not one of the
two is a warning naming the request, counted in ``malformed_hints``; the request is served as if
it had none. A hint sent to a setup that uses
none (neither ``hints`` nor ``hinted`` admission) changes nothing: it is counted in
``hints_ignored``, not as applied, with one warning per connector. Client values in a warning are
cut to ``LOGGED_CHARS`` characters (``shorten``): a log line's length must not be the client's.

Lookahead. vLLM calls ``on_new_request`` when a request joins the waiting queue,
``update_state_after_alloc`` when it leaves it admitted and ``request_finished`` when it leaves
it aborted: the connector sees the queue's membership without a scheduler of its own. The keys
of a waiting request's prompt blocks are protected while some waiting request holds them, the
newest arrival let go first when the protected share is full; as in the simulator, a request
counts once, from its arrival to its first admission (a preempted request is not counted again).

Sessions. Under the ``sessions`` axis a finished request with a session id
(``Request.session_id``: the OpenAI body's ``session_id`` or the ``X-Session-ID`` header;
``kv_transfer_params["session_id"]`` on any release: ``kvtriton.vllm.releases``) has its blocks
protected for the session's next turn, until the session is silent for the setup's idle time
(``SignalBook.turn_ended``/``expire``, the rules the simulator applies to a trace's sessions).
The clock is ``time.monotonic`` (``clock``: a simulator driving vLLM's scheduler sets its own).
A session id that is not a string of 1 to ``MAX_SESSION_CHARS`` characters is counted in
``malformed_sessions`` and warned about once; the request is served without one.

What a client may claim. A session id and a ``continue`` hint are the client's word, so each
claim on the protected segment is bounded (``kvtriton.tier_signals``, "Claims"): of the claims
whose context has not come back yet (a session's first turn, a ``continue`` nobody continued)
only the newest is protected; and where several tenants (``cache_salt``) hold claims, none keeps
more than its fair share of the segment. One client sending a fresh session id or ``continue``
with every request holds one request's blocks protected, not half the tier.

Key ids are recycled (``kvtriton.vllm.keys``): the keys held here are reported by
``referenced_keys`` and recycled ones return to the plain order (``forget``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtriton.pool import BlockPool
from kvtriton.records import HINTS
from kvtriton.setups import TierSetup
from kvtriton.tier_signals import SignalBook, cpu_queue
from kvtriton.vllm.keys import KeyIds
from kvtriton.vllm.releases import (
    HINT_KEY,
    MAX_SESSION_CHARS,
    SESSION_KEY,
    request_hint_value,
    request_session,
)
from kvtriton.vllm.requests import lookup_request

__all__ = ["HINTS", "HINT_KEY", "LOGGED_CHARS", "TierSignals", "request_hint", "shorten"]

logger = logging.getLogger(__name__)

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
    """``vreq``'s continuation hint (None: none) and whether a malformed one was dropped
    (``kvtriton.vllm.releases.request_hint_value``: the params, or 0.33's ``kv_hints``)."""
    hint, where = request_hint_value(vreq)
    if hint is None:
        return None, False
    if isinstance(hint, str) and hint in HINTS:
        return hint, False
    logger.warning("KVTritonConnector: request %s: %s = %s is not one of %s; served without a "
                   "hint", shorten(str(vreq.request_id)), where, shorten(repr(hint)),
                   ", ".join(map(repr, HINTS)))
    return None, True


class TierSignals:
    """The hints and lookahead of one connector's CPU tier. ``setup``: the setup; with neither
    axis on, only the hints' counts are kept (hinted admission still reads the hint)."""

    def __init__(self, setup: TierSetup, keys: KeyIds, suffixes: list[bytes]) -> None:
        self.hints_on = setup.hints
        self.lookahead_on = setup.lookahead
        self.sessions_on = setup.sessions
        #: Seconds, for the sessions' idle time (monotonic; a simulator sets its modeled clock).
        self.clock: Callable[[], float] = time.monotonic
        self._warned_session = False
        #: Whether the setup does anything with a hint: the hints axis or hinted admission.
        self.uses_hints = self.hints_on or (setup.planner is not None
                                            and setup.planner.admission == "hinted")
        self._setup = setup.composition or setup.name
        self._warned_ignored = False
        self._keys = keys
        self._suffixes = suffixes
        self._queue, hinted = cpu_queue(setup)
        #: The hints' and lookahead's rules over the hinted queue (None: the setup uses neither).
        self.book: SignalBook | None = None
        if hinted is not None:
            self.book = SignalBook(hinted, self._free_block, hints=self.hints_on,
                                   lookahead=self.lookahead_on,
                                   session_idle_s=setup.session_idle_s)
        self.pool: BlockPool | None = None
        # hints_continue / hints_close: hints the setup applied; hints_ignored: well-formed hints
        # a setup without hints received (kvtriton.vllm.stats.STATS says what each counts).
        self.counters = {"hints_continue": 0, "hints_close": 0, "hints_ignored": 0,
                         "malformed_hints": 0, "session_turns": 0, "sessions_expired": 0,
                         "malformed_sessions": 0}

    def cpu_pool(self, num_blocks: int, *, enable_events: bool) -> BlockPool:
        """The CPU tier's pool, with the hinted queue when a setup uses one."""
        self.pool = BlockPool(num_blocks, eviction=self._queue, medium="CPU",
                              enable_events=enable_events)
        return self.pool

    def _free_block(self, key: int) -> int | None:
        b = self.pool.get_cached_block(key)
        return b if b is not None and self.pool.is_free(b) else None

    # ---- the request's life (the rules: kvtriton.tier_signals.SignalBook) --------------------

    def arrived(self, vreq: Any) -> None:
        """``vreq`` joined the waiting queue (``on_new_request``)."""
        if self.book is None or not self.lookahead_on:
            return
        keys = lookup_request(vreq, self._keys, self._suffixes).keys
        self.book.arrived(vreq.request_id, keys)

    def admitted(self, rid: str, keys: np.ndarray) -> None:
        """``rid`` was given blocks, holding ``keys`` (``update_state_after_alloc``)."""
        if self.book is not None:
            self.book.admitted(rid, keys)

    def finished(self, vreq: Any, keys: np.ndarray | None) -> str | None:
        """``vreq`` finished or was aborted, holding ``keys`` (its hashed positions per group;
        None if it never got any): apply its hint; returns the hint."""
        rid = vreq.request_id
        hint, malformed = request_hint(vreq)
        self.counters["malformed_hints"] += malformed
        if hint is not None:
            if self.uses_hints:
                self.counters[f"hints_{hint}"] += 1
            else:
                self._ignored(rid, hint)
        if self.book is not None:
            tenant = getattr(vreq, "cache_salt", None)
            self.book.finished(rid, keys, hint, tenant=tenant)
            if self.sessions_on:
                self._end_turn(vreq, keys, tenant)
        return hint

    def _end_turn(self, vreq: Any, keys: np.ndarray | None, tenant: str | None) -> None:
        session, malformed = request_session(vreq)
        if malformed:
            self.counters["malformed_sessions"] += 1
            if not self._warned_session:
                self._warned_session = True
                logger.warning(
                    "KVTritonConnector: request %s: its session id (Request.session_id or "
                    "kv_transfer_params[%r]) is not a string of 1 to %d characters; served "
                    "without a session (counted in malformed_sessions, warned once)",
                    shorten(str(vreq.request_id)), SESSION_KEY, MAX_SESSION_CHARS)
        if session is None:
            return
        self.counters["session_turns"] += 1
        self.book.turn_ended(session, keys, self.clock(), tenant=tenant)

    def claim_counters(self) -> dict[str, int]:
        """What the bounds on claims did (``SignalBook``'s counts; stats names)."""
        book = self.book
        if book is None:
            return {"claims_proven": 0, "claims_unproven_let_go": 0,
                    "claims_over_share_let_go": 0}
        return {"claims_proven": book.claims_proven,
                "claims_unproven_let_go": book.claims_let_go["unproven"],
                "claims_over_share_let_go": book.claims_let_go["over_share"]}

    def tick(self) -> None:
        """Once per scheduler step: age out the sessions silent past the idle time."""
        if self.sessions_on:
            self.counters["sessions_expired"] += self.book.expire(self.clock())

    @property
    def live_sessions(self) -> int:
        return self.book.live_sessions if self.sessions_on else 0

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
        return [] if self.book is None else self.book.waiting_keys()

    def forget(self, keys: np.ndarray) -> None:
        """``keys`` will name other blocks: they start over in the plain order, holderless."""
        if self.book is not None:
            self.book.forget(keys)

    @property
    def protected_blocks(self) -> int:
        return self.book.queue.protected_blocks if self.book is not None else 0

    @property
    def protect_overflow(self) -> int:
        return self.book.queue.protect_overflow if self.book is not None else 0
