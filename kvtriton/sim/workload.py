"""Workload records for the simulator, and the multi-turn agent generator.

A workload is a list of requests at one ``hash_block_size`` b. Each request carries the 64-bit
chain hashes of its full b-token blocks, prompt first and then output, so that two requests share
KV exactly where their hashes agree (equal hash, equal prefix). Trace loaders
(``kvtriton.sim.traces``) and the generator below produce the same records.

Arrivals are open loop (``arrival_s``) or closed loop: a request with ``after`` set arrives
``think_s`` seconds after the request it names has finished. For such a request ``arrival_s`` is
a nominal time (its predecessor's arrival plus a nominal service time plus ``think_s``); it only
orders the request for the cache-only replay, which has no notion of finishing.

A request may carry a continuation ``hint`` (one of ``HINTS``, or None for no hint):
``"continue"``: this turn's context will be reused soon (an agent turn that ended in a tool call,
so the next turn comes); ``"close"``: the client closes the session after this turn, so nothing
of it will be asked for again by this conversation. ``mark_session_close`` derives the closes
from a workload's structure.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from kvtriton.hashing import chain_hashes
from kvtriton.records import HINTS
from kvtriton.validation import is_finite_number, is_int

__all__ = ["HINTS", "MAX_AGENT_REQUESTS", "AgentConfig", "Workload", "WorkloadRequest",
           "agent_workload", "causal_sessions", "mark_session_close"]

# The most requests the agent generator makes: past it a typo such as 1e12 conversations would
# run for hours before anything is reported.
MAX_AGENT_REQUESTS = 10_000_000


@dataclass(slots=True, eq=False)
class WorkloadRequest:
    """One request of a workload.

    ``hashes``: uint64 chain hashes of the full ``hash_block_size``-token blocks of the prompt
    followed by the output, ``(prompt_len + output_len) // hash_block_size`` of them; the first
    ``prompt_len // hash_block_size`` belong to the prompt. ``session`` groups the turns of one
    conversation; ``after`` (closed loop) names the request whose end this one waits for, plus
    ``think_s`` seconds. ``model``: KV is only shared between requests of the same model.
    ``hint``: None, or one of ``HINTS`` (``"continue"``: this turn's context will be reused soon;
    ``"close"``: the client closes the session after this turn).
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    hashes: np.ndarray
    session: str | None = None
    after: str | None = None
    think_s: float = 0.0
    model: str | None = None
    hint: str | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        if not is_int(self.prompt_len) or self.prompt_len < 1:
            raise ValueError(f"request {rid!r}: prompt_len must be an int >= 1, "
                             f"got {self.prompt_len!r}")
        if not is_int(self.output_len) or self.output_len < 0:
            raise ValueError(f"request {rid!r}: output_len must be an int >= 0, "
                             f"got {self.output_len!r}")
        self.prompt_len, self.output_len = int(self.prompt_len), int(self.output_len)
        if not is_finite_number(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {rid!r}: arrival_s must be finite and >= 0, "
                             f"got {self.arrival_s!r}")
        if not is_finite_number(self.think_s) or self.think_s < 0:
            raise ValueError(f"request {rid!r}: think_s must be finite and >= 0, "
                             f"got {self.think_s!r}")
        if not isinstance(self.hashes, np.ndarray) or self.hashes.dtype != np.uint64 \
                or self.hashes.ndim != 1:
            raise ValueError(f"request {rid!r}: hashes must be a 1-D uint64 array")
        if self.after == rid:
            raise ValueError(f"request {rid!r}: cannot come after itself")
        if self.hint is not None and (not isinstance(self.hint, str) or self.hint not in HINTS):
            raise ValueError(f"request {rid!r}: hint must be None or one of {HINTS}, "
                             f"got {self.hint!r}")

    @property
    def total_len(self) -> int:
        """Prompt plus output tokens."""
        return self.prompt_len + self.output_len


