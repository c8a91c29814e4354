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

Claims: what one client may take. A session's turn and a ``continue`` hint each *claim* the
protected segment for their keys, and both are client input: a client sending a fresh session
id, or ``continue``, with every request would otherwise fill the segment (half the tier) with
blocks nobody comes back for, pushing every other client's prefixes out. So a claim is bounded
by what its client has shown:
- *came back*: a session's turn is proven when the session ended a turn before (within the
  idle time, and among the last ``seen`` sessions) and this turn holds that turn's head key
  (the context came back); a ``continue`` is proven when the request holds the second deepest
  key of an earlier ``continue`` (the hinted context came back, but for its last block, which a
  partial block or a resent output's tokenization may change). Keys are salted per tenant
  (vLLM's ``cache_salt``), so one tenant never proves another's claim.
- *probation*: unproven claims together hold at most ``PROBATION_SHARE`` of the protected
  segment (none: the newest unproven claim alone is protected); past it the oldest unproven
  claim loses its protection (its blocks return to the plain order).
- *tenants*: when the claims hold more keys than the segment and more than one tenant holds
  some, the tenant holding the most loses its oldest claim's protection until they fit, so one
  tenant cannot push another's protection out: each keeps at least its fair share.
  With one tenant, the segment's own order decides, block by block (``HintedQueue``).
- *memory*: the book tracks claims of at most ``TRACKED_SEGMENTS`` segments' worth of keys,
  and remembers at most a segment's worth (in blocks) of sessions it has seen; past either the
  oldest is forgotten (the segment's own order, block by block, has demoted a claim that
  old). So its memory is bounded by the tier's size (``book_bytes``), whatever number of
  session ids clients send.
A claim replaced by its session's (or chain's) next one lets go of the keys the new one does
not hold (their blocks go first: the context moved on without them), as aging out does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
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
from kvtriton.setups import DEFAULT_PROTECT_SHARE

if TYPE_CHECKING:
    from kvtriton.setups import TierSetup


#: The share of the protected segment that unproven claims (a session's first turn, a
#: ``continue`` whose context nobody came back to yet) may hold together, the newest one aside:
#: none. Only the newest unproven claim is protected, and the next takes its place. In the
#: engine attack of ``bench.vllm.claims_attack`` (66 GPU blocks, 150 in the tier) a quarter of
#: the segment cost the other clients 17-24% of their CPU hits, an eighth 5-24%, none 6-8% over
#: three pairs of runs; LRU's cliff turns a few protected blocks into many lost hits. The
#: simulator's hint and session figures on the agent and coding-agent traces were the same at
#: none, an eighth and a quarter.
PROBATION_SHARE = 0.0
#: Claims tracked, in protected segments' worth of keys: the segment's own order demotes the
#: blocks of older claims block by block before that, so the book forgets only what it let go.
TRACKED_SEGMENTS = 2
#: Host bytes per tracked claim besides its keys (its record, array header, dictionary entries),
#: and per remembered session besides its id: what ``book_bytes`` counts (measured with
#: ``tracemalloc`` at about 400 and 150; rounded up).
CLAIM_OVERHEAD_BYTES = 512
SEEN_OVERHEAD_BYTES = 256

__all__ = ["PROBATION_SHARE", "SignalBook", "book_bytes", "claim_bytes", "cpu_queue",
           "eviction_state"]


def book_bytes(protect_blocks: int, max_session_chars: int = 256) -> int:
    """The most host memory a ``SignalBook``'s claims and remembered sessions take for a
    protected segment of ``protect_blocks`` blocks, bytes (its per-key-id arrays aside, which
    every setup with hints or the lookahead has): at most ``TRACKED_SEGMENTS`` segments' worth of
    keys (8 bytes each) in at most as many claims, and a segment's worth of sessions with ids of
    up to ``max_session_chars`` characters."""
    tracked = TRACKED_SEGMENTS * max(1, protect_blocks)
    return (tracked * (8 + CLAIM_OVERHEAD_BYTES)
            + max(1, protect_blocks) * (SEEN_OVERHEAD_BYTES + max_session_chars))


def claim_bytes(setup: TierSetup, num_blocks: int) -> int:
    """The most host bytes the claims of ``setup``'s ``hints`` or ``sessions`` take for a CPU
    pool of ``num_blocks`` blocks (the null block included): ``book_bytes`` of its protected
    segment; 0 without either axis. The connector's and the simulator's memory checks count
    it beside the tier."""
    if setup.planner is None or not (setup.hints or setup.sessions):
        return 0
    share = setup.hint_protect_share if setup.hints else DEFAULT_PROTECT_SHARE
    return book_bytes(int(share * max(1, num_blocks - 1)))


def eviction_state(sketch: int, claims: int) -> str:
    """What a memory error names: "LFU sketch", "session and hint claims" or both."""
    return " and ".join((["LFU sketch"] if sketch else [])
                        + (["session and hint claims"] if claims else []))


@dataclass(slots=True, eq=False)
class _Claim:
    """One claim on the protected segment: a session's turn or a ``continue`` hint."""
    owner: Hashable | None  # (tenant, session); None: a hint's chain
    tenant: Hashable
    keys: np.ndarray  # distinct, in chain order: the head first, the deepest last
    epoch: int  # the ``HintedQueue.hint`` call that protected them
    at: float  # when the turn ended, seconds (the caller's clock)
    proven: bool  # its context came back before


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
        hinted = HintedQueue(base, DEFAULT_PROTECT_SHARE, role="sessions")
    elif setup.lookahead:
        hinted = HintedQueue(base, setup.waiting_protect_share, demote="newest", role="waiting")
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


def _link(uniq: np.ndarray) -> int:
    """The key by which a later request shows it continues a ``continue`` claim of ``uniq``
    (distinct keys in chain order): the second deepest. The deepest may not come back even when
    the context does: a trace's last block is partial, and extended it hashes anew; a resent
    output may tokenize differently at its end."""
    return int(uniq[-2] if len(uniq) > 1 else uniq[-1])


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
        # Claims by serial, the oldest first (for sessions: the longest-silent first).
        self._claims: OrderedDict[int, _Claim] = OrderedDict()
        self._next_claim = 0
        self._session_claim: dict[Hashable, int] = {}  # (tenant, session) -> its live claim
        # (tenant, session) -> (the head key of its last turn, when it ended), least recent first
        self._seen: OrderedDict[Hashable, tuple[int, float]] = OrderedDict()
        self._tail_claim = np.full(0, -1, dtype=np.int64)  # key -> live hint claim ending there
        self._tail = np.zeros(0, dtype=bool)  # key -> the link key of an earlier continue
        self._probation: OrderedDict[int, None] = OrderedDict()  # unproven claims, oldest first
        self._probation_keys = 0
        self._tracked_keys = 0
        self._tenant_keys: dict[Hashable, int] = {}
        self._tenant_claims: dict[Hashable, OrderedDict[int, None]] = {}
        #: Sessions aged out by ``expire`` (a count).
        self.sessions_expired = 0
        #: Claims let go before their time, by why: ``unproven`` (probation full),
        #: ``over_share`` (their tenant over its fair share); ``tracked``: claims forgotten at
        #: the book's bound (their blocks left to the segment's order).
        self.claims_let_go = {"unproven": 0, "over_share": 0, "tracked": 0}
        #: Claims made, and those of them proven (their context came back).
        self.claims_made = 0
        self.claims_proven = 0
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

    def finished(self, holder: Hashable, keys: np.ndarray | None, hint: str | None, *,
                 tenant: Hashable = None) -> None:
        """``holder`` finished holding ``keys`` (``(groups, positions)``; None: it never had
        any) with ``hint``: apply it. ``tenant``: whose claim a ``continue`` is (vLLM's
        ``cache_salt``; None: the one tenant)."""
        self.left_waiting(holder)
        serial = self._serial.pop(holder, None)
        if not self.hints or keys is None or not keys.size:
            return
        uniq, depths = _distinct_by_depth(keys)
        # The claims this request continues (it holds their link key): replaced by its own
        # claim on ``continue``, no longer tracked otherwise (their keys take this hint).
        before = [self._untrack(c) for c in self._claims_ending_in(uniq)]
        if hint == "continue":
            inside = uniq[uniq < len(self._tail)]
            self._claim(None, tenant, uniq, depths, 0.0,
                        proven=bool(self._tail[inside].any()))
            for old in before:
                self._let_go(old)
            return
        if hint == "close":
            # Keys a later admitted request holds are its future, not this closed session's.
            self._holder = _grown(self._holder, int(uniq.max()) + 1, -1)
            holder_of = self._holder[uniq]
            mine = (holder_of == -1) if serial is None else \
                (holder_of == serial) | (holder_of == -1)
            self._set(uniq[mine], CLOSED, depths[mine])
        else:
            self._set(uniq, NORMAL, depths)

    @property
    def sessions(self) -> bool:
        return self.session_idle_s is not None

    def turn_ended(self, session: Hashable, keys: np.ndarray | None, now: float, *,
                   tenant: Hashable = None) -> None:
        """A turn of ``session`` (of ``tenant``: vLLM's ``cache_salt``, None: the one tenant)
        ended at ``now`` (seconds) holding ``keys`` (``(groups, positions)``; None: none):
        protect them for the session's next turn. A turn without keys changes nothing."""
        if not self.sessions or keys is None or not keys.size:
            return
        owner = (tenant, session)
        uniq, depths = _distinct_by_depth(keys)
        last = self._seen.pop(owner, None)
        proven = (last is not None and last[1] > now - self.session_idle_s
                  and bool(np.any(uniq == last[0])))
        self._seen[owner] = (int(uniq[0]), now)
        while len(self._seen) > max(1, self.queue.protect_capacity):
            self._seen.popitem(last=False)
        serial = self._session_claim.get(owner)
        before = None if serial is None else self._untrack(serial)
        self._claim(owner, tenant, uniq, depths, now, proven)
        if before is not None:
            self._let_go(before)

    def expire(self, now: float) -> int:
        """Age out the sessions silent for ``idle_s`` by ``now``: their keys that no later
        protection renewed return to the plain order. Returns how many sessions aged out."""
        limit = now - self.session_idle_s
        expired = 0
        while self._claims:
            serial, claim = next(iter(self._claims.items()))
            if claim.at > limit:
                break
            self._let_go(self._untrack(serial))
            self._seen.pop(claim.owner, None)
            expired += 1
        self.sessions_expired += expired
        return expired

    @property
    def live_sessions(self) -> int:
        """Sessions heard from within the idle time whose protection is still on."""
        return len(self._session_claim)

    # ---- claims (the bounds on what one client may take) ---------------------------------------

    def _claim(self, owner: Hashable | None, tenant: Hashable, uniq: np.ndarray,
               depths: np.ndarray, now: float, proven: bool) -> None:
        """Protect ``uniq`` as one claim and keep every bound (the module's "Claims")."""
        self._set(uniq, PROTECTED, depths)
        serial = self._next_claim
        self._next_claim += 1
        self._claims[serial] = _Claim(owner, tenant, uniq, self.queue.last_hint, now, proven)
        n = len(uniq)
        self._tracked_keys += n
        self._tenant_keys[tenant] = self._tenant_keys.get(tenant, 0) + n
        self._tenant_claims.setdefault(tenant, OrderedDict())[serial] = None
        if owner is not None:
            self._session_claim[owner] = serial
        else:
            tail = _link(uniq)
            self._tail_claim = _grown(self._tail_claim, tail + 1, -1)
            self._tail = _grown(self._tail, tail + 1, False)
            self._tail_claim[tail] = serial
            self._tail[tail] = True
        self.claims_made += 1
        self.claims_proven += proven
        if not proven:
            self._probation[serial] = None
            self._probation_keys += n
        self._bound()

    def _bound(self) -> None:
        cap = max(1, self.queue.protect_capacity)
        # The newest unproven claim stays whatever the share (none by default): the last turn
        # is kept for the next one until another unproven claim takes its place.
        while self._probation_keys > int(PROBATION_SHARE * cap) and len(self._probation) > 1:
            self._drop(next(iter(self._probation)), "unproven")
        while len(self._tenant_keys) > 1 and self._tracked_keys > cap:
            # The tenant holding the most keys (of two, the one whose oldest claim is older):
            # over its fair share whenever the claims hold more than the segment.
            oldest = {t: next(iter(c)) for t, c in self._tenant_claims.items()}
            tenant = max(oldest, key=lambda t: (self._tenant_keys[t], -oldest[t]))
            self._drop(oldest[tenant], "over_share")
        while self._tracked_keys > TRACKED_SEGMENTS * cap:
            # Only forgotten: the segment's own order has demoted the blocks of claims this old
            # block by block (the oldest claim's deepest first), which keeps their heads longer
            # than letting the whole claim go would.
            self._untrack(next(iter(self._claims)))
            self.claims_let_go["tracked"] += 1

    def _drop(self, serial: int, why: str) -> None:
        """A bound takes claim ``serial``'s protection: its keys that no later claim renewed
        return to the plain order (their blocks at its young end, as the segment's own overflow
        puts them), neither first to go nor kept: nothing says they are dead, as aging out or
        a replacing turn says of theirs."""
        self.claims_let_go[why] += 1
        self._set(self._still_held(self._untrack(serial)), NORMAL, None)

    def _untrack(self, serial: int) -> _Claim:
        """Stop tracking claim ``serial`` (the queue keeps what it has); returns it."""
        claim = self._claims.pop(serial)
        n = len(claim.keys)
        self._tracked_keys -= n
        self._tenant_keys[claim.tenant] -= n
        of_tenant = self._tenant_claims[claim.tenant]
        del of_tenant[serial]
        if not of_tenant:
            del self._tenant_claims[claim.tenant], self._tenant_keys[claim.tenant]
        if self._probation.pop(serial, 0) is None:
            self._probation_keys -= n
        if claim.owner is not None:
            if self._session_claim.get(claim.owner) == serial:
                del self._session_claim[claim.owner]
        elif self._tail_claim[_link(claim.keys)] == serial:
            self._tail_claim[_link(claim.keys)] = -1
        return claim

    def _let_go(self, claim: _Claim) -> None:
        """``claim``'s keys that no later claim renewed go first now (``HintedQueue.let_go``)."""
        self.queue.let_go(self._still_held(claim), self._free_block)

    def _still_held(self, claim: _Claim) -> np.ndarray:
        """``claim``'s keys that no later protection renewed (their epoch is still its own)."""
        return claim.keys[self.queue.epochs(claim.keys) == claim.epoch]

    def _claims_ending_in(self, uniq: np.ndarray) -> list[int]:
        """The live hint claims whose link key (``_link``) is among ``uniq``."""
        serials = self._tail_claim[uniq[uniq < len(self._tail_claim)]]
        return [int(c) for c in np.unique(serials[serials >= 0])]

    @property
    def claimed_keys(self) -> int:
        """Keys the tracked claims hold (a key two claims hold counted twice)."""
        return self._tracked_keys

    @property
    def unproven_keys(self) -> int:
        """Keys the unproven claims hold."""
        return self._probation_keys

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
            # A claim still tracked may hold these ids: its let-go must not reach their new
            # blocks (it lets go of the keys whose epoch is its own).
            self.queue.clear_epochs(keys)
        inside = keys[keys < len(self._holder)]
        self._holder[inside] = -1
        inside = keys[keys < len(self._tail)]
        self._tail[inside] = False
        self._tail_claim[inside] = -1
