"""The CPU tier's eviction order as a setup builds it, and what hints and the waiting-queue
lookahead do to it: one builder under both the simulator (``kvtriton.sim.loop.ServingLoop``) and
the connector (``kvtriton.vllm.signals.TierSignals``), which differ only in where they learn of
a request's keys and hint.

``cpu_queue(setup, next_use)``: the setup's eviction queue (``kvtriton.eviction``, or the
next-use oracle the simulator passes in), wrapped in a ``HintedQueue`` where the setup uses
hints (protect up to ``hint_protect_share`` of the tier, the oldest hint let go first) or the
lookahead (up to ``waiting_protect_share``, the newest arrival let go first: it is admitted
last).

``SignalBook``: the rules, by key id. A request (any hashable ``holder``: the simulator's
request index, the connector's request id) is counted in the waiting queue once, from its
arrival to its first admission or its end, and the keys of a waiting request are protected
while some waiting request holds them. Each key remembers the request last admitted with it.
When a request finishes, its hint applies: ``continue`` protects its keys, ``close`` makes the
keys it held last (or that no admitted request held) the first to go, and no hint returns its
keys to the plain order. Key ids may grow (the connector's are recycled: ``forget``).

Sessions (the ``sessions`` axis). When a turn of a session finishes, its keys are protected for
the session's next turn, as a ``continue`` hint protects them, but with no client hint: the
session id is all a server needs. A full protected segment lets the session silent longest go
first (its protection was given longest ago), so protection decays with the time since the
session's last turn; a session silent ``idle_s`` seconds (by the caller's clock: the
simulator's modeled time, the connector's monotonic clock) ages out: ``expire`` lets go of the
keys it protected last and that nobody protected since (their free blocks go first, as the
oldest in a recency order would: ``HintedQueue.let_go``), and forgets the session.
Memory: one entry per session heard from within ``idle_s``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import numpy as np

from kvtriton.eviction import (
    CLOSED,
    NORMAL,
    PROTECTED,
    EvictionQueue,
    HintedQueue,
    make_eviction_queue,
)

if TYPE_CHECKING:
    from kvtriton.setups import TierSetup

#: The share of the tier a session's protected blocks may hold (``kvtriton.setups``'s default
#: share of the protecting axes).
DEFAULT_PROTECT_SHARE = 0.5

__all__ = ["SignalBook", "cpu_queue"]


def cpu_queue(setup: TierSetup, next_use: EvictionQueue | None = None
              ) -> tuple[EvictionQueue, HintedQueue | None]:
    """The CPU pool's eviction queue for ``setup`` and, where the setup uses hints or the
    lookahead, the ``HintedQueue`` it is (else None). ``next_use``: the queue to use for the
    ``nextuse`` oracle, which only a trace's owner can build."""
    if setup.cpu_eviction == "nextuse":
        if next_use is None:
            raise ValueError(f"setup {setup.name!r}: the next-use oracle needs the trace's "
                             "future; only the simulator has it")
        base = next_use
    else:
        base = make_eviction_queue(setup.cpu_eviction)
    if setup.hints:
        hinted = HintedQueue(base, setup.hint_protect_share)
    elif setup.sessions:
        hinted = HintedQueue(base, DEFAULT_PROTECT_SHARE)
    elif setup.lookahead:
        hinted = HintedQueue(base, setup.waiting_protect_share, demote="newest")
    else:
        return base, None
    return hinted, hinted


