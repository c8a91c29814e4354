"""The CPU-tier setups, as compositions of policy axes: the one vocabulary of the simulator,
the benchmarks and the connector's settings (``kvtriton.vllm.config.ConnectorConfig.for_setup``).

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
eviction    ``lru``, ``arc``, ``s3fifo``; ``nextuse`` is the oracle:    ``lru``
            evict the block whose next use in trace order is furthest
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
capacity    ``inf``: a CPU tier that holds every distinct block        sized
========== ========================================================= ==========

``none`` alone is the GPU prefix cache without a CPU tier. ``eager+restore+tail+arc`` is the
bounded-free ARC setup with unbounded re-store. The first names of these setups stay accepted as
presets (``TIER_POLICIES``: ``control`` is ``eager``), but every default and result names a
composition. ``lazy`` with ``restore`` is refused: a lazy tier stores only blocks the
GPU is about to evict, and a running request's blocks are never on the GPU free queue, so there
is nothing to re-store. ``eager`` with ``hinted`` is refused too: an eager store happens when the
block is computed, before the turn's hint is known.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvtriton.planner import PlannerConfig

__all__ = [
    "ABLATION",
    "BOUNDS",
    "DEFAULT_POLICIES",
    "HINTED_COMBINED",
    "NEXT_USE_BOUNDS",
    "TIER_POLICIES",
    "TierPolicy",
    "parse_policy",
    "tier_policy",
]

# Eviction rules a composition may name; ``nextuse`` needs the simulator's knowledge of the
# trace's future and exists only there.
ONLINE_EVICTIONS = ("lru", "arc", "s3fifo")
ORACLE_EVICTIONS = ("nextuse",)
DEFAULT_PROTECT_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class TierPolicy:
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
    #: The CPU tier holds every distinct block of the workload (a bound, not a setup).
    infinite_cpu: bool = False
    #: The composition this setup is, in canonical axis order.
    composition: str = ""

    @property
    def oracle(self) -> bool:
        """Whether the setup uses knowledge of the future (a bound, not an online policy)."""
        return self.cpu_eviction in ORACLE_EVICTIONS or self.infinite_cpu

    @property
    def hints(self) -> bool:
        return self.hint_protect_share is not None

    @property
    def lookahead(self) -> bool:
        return self.waiting_protect_share is not None


def _share(token: str, value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = float("nan")
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"policy axis {token!r}: the share must be a number in [0, 1], "
                         f"got {value!r}")
    return f


def _canonical(store: str, restore: bool, share: float | None, free: str, eviction: str,
               admission: str, protect: float | None, infinite: bool, refresh: bool,
               waiting: float | None) -> str:
    parts = [store]
    if restore:
        parts.append("restore" if share is None else f"restore:{share:g}")
    if free == "tail_first":
        parts.append("tail")
    if eviction != "lru":
        parts.append(eviction)
    if admission != "all":
        parts.append(admission)
    if refresh:
        parts.append("refresh")
    if protect is not None:
        parts.append("hints" if protect == DEFAULT_PROTECT_SHARE else f"hints:{protect:g}")
    if waiting is not None:
        parts.append("waiting" if waiting == DEFAULT_PROTECT_SHARE else f"waiting:{waiting:g}")
    if infinite:
        parts.append("inf")
    return "+".join(parts)


def _describe(store: str, restore: bool, share: float | None, free: str, eviction: str,
              admission: str, protect: float | None, infinite: bool, refresh: bool,
              waiting: float | None) -> str:
    words = ["lazy (store on GPU eviction)" if store == "lazy" else "eager stores"]
    if restore:
        words.append("re-store" if share is None
                     else f"re-store while running requests hold < {share:.0%} of the tier")
    words.append("tail first" if free == "tail_first" else "head first")
    words.append({"nextuse": "next-use eviction (oracle)"}.get(eviction, eviction.upper()))
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
    if infinite:
        words.append("unbounded CPU tier")
    return ", ".join(words)


def parse_policy(spec: str, name: str | None = None) -> TierPolicy:
    """The ``TierPolicy`` a composition such as ``eager+restore+tail+arc`` names.

    ``ValueError`` naming the value for an unknown axis value, an axis given twice, or a
    contradictory combination."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"policy must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec == "none":
        return TierPolicy(name or "none", None, "lru", "GPU prefix cache only",
                          composition="none")
    seen: dict[str, str] = {}
    store, restore, share, free, eviction, admission = "eager", False, None, "head_first", \
        "lru", "all"
    protect: float | None = None
    waiting: float | None = None
    infinite = False
    refresh = False

    def axis(which: str, token: str) -> None:
        if which in seen:
            raise ValueError(f"policy {spec!r}: {seen[which]!r} and {token!r} both set the "
                             f"{which}")
        seen[which] = token

    for token in spec.split("+"):
        head, _, arg = token.partition(":")
        if token in ("eager", "lazy"):
            axis("store mode", token)
            store = token
        elif head == "restore":
            axis("re-store", token)
            restore = True
            share = _share(token, arg) if arg else None
        elif token in ("head", "tail"):
            axis("free order", token)
            free = "tail_first" if token == "tail" else "head_first"
        elif token in ONLINE_EVICTIONS or token in ORACLE_EVICTIONS:
            axis("eviction", token)
            eviction = token
        elif token in ("all", "second", "hinted"):
            axis("admission", token)
            admission = token
        elif head == "hints":
            axis("hints", token)
            protect = _share(token, arg) if arg else DEFAULT_PROTECT_SHARE
        elif head == "waiting":
            axis("lookahead", token)
            waiting = _share(token, arg) if arg else DEFAULT_PROTECT_SHARE
        elif token == "inf":
            axis("capacity", token)
            infinite = True
        elif token == "refresh":
            axis("recency", token)
            refresh = True
        else:
            raise ValueError(
                f"policy {spec!r}: unknown axis value {token!r}; known: eager, lazy, restore, "
                f"restore:F, head, tail, {', '.join(ONLINE_EVICTIONS + ORACLE_EVICTIONS)}, all, "
                f"second, hinted, refresh, hints, hints:F, waiting, waiting:F, inf; presets: "
                f"{', '.join(TIER_POLICIES)}")
    if store == "lazy" and restore:
        raise ValueError(f"policy {spec!r}: 'lazy' with 're-store' means nothing: a lazy tier "
                         "stores only blocks on the GPU free queue, and a running request's "
                         "blocks are never there")
    if eviction in ORACLE_EVICTIONS and protect is not None:
        raise ValueError(f"policy {spec!r}: 'hints' with {eviction!r} means nothing: the "
                         "oracle already knows every next use")
    if eviction in ORACLE_EVICTIONS and waiting is not None:
        raise ValueError(f"policy {spec!r}: 'waiting' with {eviction!r} means nothing: the "
                         "oracle already knows every next use")
    if protect is not None and waiting is not None:
        raise ValueError(f"policy {spec!r}: 'hints' and 'waiting' both protect blocks in one "
                         "segment of the tier; use one of them")
    if store == "lazy" and admission == "second":
        raise ValueError(f"policy {spec!r}: 'second' admission applies to eager stores; a lazy "
                         "tier already stores only what the GPU evicts")
    if store == "eager" and admission == "hinted":
        raise ValueError(f"policy {spec!r}: 'hinted' admission needs 'lazy': an eager store "
                         "happens when a block is computed, before the turn's hint is known")
    args = (store, restore, share, free, eviction, admission, protect, infinite, refresh, waiting)
    canonical = _canonical(*args)
    planner = PlannerConfig(restore=restore, cpu_free_order=free, restore_share=share,
                            lazy=store == "lazy", admission=admission,
                            refresh_on_gpu_hit=refresh)
    return TierPolicy(name or canonical, planner, eviction, _describe(*args),
                      hint_protect_share=protect, waiting_protect_share=waiting,
                      infinite_cpu=infinite, composition=canonical)