@dataclass(slots=True)
class Workload:
    """Requests in arrival order at one ``hash_block_size`` (tokens per hashed block)."""

    requests: list[WorkloadRequest]
    hash_block_size: int
    name: str = "workload"

    def __post_init__(self) -> None:
        b = self.hash_block_size
        if not is_int(b) or b <= 0:
            raise ValueError(f"workload {self.name!r}: hash_block_size must be a positive int, "
                             f"got {b!r}")
        ids: set[str] = set()
        for r in self.requests:
            if r.request_id in ids:
                raise ValueError(f"workload {self.name!r}: duplicate request id {r.request_id!r}")
            ids.add(r.request_id)
            want = r.total_len // b
            if len(r.hashes) != want:
                raise ValueError(
                    f"workload {self.name!r}: request {r.request_id!r} has {len(r.hashes)} "
                    f"hashes, expected (prompt_len + output_len) // {b} = {want}")
        for r in self.requests:
            if r.after is not None and r.after not in ids:
                raise ValueError(f"workload {self.name!r}: request {r.request_id!r} comes after "
                                 f"unknown request {r.after!r}")

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[WorkloadRequest]:
        return iter(self.requests)

    def __getitem__(self, i: int) -> WorkloadRequest:
        return self.requests[i]

    def arrival_queue(self) -> tuple[list[tuple[float, int]], dict[str, list[int]]]:
        """What a serving loop starts from: a heap of ``(arrival_s, index)`` of the requests
        that arrive on their own, and per request id the indices of the closed-loop turns that
        come after it (released at its end plus their ``think_s``)."""
        arrivals: list[tuple[float, int]] = []
        successors: dict[str, list[int]] = {}
        for i, wr in enumerate(self.requests):
            if wr.after is None:
                arrivals.append((wr.arrival_s, i))
            else:
                successors.setdefault(wr.after, []).append(i)
        heapq.heapify(arrivals)
        return arrivals, successors

    def release_after(self, rid: str, now: float, arrivals: list[tuple[float, int]],
                      successors: dict[str, list[int]]) -> None:
        """``rid`` ended at ``now``: push the turns waiting for it (``successors``, as
        ``arrival_queue`` made it) onto ``arrivals``, each after its think time."""
        for i in successors.pop(rid, []):
            heapq.heappush(arrivals, (now + self.requests[i].think_s, i))

    def num_prompt_blocks(self, request: WorkloadRequest) -> int:
        """Full hashed blocks of ``request``'s prompt: its first hashes."""
        return request.prompt_len // self.hash_block_size


def without_closes(workload: Workload) -> Workload:
    """A copy of ``workload`` with every ``"close"`` hint removed: the hints a server has from
    the model's stop reasons alone (``"continue"`` after a tool call). A close is a client's
    explicit signal; derived from a trace (``mark_session_close``, the generator's last turns)
    it uses the future, and a study that gives it to a setup must say it is an oracle."""
    requests = [replace(r, hint=None) if r.hint == "close" else r for r in workload.requests]
    return Workload(requests, workload.hash_block_size, workload.name)


def mark_session_close(workload: Workload) -> Workload:
    """A copy of ``workload`` in which the last request of each session has hint ``"close"``.

    Traces do not record an explicit session close, so the close is derived from the trace's
    structure: the client is assumed to close the session after its last turn, as with an
    explicit session-close API (SGLang's session cache, for one). A session's last turn is the
    last of its ``session`` in arrival order, provided no request names it in ``after``; when
    some request does, that session gets no close. The close overrides a ``"continue"`` there:
    an explicit close from the client is stronger than the model's stop reason. Requests with
    ``session`` None are left alone, as are all other hints. ``workload`` is not modified; the
    copy shares its unchanged requests (and every request's hashes) with it.
    """
    named = {r.after for r in workload.requests if r.after is not None}
    last: dict[str, tuple[float, int]] = {}
    for i, r in enumerate(workload.requests):
        if r.session is not None:
            key = (r.arrival_s, i)
            if r.session not in last or key >= last[r.session]:
                last[r.session] = key
    close = {i for _, i in last.values() if workload.requests[i].request_id not in named}
    requests = [replace(r, hint="close") if i in close and r.hint != "close" else r
                for i, r in enumerate(workload.requests)]
    return Workload(requests, workload.hash_block_size, workload.name)



def causal_sessions(workload: Workload) -> list[str]:
    """Each request's session, as a server could tell it when the request arrives: its own
    ``session`` where the workload has one; otherwise that of the latest earlier request whose
    whole prompt this prompt extends (the deepest such), or a new session of its own (named by
    its request id). Only earlier arrivals' prompts are read, so the answer for a request never
    depends on what comes after it. O(prompt blocks) per request."""
    ends: dict[int, str] = {}  # last prompt hash of an earlier request -> its session
    out: list[str] = []
    for r in workload.requests:
        prompt = r.hashes[:workload.num_prompt_blocks(r)]
        session = r.session
        if session is None:
            session = r.request_id
            for h in reversed(prompt.tolist()):
                if h in ends:
                    session = ends[h]
                    break
        if len(prompt):
            ends[int(prompt[-1])] = session
        out.append(session)
    return out