def _distinct_by_depth(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct keys of a ``(groups, positions)`` key array, in the order they first occur
    along the chain (position, then group), and the first position (hash block) each has in it.
    A hint moves the keys' free CPU blocks in this order, so their order in the eviction queue
    follows the chain, never the key ids' numbering (which differs between the connector and the
    simulator, and from run to run as the connector recycles ids)."""
    by_position = keys.T.ravel()  # position-major: a key's first occurrence is its shallowest
    uniq, first = np.unique(by_position, return_index=True)
    order = np.argsort(first, kind="stable")
    return uniq[order], (first[order] // max(1, keys.shape[0])).astype(np.int32)


def _grown(arr: np.ndarray, n: int, fill: int) -> np.ndarray:
    if n <= len(arr):
        return arr
    out = np.full(max(n, 2 * len(arr)), fill, dtype=arr.dtype)
    out[:len(arr)] = arr
    return out


class SignalBook:
    """What hints and the lookahead do to ``queue`` (a setup's ``HintedQueue``), by key id.
    ``free_block(key)`` names the free CPU block caching ``key`` (a hint moves it at once), or
    None. ``hints``/``lookahead``: the setup's axes."""

    def __init__(self, queue: HintedQueue, free_block: Callable[[int], int | None], *,
                 hints: bool, lookahead: bool, session_idle_s: float | None = None) -> None:
        self.queue = queue
        self._free_block = free_block
        self.hints = hints
        self.lookahead = lookahead
        #: Seconds a session may stay silent before its protection ages out (None: off).
        self.session_idle_s = session_idle_s
        # session -> (when its last turn ended, the keys it protected, the epoch it gave them),
        # the longest-silent first.
        self._sessions: OrderedDict[Hashable, tuple[float, np.ndarray, int]] = OrderedDict()
        #: Sessions aged out by ``expire`` (a count).
        self.sessions_expired = 0
        self._holder = np.full(0, -1, dtype=np.int64)  # key -> serial of its last admitted holder
        self._serial: dict[Hashable, int] = {}  # holder -> its serial, from admission to finish
        self._next_serial = 0
        self._waiting: dict[Hashable, tuple[np.ndarray, np.ndarray]] = {}  # keys, depths
        self._count = np.zeros(0, dtype=np.int32)  # key -> waiting requests holding it

    def _set(self, keys: np.ndarray, level: int, depths: np.ndarray | None) -> None:
        if len(keys):
            self.queue.hint(keys, level, self._free_block, depths)

    def arrived(self, holder: Hashable, keys: np.ndarray) -> None:
        """``holder`` joined the waiting queue holding ``keys`` (``(groups, positions)``);
        counted once until it leaves."""
        if not self.lookahead or holder in self._waiting:
            return
        keys, depths = _distinct_by_depth(keys)
        self._waiting[holder] = (keys, depths)
        if len(keys):
            self._count = _grown(self._count, int(keys.max()) + 1, 0)
        self._count[keys] += 1
        first = self._count[keys] == 1
        self._set(keys[first], PROTECTED, depths[first])

    def left_waiting(self, holder: Hashable) -> None:
        """``holder`` left the waiting queue (admitted, or ended while waiting)."""
        entry = self._waiting.pop(holder, None)
        if entry is None:
            return
        keys, depths = entry
        self._count[keys] -= 1
        last = self._count[keys] == 0
        self._set(keys[last], NORMAL, depths[last])

    def admitted(self, holder: Hashable, keys: np.ndarray) -> None:
        """``holder`` was admitted holding ``keys`` (any shape): it leaves the waiting queue and
        is the keys' last holder."""
        self.left_waiting(holder)
        if not self.hints:
            return
        serial = self._serial.get(holder)
        if serial is None:
            serial = self._serial[holder] = self._next_serial
            self._next_serial += 1
        flat = keys.ravel()
        if len(flat):
            self._holder = _grown(self._holder, int(flat.max()) + 1, -1)
        self._holder[flat] = serial

    def finished(self, holder: Hashable, keys: np.ndarray | None, hint: str | None) -> None:
        """``holder`` finished holding ``keys`` (``(groups, positions)``; None: it never had
        any) with ``hint``: apply it."""
        self.left_waiting(holder)
        serial = self._serial.pop(holder, None)
        if not self.hints or keys is None or not keys.size:
            return
        uniq, depths = _distinct_by_depth(keys)
        if hint == "close":
            # Keys a later admitted request holds are its future, not this closed session's.
            self._holder = _grown(self._holder, int(uniq.max()) + 1, -1)
            holder_of = self._holder[uniq]
            mine = (holder_of == -1) if serial is None else \
                (holder_of == serial) | (holder_of == -1)
            self._set(uniq[mine], CLOSED, depths[mine])
        else:
            self._set(uniq, PROTECTED if hint == "continue" else NORMAL, depths)

    @property
    def sessions(self) -> bool:
        return self.session_idle_s is not None

    def turn_ended(self, session: Hashable, keys: np.ndarray | None, now: float) -> None:
        """A turn of ``session`` ended at ``now`` (seconds) holding ``keys``
        (``(groups, positions)``; None: none): protect them for the session's next turn."""
        if not self.sessions:
            return
        self._sessions.pop(session, None)
        if keys is None or not keys.size:
            return
        uniq, depths = _distinct_by_depth(keys)
        self._set(uniq, PROTECTED, depths)
        self._sessions[session] = (now, uniq, self.queue.last_hint)

    def expire(self, now: float) -> int:
        """Age out the sessions silent for ``idle_s`` by ``now``: their keys that no later
        protection renewed return to the plain order. Returns how many sessions aged out."""
        if not self._sessions:
            return 0
        limit = now - self.session_idle_s
        expired = 0
        while self._sessions:
            session, (ended, keys, epoch) = next(iter(self._sessions.items()))
            if ended > limit:
                break
            del self._sessions[session]
            expired += 1
            self.queue.let_go(keys[self.queue.epochs(keys) == epoch], self._free_block)
        self.sessions_expired += expired
        return expired

    @property
    def live_sessions(self) -> int:
        """Sessions heard from within the idle time (their protection still on)."""
        return len(self._sessions)

    def last_holder(self, keys: np.ndarray) -> np.ndarray:
        """The serial of each key's last admitted holder (-1: none since it was forgotten)."""
        out = np.full(len(keys), -1, dtype=np.int64)
        inside = keys < len(self._holder)
        out[inside] = self._holder[keys[inside]]
        return out

    @property
    def keys_held_waiting(self) -> int:
        """How many keys some waiting request holds (0 once the queue is empty)."""
        return int(np.count_nonzero(self._count))

    def waiting_keys(self) -> list[np.ndarray]:
        """The keys the waiting requests hold (the connector must not recycle them)."""
        return [keys for keys, _ in self._waiting.values()]

    def forget(self, keys: np.ndarray) -> None:
        """``keys`` will name other blocks: they start over in the plain order, holderless."""
        if len(keys):
            self.queue.hint(keys, NORMAL, lambda _key: None)
        inside = keys[keys < len(self._holder)]
        self._holder[inside] = -1
