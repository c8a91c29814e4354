"""The CPU-tier setups, as compositions of setup axes: the one vocabulary of the simulator,
the benchmarks and the connector's settings (``kvtriton.vllm.config.extra_config_for``).

A setup is written as axis values joined by ``+``, in any order, each axis at most once; an axis
left out takes its default (the control's value):

========== ========================================================= ==========
axis        values                                                    default
========== ========================================================= ==========
store       ``eager`` (every computed block, as vLLM's connector),     ``eager``
            ``lazy`` (on GPU eviction only: an exclusive victim tier)
re-store    ``restore`` (re-store running requests' evicted blocks),   off
            ``restore:F`` (only while they hold < F of the tier)
free order  ``head`` (ascending, vLLM's), ``tail`` (chain head last)   ``head``
eviction    ``lru``, ``arc``, ``s3fifo``, ``lfu`` (least demand first:   ``lru``
            a sketch of admitted requests' keys), ``lfu:W`` (its
            counters halve every W tier sizes of sightings, 0: never),
            ``reqlru`` and ``reqarc`` (vLLM 0.33's offloading LRU and
            ARC: requests give recency and reuse, a request's tail
            before its head);
            ``nextuse`` is the oracle: evict the block whose next use
            in trace order is furthest
admission   ``all``, ``second`` (store a key on its second sight, as   ``all``
            SGLang HiCache's ``write_through_selective``), ``hinted``
            (lazy only: never offload a key whose last holder closed
            its session)
recency     ``refresh``: a GPU prefix hit also refreshes the CPU       off
            copies of the hit blocks (recency follows every hit)
hints       ``hints`` (protect blocks of a turn hinted ``continue`` in  off
            up to half the tier, evict a closed session's first),
            ``hints:F`` (protect up to F of the tier)
lookahead   ``waiting`` (protect the keys of requests in the waiting    off
            queue, up to half the tier, until they are admitted),
            ``waiting:F`` (up to F of the tier)
sessions    ``sessions`` (protect a finished turn's blocks for its      off
            session's next turn, up to half the tier, the session
            unheard from longest let go first; a session silent for
            300 s ages out), ``sessions:S`` (ages out after S s)
capacity    ``inf``: a CPU tier that holds every distinct block        sized
second tier ``shared``: a store under the CPU tier, shared by every   off
            replica (Mooncake Store in vLLM, ``second_tier``)
========== ========================================================= ==========

``none`` alone is the GPU prefix cache without a CPU tier. ``eager+restore+tail+arc`` is the
bounded-free ARC setup with unbounded re-store. A setup has one spelling, its composition: the
preset names of earlier versions (``REMOVED_PRESETS``) are refused with the composition to
write. The grammar is written once, as data: ``AXES`` (the axes, their values and
defaults, from which the CLI's help is generated) and ``REFUSED`` (the combinations that mean
nothing, each with its reason, e.g. ``lazy`` with ``restore``: a lazy tier stores only blocks
on the GPU free queue, where a running request's blocks never are). A share ``F`` (in [0, 1]),
a window ``W`` (>= 0, finite) and seconds ``S`` (in (0, ``MAX_SESSION_IDLE_S``], one day) are
written in the one number syntax the CLI's flags read too (``NUMBER``, ``read_number``):
digits, an optional point and an optional exponent ``e`` with digits and no sign (``1000``,
``0.5``, ``1e3``; ``1e+3`` could not be written, '+' joins axes); a composition has no spaces.
The canonical name writes each number one way (``canonical_number``: the shortest decimal that
reads back as the same float, never an exponent), so every name printed parses back to the
setup it names: ``eager+sessions:1e3`` is ``eager+sessions:1000``, ``restore:0.00001`` never
``restore:1e-05``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal

from kvtriton.eviction.lfu import DEFAULT_WINDOW_TIERS
from kvtriton.planner import PlannerConfig

__all__ = [
    "AXES",
    "CONTROL",
    "DEFAULT_SETUP",
    "DEFAULT_SETUPS",
    "MAX_SESSION_IDLE_S",
    "NATIVE_SETUPS",
    "NEXT_USE_REFERENCES",
    "NUMBER",
    "NUMBER_SYNTAX",
    "REFERENCES",
    "REFUSED",
    "REMOVED_PRESETS",
    "UPPER_BOUND_SETUPS",
    "TierSetup",
    "canonical_number",
    "grammar_help",
    "parse_setup",
    "read_number",
    "tier_setup",
]

# Eviction rules a composition may name; ``nextuse`` needs the simulator's knowledge of the
# trace's future and exists only there.
ONLINE_EVICTIONS = ("lru", "arc", "s3fifo", "lfu", "reqlru", "reqarc")
ORACLE_EVICTIONS = ("nextuse",)
DEFAULT_PROTECT_SHARE = 0.5
#: How long a session may stay silent before ``sessions`` lets its blocks go: the 5 minutes of
#: Anthropic's default prompt-cache TTL (``cache_control``), the retention clients already know.
DEFAULT_SESSION_IDLE_S = 300.0
#: The longest idle time ``sessions:S`` may name: one day. A session silent longer is gone, and
#: a larger S would keep a closed session's blocks protected for the whole run.
MAX_SESSION_IDLE_S = 86400.0

#: How a number is written, in a composition and on the command line alike: digits, an optional
#: point and an optional exponent ``e`` with digits, no sign (a '+' joins axes), space or ``_``.
NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[0-9]+)?")
NUMBER_SYNTAX = ("a number is digits, an optional point and an optional exponent e<digits>, "
                 "no sign or space: 1000, 0.5, 1e3")


@dataclass(frozen=True)
class Axis:
    """One axis of a composition: its values (``NAME:F`` takes a share F in [0, 1]), the value
    it has when left out (None: off) and what it does, for the help text."""

    name: str
    values: tuple[str, ...]
    default: str | None
    help: str


#: The grammar: every axis, each value at most once per composition.
AXES = (
    Axis("store", ("eager", "lazy"), "eager",
         "eager: every computed block, as vLLM's connector; lazy: on GPU eviction only"),
    Axis("re-store", ("restore", "restore:F"), None,
         "re-store running requests' evicted blocks (while they hold < F of the tier)"),
    Axis("free order", ("head", "tail"), "head", "chain head first (vLLM's) or last"),
    Axis("eviction", (*ONLINE_EVICTIONS, "lfu:W", *ORACLE_EVICTIONS), "lru",
         "the CPU tier's eviction; lfu: least demand first (its sketch halves every W tier "
         "sizes of sightings); reqlru, reqarc: vLLM 0.33's offloading LRU and ARC (requests "
         "rank keys, tail before head, a finish commits); nextuse is the oracle (furthest next "
         "use in trace order)"),
    Axis("admission", ("all", "second", "hinted"), "all",
         "second: store a key on its second sight; hinted (lazy): skip closed sessions' keys"),
    Axis("recency", ("refresh",), None, "a GPU prefix hit refreshes the CPU copies too"),
    Axis("hints", ("hints", "hints:F"), None,
         "protect turns hinted continue in up to F of the tier (0.5), closed sessions go first"),
    Axis("lookahead", ("waiting", "waiting:F"), None,
         "protect waiting requests' keys in up to F of the tier (0.5) until admitted"),
    Axis("sessions", ("sessions", "sessions:S"), None,
         "protect a finished turn's blocks for its session's next turn, up to half the tier, "
         "the longest-silent session let go first; a session silent S seconds (300) ages out"),
    Axis("capacity", ("inf",), None, "a CPU tier that holds every distinct block (a bound)"),
    Axis("second tier", ("shared",), None,
         "a store under the CPU tier shared by every replica: written through, fetched from "
         "where the CPU hit ends (vLLM: the second_tier setting, Mooncake Store)"),
)

_TOKENS = {v.split(":")[0]: axis for axis in AXES for v in axis.values}
_TAKES_SHARE = {v.split(":")[0] for axis in AXES for v in axis.values if v.endswith(":F")}
_TAKES_WINDOW = {v.split(":")[0] for axis in AXES for v in axis.values
                 if v.endswith((":W", ":S"))}

#: Compositions refused, each as the axis values that together mean nothing (an axis left out
#: counts at its default), and why.
REFUSED: tuple[tuple[dict[str, tuple[str, ...]], str], ...] = (
    ({"store": ("lazy",), "re-store": ("restore",)},
     "'lazy' with 're-store' means nothing: a lazy tier stores only blocks on the GPU free "
     "queue, and a running request's blocks are never there"),
    ({"store": ("lazy",), "admission": ("second",)},
     "'second' admission applies to eager stores; a lazy tier already stores only what the "
     "GPU evicts"),
    ({"store": ("eager",), "admission": ("hinted",)},
     "'hinted' admission needs 'lazy': an eager store happens when a block is computed, before "
     "the turn's hint is known"),
    ({"eviction": ORACLE_EVICTIONS, "hints": ("hints",)},
     "'hints' with 'nextuse' means nothing: the oracle already knows every next use"),
    ({"eviction": ORACLE_EVICTIONS, "lookahead": ("waiting",)},
     "'waiting' with 'nextuse' means nothing: the oracle already knows every next use"),
    ({"hints": ("hints",), "lookahead": ("waiting",)},
     "'hints' and 'waiting' both protect blocks in one segment of the tier; use one of them"),
    ({"hints": ("hints",), "sessions": ("sessions",)},
     "'hints' and 'sessions' both protect blocks in one segment of the tier; use one of them"),
    ({"lookahead": ("waiting",), "sessions": ("sessions",)},
     "'waiting' and 'sessions' both protect blocks in one segment of the tier; use one of "
     "them"),
    ({"eviction": ORACLE_EVICTIONS, "sessions": ("sessions",)},
     "'sessions' with 'nextuse' means nothing: the oracle already knows every next use"),
    ({"capacity": ("inf",), "eviction": ("arc", "s3fifo", "lfu", "reqlru", "reqarc",
                                         *ORACLE_EVICTIONS)},
     "'inf' with an eviction rule means nothing: an unbounded tier never evicts"),
    ({"capacity": ("inf",), "hints": ("hints",)},
     "'inf' with 'hints' means nothing: an unbounded tier never evicts, nothing needs "
     "protecting"),
    ({"capacity": ("inf",), "lookahead": ("waiting",)},
     "'inf' with 'waiting' means nothing: an unbounded tier never evicts, nothing needs "
     "protecting"),
    ({"capacity": ("inf",), "sessions": ("sessions",)},
     "'inf' with 'sessions' means nothing: an unbounded tier never evicts, nothing needs "
     "protecting"),
    ({"capacity": ("inf",), "re-store": ("restore",)},
     "'inf' with 're-store' means nothing: an unbounded tier never evicts a running request's "
     "blocks"),
    ({"capacity": ("inf",), "store": ("lazy",)},
     "'inf' with 'lazy': the unbounded tier is the bound for every store mode, written "
     "'eager+inf' (a lazy tier would hold only what the GPU happened to evict)"),
)


def grammar_help() -> str:
    """The grammar in one paragraph, for ``--help``: every axis and its values."""
    axes = "; ".join(f"{a.name}: {'|'.join(a.values)}" for a in AXES)
    return (f"compositions of axis values joined by '+', each axis at most once, defaults left "
            f"out ({axes}); 'none' is no CPU tier")


@dataclass(frozen=True, slots=True)
class TierSetup:
    """A CPU tier setup: planner switches (``None``: no CPU tier), the CPU pool's eviction, and
    the simulator-side axes (hints, oracle eviction, unbounded capacity)."""

    name: str
    planner: PlannerConfig | None
    cpu_eviction: str
    description: str
    #: Share of the tier that blocks hinted ``continue`` may hold protected (None: hints off).
    hint_protect_share: float | None = None
    #: Share of the tier the keys of waiting requests may hold protected (None: lookahead off).
    waiting_protect_share: float | None = None
    #: Seconds a session may stay silent before its protection ages out (None: sessions off).
    session_idle_s: float | None = None
    #: The CPU tier holds every distinct block of the workload (a bound, not a setup).
    infinite_cpu: bool = False
    #: The composition this setup is, in canonical axis order.
    composition: str = ""
    #: A second tier under the CPU tier, shared by every replica (``kvtriton.second_tier``).
    second_tier: bool = False

    @property
    def oracle(self) -> bool:
        """Whether the setup uses knowledge of the future (a bound, not an online setup)."""
        return self.cpu_eviction in ORACLE_EVICTIONS or self.infinite_cpu

    @property
    def hints(self) -> bool:
        return self.hint_protect_share is not None

    @property
    def lookahead(self) -> bool:
        return self.waiting_protect_share is not None

    @property
    def sessions(self) -> bool:
        return self.session_idle_s is not None

    def eviction_bytes(self, num_blocks: int) -> int:
        """Host bytes the CPU tier's eviction queue allocates for a pool of ``num_blocks`` blocks
        (the null block included) besides the blocks: the ``lfu`` sketch; 0 for the others. The
        claims of hints and sessions: ``kvtriton.tier_signals.claim_bytes``."""
        if self.planner is None or self.cpu_eviction in ORACLE_EVICTIONS:
            return 0
        from kvtriton.eviction import make_eviction_queue

        return make_eviction_queue(self.cpu_eviction).memory_bytes(num_blocks)


def canonical_number(value: float) -> str:
    """``value`` (finite, >= 0) as a composition writes it: digits and a point only, the
    shortest decimal that reads back as the same float (``repr``'s digits without its exponent),
    an integer without a point: ``1e-05`` is ``0.00001``, ``1e+06`` is ``1000000``."""
    text = format(Decimal(repr(float(value))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def read_number(text: str) -> Decimal:
    """``text`` written in the one number syntax (``NUMBER``), exactly; ``ValueError`` naming
    ``text`` and the syntax otherwise."""
    if not isinstance(text, str) or not NUMBER.fullmatch(text):
        raise ValueError(f"{text!r} is not a number ({NUMBER_SYNTAX})")
    return Decimal(text)


def _axis_number(token: str, value: str, what: str, low: float, high: float,
                 low_open: bool = False) -> float:
    """``value``, the number of the axis value ``token``, as a float in [low, high] ((low, high]
    with ``low_open``); ``ValueError`` naming the token, ``what`` it must be and the value."""
    try:
        f = float(read_number(value))
    except ValueError:
        raise ValueError(f"setup axis {token!r}: {what}, got {value!r} ({NUMBER_SYNTAX})") \
            from None
    if not (low < f if low_open else low <= f) or not f <= high or not math.isfinite(f):
        raise ValueError(f"setup axis {token!r}: {what}, got {value!r}")
    return f


def _share(token: str, value: str) -> float:
    return _axis_number(token, value, "the share must be a number in [0, 1]", 0.0, 1.0)


def _window(token: str, value: str) -> float:
    if token.startswith("sessions"):
        return _axis_number(token, value, "the idle time must be seconds in (0, "
                            f"{canonical_number(MAX_SESSION_IDLE_S)}] (MAX_SESSION_IDLE_S: one "
                            "day)", 0.0, MAX_SESSION_IDLE_S, low_open=True)
    return _axis_number(token, value, "the window must be a finite number >= 0", 0.0, math.inf)


def _canonical(store: str, restore: bool, share: float | None, free: str, eviction: str,
               admission: str, protect: float | None, infinite: bool, refresh: bool,
               waiting: float | None, shared: bool = False,
               sessions: float | None = None) -> str:
    parts = [store]
    if restore:
        parts.append("restore" if share is None else f"restore:{canonical_number(share)}")
    if free == "tail_first":
        parts.append("tail")
    if eviction != "lru":
        parts.append(eviction)
    if admission != "all":
        parts.append(admission)
    if refresh:
        parts.append("refresh")
    if protect is not None:
        parts.append("hints" if protect == DEFAULT_PROTECT_SHARE
                     else f"hints:{canonical_number(protect)}")
    if waiting is not None:
        parts.append("waiting" if waiting == DEFAULT_PROTECT_SHARE
                     else f"waiting:{canonical_number(waiting)}")
    if sessions is not None:
        parts.append("sessions" if sessions == DEFAULT_SESSION_IDLE_S
                     else f"sessions:{canonical_number(sessions)}")
    if infinite:
        parts.append("inf")
    if shared:
        parts.append("shared")
    return "+".join(parts)


def _describe(store: str, restore: bool, share: float | None, free: str, eviction: str,
              admission: str, protect: float | None, infinite: bool, refresh: bool,
              waiting: float | None, shared: bool = False,
              sessions: float | None = None) -> str:
    words = ["lazy (store on GPU eviction)" if store == "lazy" else "eager stores"]
    if restore:
        words.append("re-store" if share is None
                     else f"re-store while running requests hold < {share:.0%} of the tier")
    words.append("tail first" if free == "tail_first" else "head first")
    if eviction.startswith("lfu"):
        window = eviction.partition(":")[2]
        aging = {"": "", "0": ", no aging"}.get(window, f", aging every {window} tier sizes")
        words.append(f"LFU (least admitted-request demand first{aging})")
    else:
        words.append({"nextuse": "next-use eviction (oracle)",
                      "reqlru": "request-scoped LRU (vLLM 0.33's)",
                      "reqarc": "request-scoped ARC (vLLM 0.33's)"}.get(eviction,
                                                                      eviction.upper()))
    if admission == "second":
        words.append("store on second sight")
    elif admission == "hinted":
        words.append("closed sessions not offloaded")
    if refresh:
        words.append("GPU hits refresh the CPU copies")
    if protect is not None:
        words.append(f"hints (protect <= {protect:.0%})")
    if waiting is not None:
        words.append(f"waiting-queue lookahead (protect <= {waiting:.0%})")
    if sessions is not None:
        words.append(f"sessions (protect <= {DEFAULT_PROTECT_SHARE:.0%}, silent "
                     f"{canonical_number(sessions)} s: aged out)")
    if infinite:
        words.append("unbounded CPU tier")
    if shared:
        words.append("shared second tier")
    return ", ".join(words)


def parse_setup(spec: str, name: str | None = None) -> TierSetup:
    """The ``TierSetup`` a composition such as ``eager+restore+tail+arc`` names.

    ``ValueError`` naming the value for an unknown axis value, an axis given twice, or a
    contradictory combination."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"setup must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec == "none":
        return TierSetup(name or "none", None, "lru", "GPU prefix cache only",
                          composition="none")
    if any(c.isspace() for c in spec):
        raise ValueError(f"setup {spec!r}: a composition has no spaces (axis values joined by "
                         "'+', e.g. eager+restore:0.5)")
    seen: dict[str, str] = {}  # axis name -> the token that set it
    values: dict[str, str] = {}  # axis name -> its value, without the share
    shares: dict[str, float] = {}
    windows: dict[str, float] = {}
    for token in spec.split("+"):
        head, colon, arg = token.partition(":")
        axis = _TOKENS.get(head)
        if axis is None or (colon and head not in _TAKES_SHARE | _TAKES_WINDOW):
            raise ValueError(
                f"setup {spec!r}: unknown axis value {token!r}; known: "
                f"{', '.join(v for a in AXES for v in a.values)}")
        if axis.name in seen:
            raise ValueError(f"setup {spec!r}: {seen[axis.name]!r} and {token!r} both set the "
                             f"{axis.name}")
        seen[axis.name] = token
        values[axis.name] = head
        if colon and head in _TAKES_WINDOW:
            windows[axis.name] = _window(token, arg)
        elif colon:
            shares[axis.name] = _share(token, arg)
    resolved = {a.name: values.get(a.name, a.default) for a in AXES}
    for condition, reason in REFUSED:
        if all(resolved[name] in allowed for name, allowed in condition.items()):
            raise ValueError(f"setup {spec!r}: {reason}")
    store, eviction = resolved["store"], resolved["eviction"]
    # The queue's name carries its window (``make_eviction_queue`` reads it); the default window
    # is spelled without one.
    if windows.get("eviction", DEFAULT_WINDOW_TIERS) != DEFAULT_WINDOW_TIERS:
        eviction = f"{eviction}:{canonical_number(windows['eviction'])}"
    admission = resolved["admission"]
    restore = resolved["re-store"] is not None
    share = shares.get("re-store")
    free = "tail_first" if resolved["free order"] == "tail" else "head_first"
    protect = (shares.get("hints", DEFAULT_PROTECT_SHARE) if resolved["hints"] is not None
               else None)
    waiting = (shares.get("lookahead", DEFAULT_PROTECT_SHARE)
               if resolved["lookahead"] is not None else None)
    infinite = resolved["capacity"] is not None
    refresh = resolved["recency"] is not None
    shared = resolved["second tier"] is not None
    sessions = (windows.get("sessions", DEFAULT_SESSION_IDLE_S)
                if resolved["sessions"] is not None else None)
    args = (store, restore, share, free, eviction, admission, protect, infinite, refresh, waiting,
            shared, sessions)
    canonical = _canonical(*args)
    planner = PlannerConfig(restore=restore, cpu_free_order=free, restore_share=share,
                            lazy=store == "lazy", admission=admission,
                            refresh_on_gpu_hit=refresh)
    return TierSetup(name or canonical, planner, eviction, _describe(*args),
                      hint_protect_share=protect, waiting_protect_share=waiting,
                      session_idle_s=sessions, infinite_cpu=infinite, composition=canonical,
                      second_tier=shared)


#: The preset names of earlier versions, refused with the composition to write instead: a setup
#: has one spelling.
REMOVED_PRESETS = {
    "no_cpu": "none",
    "control": "eager",
    "restore_tail": "eager+restore+tail",
    "restore_tail_bounded": "eager+restore:0.5+tail",
    "restore_tail_bounded_arc": "eager+restore:0.5+tail+arc",
    "restore_tail_bounded_s3fifo": "eager+restore:0.5+tail+s3fifo",
}

#: The control: every axis at its default, the rules of vLLM's ``SimpleCPUOffloadConnector``
#: (eager stores, head first, LRU, no re-store). Studies measure every setup against it. Like
#: every setup it holds a finished request's GPU table until its stores land
#: (``PlannerConfig.hold_finished``), which vLLM's connector does not: what that costs vLLM is
#: ``bench.tier_study.finish_free_order``'s, not the study's.
CONTROL = "eager"

#: vLLM 0.33's ``OffloadingConnector``, the native connector a user would pick instead, as
#: setups: eager stores of every computed block with its eviction policies, the per-request
#: tail-first LRU (``reqlru``) and its ARC (``reqarc``: use counted per request, as vLLM counts
#: it; kvtriton's own ``arc`` counts differently), both checked against vLLM's own policy
#: classes (``bench/conformance/native_policies.py``). Every study table runs them beside the
#: control.
NATIVE_SETUPS = {"eager+reqlru": "vLLM 0.33 OffloadingConnector, LRU",
                 "eager+reqarc": "vLLM 0.33 OffloadingConnector, ARC"}

#: What ``simulate`` runs when given no setups: no tier, the control, re-store unbounded and
#: bounded by half the tier (running requests' blocks past half of it mostly evict another
#: running request's block: see the thrash counts) with each online eviction.
DEFAULT_SETUPS = ("none", "eager", "eager+restore", "eager+restore+tail",
                    "eager+restore:0.5+tail", "eager+restore:0.5+tail+arc",
                    "eager+restore:0.5+tail+s3fifo")

#: The references measured in the same serving loop (``kvtriton.sim.references``): next-use
#: eviction under either store mode, an oracle reference that online setups can pass, and a
#: tier that never evicts, an upper bound no setup of that memory can pass.
REFERENCES = ("eager+nextuse", "lazy+nextuse", "eager+inf")
NEXT_USE_REFERENCES = ("eager+nextuse", "lazy+nextuse")
UPPER_BOUND_SETUPS = ("eager+inf",)


def tier_setup(name: str) -> TierSetup:
    """The setup a composition names (``parse_setup``); a preset name of earlier versions is a
    ``ValueError`` that says which composition to write."""
    if name in REMOVED_PRESETS:
        raise ValueError(f"{name!r} was a preset name and is no longer read (a setup has one "
                         f"spelling): write {REMOVED_PRESETS[name]!r}")
    try:
        return parse_setup(name)
    except ValueError as e:
        if isinstance(name, str) and "+" not in name and name.split(":")[0] not in _TOKENS \
                and name != "none":
            raise ValueError(f"unknown setup {name!r}: a setup is a composition of axis values "
                             f"joined by '+' ({e})") from None
        raise

#: The connector's setup when ``kv_connector_extra_config`` names none: the study's choice for a
#: workload nobody characterised (``bench/tier_study/default_setup.py`` states the rule and
#: ``paper/build.py`` checks that the results still choose it).
DEFAULT_SETUP = "eager+reqarc"