_PRESETS = {
    "no_cpu": "none",
    "control": "eager+head+lru",
    "restore": "eager+restore",
    "restore_tail": "eager+restore+tail",
    # Running requests' blocks may hold up to half of the CPU tier before re-stores stop: past
    # that a re-store mostly evicts another running request's block (see the thrash counts).
    "restore_tail_bounded": "eager+restore:0.5+tail",
    "restore_tail_bounded_arc": "eager+restore:0.5+tail+arc",
    "restore_tail_bounded_s3fifo": "eager+restore:0.5+tail+s3fifo",
}

TIER_POLICIES: dict[str, TierPolicy] = {n: parse_policy(s, n) for n, s in _PRESETS.items()}
TIER_POLICIES["control"] = replace(
    TIER_POLICIES["control"],
    description="cursor-only stores as vLLM's SimpleCPUOffloadConnector, head first, LRU")

#: What ``simulate`` runs when given no setups: the presets' compositions, in their order.
DEFAULT_POLICIES = tuple(p.composition for p in TIER_POLICIES.values())

#: Every axis changed alone from the control (the ablation the benchmark runs).
ABLATION = ("eager", "eager+restore", "eager+restore:0.5", "eager+tail", "eager+arc",
            "eager+s3fifo", "eager+second", "eager+refresh", "eager+hints", "eager+waiting",
            "lazy")

#: Combinations of the axes that pay, run beside the ablation.
COMBINED = ("lazy+hints", "lazy+hinted", "lazy+hinted+hints", "eager+refresh+arc",
            "eager+restore:0.5+tail+arc")
#: The combinations that use hints (the first of ``COMBINED``).
HINTED_COMBINED = COMBINED[:3]

#: The bounds measured in the same serving loop: next-use eviction under either store mode
#: (the in-loop Belady bound is the better of the two), and a tier that never evicts.
BOUNDS = ("eager+nextuse", "lazy+nextuse", "eager+inf")
NEXT_USE_BOUNDS = ("eager+nextuse", "lazy+nextuse")


def tier_policy(name: str) -> TierPolicy:
    """A preset by name, or a composition (``parse_policy``)."""
    if name in TIER_POLICIES:
        return TIER_POLICIES[name]
    try:
        return parse_policy(name)
    except ValueError as e:
        if "+" not in name and name not in ("eager", "lazy", "none"):
            raise ValueError(f"unknown policy {name!r}; presets: {', '.join(TIER_POLICIES)}; "
                             f"or a composition of axis values joined by '+' ({e})") from None
        raise