# ---- the multi-turn agent generator ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """A conversational-agent scenario (the re-store design's): 10-50 turns, 10-100 concurrent
    conversations, a system prompt shared by all, history growing every turn with the previous
    answer and a new user message, and think time between turns. Lengths in tokens, times in
    seconds.

    Message lengths are lognormal around their medians (``length_sigma``); think times are
    exponential; conversations start uniformly within ``start_window_s``. A conversation ends
    early when its next request would pass ``max_context_tokens``.
    """

    num_conversations: int = 32
    min_turns: int = 10
    max_turns: int = 50
    system_prompt_tokens: int = 2048
    first_user_tokens: int = 1024
    user_tokens: int = 256
    output_tokens: int = 256
    length_sigma: float = 0.8
    think_s_mean: float = 8.0
    start_window_s: float = 30.0
    # Only used for the nominal arrival_s of later turns (open loop uses it as the real gap).
    nominal_decode_s_per_token: float = 0.02
    max_context_tokens: int = 131_072
    vocab_size: int = 128_000
    hash_block_size: int = 16
    closed_loop: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        positive = ("num_conversations", "min_turns", "max_turns", "system_prompt_tokens",
                    "first_user_tokens", "user_tokens", "output_tokens", "max_context_tokens",
                    "vocab_size", "hash_block_size")
        for name in positive:
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise ValueError(f"AgentConfig: {name} must be a positive int, got {v!r}")
        if self.max_turns < self.min_turns:
            raise ValueError(f"AgentConfig: max_turns={self.max_turns} < "
                             f"min_turns={self.min_turns}")
        most = self.num_conversations * self.max_turns
        if most > MAX_AGENT_REQUESTS:
            raise ValueError(f"AgentConfig: num_conversations={self.num_conversations} x "
                             f"max_turns={self.max_turns} may make {most:,} requests, more than "
                             f"the generator's limit of {MAX_AGENT_REQUESTS:,}")
        for name in ("length_sigma", "think_s_mean", "start_window_s",
                     "nominal_decode_s_per_token"):
            v = getattr(self, name)
            if not is_finite_number(v) or v < 0:
                raise ValueError(f"AgentConfig: {name} must be finite and >= 0, got {v!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"AgentConfig: seed must be an int >= 0, got {self.seed!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def _lognormal_len(rng: np.random.Generator, median: int, sigma: float) -> int:
    return max(1, round(median * math.exp(sigma * rng.standard_normal())))


class _Conversation:
    """A growing token history and the chain hashes of its full blocks."""

    __slots__ = ("b", "hashes", "tail")

    def __init__(self, b: int) -> None:
        self.b = b
        self.hashes: list[int] = []
        self.tail = np.empty(0, dtype=np.int64)  # tokens past the last full block

    def append(self, tokens: np.ndarray) -> None:
        tail = np.concatenate([self.tail, tokens])
        parent = self.hashes[-1] if self.hashes else None
        new = chain_hashes(tail, self.b, parent=parent)
        self.hashes.extend(new)
        self.tail = tail[len(new) * self.b:]


def agent_workload(config: AgentConfig | None = None, /, **overrides) -> Workload:
    """A multi-turn agent workload, deterministic for a given config (``seed`` included).

    ``overrides`` replace fields of ``config`` (or of the defaults), e.g.
    ``agent_workload(num_conversations=100, seed=3)``.

    Every turn followed by another turn of its conversation has hint ``"continue"`` (the agent's
    turn ended in a tool call, so the next turn comes); the last turn of each conversation has
    ``"close"``. The hints are assigned after the turns are drawn and feed no random stream.
    """
    if config is None:
        config = AgentConfig()
    if overrides:
        known = {f.name for f in fields(AgentConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"agent_workload: unknown parameter(s) {unknown}; "
                             f"known: {sorted(known)}")
        config = AgentConfig(**{**config.to_dict(), **overrides})
    c = config
    b = c.hash_block_size
    streams = np.random.SeedSequence(c.seed).spawn(c.num_conversations + 1)
    shared_rng = np.random.default_rng(streams[0])
    system = shared_rng.integers(0, c.vocab_size, c.system_prompt_tokens, dtype=np.int64)

    requests: list[WorkloadRequest] = []
    for conv in range(c.num_conversations):
        rng = np.random.default_rng(streams[conv + 1])
        session = f"c{conv:03d}"
        turns = int(rng.integers(c.min_turns, c.max_turns + 1))
        arrival = float(rng.uniform(0.0, c.start_window_s))
        history = _Conversation(b)
        history.append(system)
        length = c.system_prompt_tokens
        prev: WorkloadRequest | None = None
        first = len(requests)
        for turn in range(turns):
            user_len = _lognormal_len(rng, c.first_user_tokens if turn == 0 else c.user_tokens,
                                      c.length_sigma)
            out_len = _lognormal_len(rng, c.output_tokens, c.length_sigma)
            think = 0.0 if turn == 0 else float(rng.exponential(c.think_s_mean))
            if length + user_len + out_len > c.max_context_tokens:
                break
            history.append(rng.integers(0, c.vocab_size, user_len, dtype=np.int64))
            prompt_len = length + user_len
            history.append(rng.integers(0, c.vocab_size, out_len, dtype=np.int64))
            length = prompt_len + out_len
            if prev is not None:
                arrival = prev.arrival_s + prev.output_len * c.nominal_decode_s_per_token + think
            req = WorkloadRequest(
                request_id=f"{session}t{turn:02d}",
                arrival_s=arrival,
                prompt_len=prompt_len,
                output_len=out_len,
                hashes=np.array(history.hashes[: length // b], dtype=np.uint64),
                session=session,
                after=prev.request_id if (c.closed_loop and prev is not None) else None,
                think_s=think,
                hint="continue",
            )
            requests.append(req)
            prev = req
        if len(requests) > first:
            requests[-1] = replace(requests[-1], hint="close")
    requests.sort(key=lambda r: (r.arrival_s, r.request_id))
    name = f"agent(conv={c.num_conversations},turns={c.min_turns}-{c.max_turns},seed={c.seed})"
    return Workload(requests, b, name)
