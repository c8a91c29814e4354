"""``kv_connector_extra_config`` of ``KVTritonConnector``: every key, its unit, default and check.

The connector is configured the way vLLM configures any KV connector, through
``KVTransferConfig.kv_connector_extra_config`` (the ``--kv-transfer-config`` JSON). The CPU
tier's setup is one key, ``setup``: a composition in the vocabulary of ``kvtriton.setups``,
the string ``kvtriton simulate --setups`` takes, parsed by the same code. The other keys say
what a setup does not: the tier's size, the scan and the re-store caps.

The per-axis keys of earlier versions (``offload``, ``restore``, ``restore_share``,
``cpu_free_order``, ``cpu_eviction``) are refused at start-up: one error names them and asks for
``setup`` (their defaults were ``eager+restore+tail``, not today's default setup).

Parsing is strict: an unknown key, a value outside its allowed set, keys that contradict each
other or a setup axis the connector cannot honour in vLLM is one ``ValueError`` at start-up that
names the key, before any request is served. This module imports nothing of vLLM, so the checks
run (and are tested) without it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvtriton.planner import PlannerConfig
from kvtriton.second_tier.config import SecondTierConfig, parse_second_tier
from kvtriton.setups import (
    DEFAULT_SETUP,
    ORACLE_EVICTIONS,
    TierSetup,
    tier_setup,
)
from kvtriton.tier_signals import claim_bytes, eviction_state
from kvtriton.validation import host_memory_bytes, is_int

__all__ = ["DEFAULT_CPU_BYTES_PER_RANK", "DEFAULT_SETUP", "ConnectorConfig", "check_host_memory",
           "extra_config_for", "host_memory_bytes", "parse_extra_config"]

DEFAULT_CPU_BYTES_PER_RANK = 8 << 30  # 8 GiB, vLLM SimpleCPUOffloadConnector's default size

_PREFIX = "KVTritonConnector: kv_connector_extra_config"


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """The connector's settings, one field per ``kv_connector_extra_config`` key.

    - ``setup``: the CPU tier's setup, a composition of ``kvtriton.setups`` axes, stored in
      its canonical spelling (default ``kvtriton.setups.DEFAULT_SETUP``).
    - ``cpu_bytes_per_rank``: bytes of host memory for the CPU tier on each rank (default
      8 GiB). Every rank holds the same CPU blocks, so the tier stores ``cpu_bytes_per_rank``
      of each rank's share of the KV; blocks are sized as vLLM's own offload connector sizes
      them (GPU blocks x bytes / GPU KV bytes).
    - ``max_restores_per_step``: cap on re-stores per scheduler step, blocks (default null;
      setups with re-store only).
    - ``max_restores_per_key``: a block re-stored this many times is not re-stored again
      (default null; setups with re-store only).
    - ``lazy_target_blocks``: lazy setups' GPU blocks kept offloaded ahead of eviction, > 0
      (default null: two steps' worth of ``max_num_batched_tokens``).
    - ``scan``: ``"fused"`` (default) or ``"loop"`` (the per-block reference; same selection).
    - ``scan_idle``: also scan running requests with no tokens this step (default false).
    - ``second_tier``: a Mooncake Store under the CPU tier, shared by every replica
      (``kvtriton.second_tier.config``; default null: none).
    - ``sync_load_budget_bytes``: bytes of CPU hits per scheduler step loaded in the step that
      schedules them, before its forward pass, instead of a step later (default 0: off; models
      with one KV cache group only, checked where the model is known: ``SchedulerSide``).
    """

    setup: str = DEFAULT_SETUP
    cpu_bytes_per_rank: int = DEFAULT_CPU_BYTES_PER_RANK
    max_restores_per_step: int | None = None
    max_restores_per_key: int | None = None
    lazy_target_blocks: int | None = None
    scan: str = "fused"
    scan_idle: bool = False
    second_tier: SecondTierConfig | None = None
    sync_load_budget_bytes: int = 0

    @property
    def tier(self) -> TierSetup:
        """The setup, parsed (``kvtriton.setups.TierSetup``)."""
        return tier_setup(self.setup)

    def planner_config(self, *, world_size: int, max_num_batched_tokens: int) -> PlannerConfig:
        """The planner's switches for this connector on ``world_size`` workers."""
        p = self.tier.planner
        return PlannerConfig(
            restore=p.restore,
            scan=self.scan,
            cpu_free_order=p.cpu_free_order,
            max_restores_per_step=self.max_restores_per_step,
            max_restores_per_key=self.max_restores_per_key,
            restore_share=p.restore_share,
            scan_idle=self.scan_idle,
            lazy=p.lazy,
            lazy_target_blocks=self.lazy_target_blocks,
            max_num_batched_tokens=max_num_batched_tokens,
            world_size=world_size,
            admission=p.admission,
            refresh_on_gpu_hit=p.refresh_on_gpu_hit,
        )

    def describe(self, cpu_blocks: int | None = None) -> str:
        """One line for the start-up log: the setup by name and in words, then the rest;
        with the tier's ``cpu_blocks`` (the null block included), its eviction's own memory
        where it has some (the ``lfu`` sketch)."""
        extra = [f"{k}={getattr(self, k)}" for k in
                 ("max_restores_per_step", "max_restores_per_key", "lazy_target_blocks")
                 if getattr(self, k) is not None]
        sketch = self.tier.eviction_bytes(cpu_blocks) if cpu_blocks is not None else 0
        claims = claim_bytes(self.tier, cpu_blocks) if cpu_blocks is not None else 0
        return (f"setup {self.setup} ({self.tier.description}), "
                f"CPU {self.cpu_bytes_per_rank / 2**30:.2f} GiB/rank"
                + (f" + LFU sketch {sketch / 2**20:.1f} MiB" if sketch else "")
                + (f" + claims <= {claims / 2**20:.1f} MiB" if claims else "")
                + f", scan {self.scan}"
                + (" (idle too)" if self.scan_idle else "")
                + (f", {', '.join(extra)}" if extra else "")
                + (f", sync loads <= {self.sync_load_budget_bytes / 2**20:.2f} MiB/step"
                   if self.sync_load_budget_bytes else ", sync loads off")
                + (f"; {self.second_tier.describe()}" if self.second_tier else ""))


def extra_config_for(tier: TierSetup) -> dict[str, Any]:
    """The ``kv_connector_extra_config`` that runs ``setup`` (a ``kvtriton.setups`` setup) in
    the connector: ``{"setup": <its composition>}``. ``ValueError`` for a setup with no CPU tier
    or with an axis the connector cannot honour in vLLM (``refusal``)."""
    if tier.planner is None:
        raise ValueError(f"setup {tier.name!r} has no CPU tier: run vLLM without the connector")
    why = refusal(tier)
    if why is not None:
        raise ValueError(f"setup {tier.name!r}: {why}")
    return {"setup": tier.composition}


def refusal(tier: TierSetup) -> str | None:
    """Why the connector cannot run ``setup`` in vLLM (None: it can). Every axis a server can
    see is honoured: hints arrive in a request's ``kv_transfer_params``, the waiting queue
    through ``on_new_request``; only the bounds that need the workload's future are not."""
    if tier.cpu_eviction in ORACLE_EVICTIONS:
        return (f"the eviction {tier.cpu_eviction!r} is an oracle: it evicts by each block's "
                "next use in the trace's future, which a server never sees; use lru, arc or "
                "s3fifo")
    if tier.infinite_cpu:
        return ("the capacity 'inf' is a bound (a tier that holds every distinct block of a "
                "trace); a server's tier holds cpu_bytes_per_rank")
    return None


# The per-axis keys of earlier versions, refused with one error that asks for ``setup``.
_AXIS_KEYS = ("offload", "restore", "restore_share", "cpu_free_order", "cpu_eviction")
_CHOICES: dict[str, tuple[str, ...]] = {"scan": ("fused", "loop")}
_OPTIONAL_COUNTS = ("max_restores_per_step", "max_restores_per_key")
_KEYS = tuple(f.name for f in fields(ConnectorConfig))


def _bad(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{_PREFIX}[{key!r}] = {value!r} is not allowed; expected {allowed}")


def _parse_setup(value: Any) -> TierSetup:
    if not isinstance(value, str):
        raise _bad("setup", value, "a setup string such as 'eager+restore+tail' or 'lazy+hints'")
    try:
        tier = tier_setup(value)
    except ValueError as e:
        raise ValueError(f"{_PREFIX}['setup'] = {value!r}: {e}") from None
    if tier.planner is None:
        raise ValueError(f"{_PREFIX}['setup'] = {value!r} has no CPU tier: run vLLM without "
                         "the connector")
    why = refusal(tier)
    if why is not None:
        raise ValueError(f"{_PREFIX}['setup'] = {value!r}: {why}")
    return tier


def _resolve_setup(extra: Mapping[str, Any]) -> TierSetup:
    """The setup ``extra`` names (the default's without ``setup``); a removed per-axis key is
    one error naming it and asking for ``setup``."""
    removed = [k for k in _AXIS_KEYS if k in extra]
    if removed:
        raise ValueError(
            f"{_PREFIX}{removed}: the per-axis keys ({', '.join(_AXIS_KEYS)}) are no longer "
            "read; the tier's setup is one key, 'setup', a composition of kvtriton.setups "
            "axes such as 'eager+restore+tail+arc' (kvtriton simulate --help lists them; "
            "these keys' defaults were eager+restore+tail)")
    return _parse_setup(extra["setup"]) if "setup" in extra else tier_setup(DEFAULT_SETUP)


def parse_extra_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Check ``kv_connector_extra_config`` and return the settings; ``ValueError`` names the
    first unknown key (with the known ones), bad value (with what it accepts) or key that
    contradicts the setup."""
    if extra is not None and not isinstance(extra, Mapping):
        looks = ""
        if isinstance(extra, str | bytes):
            with contextlib.suppress(ValueError):
                looks = (": it is JSON text; pass the object itself"
                         if isinstance(json.loads(extra), dict) else "")
        raise ValueError(f"{_PREFIX} must be a JSON object of settings (key: value), got a "
                         f"{type(extra).__name__} {extra!r:.80}{looks}")
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KEYS) - set(_AXIS_KEYS))
    if unknown:
        raise ValueError(f"KVTritonConnector: unknown kv_connector_extra_config key "
                         f"{unknown[0]!r}; known keys: {', '.join(_KEYS)}")
    for key, value in extra.items():
        if key == "cpu_bytes_per_rank":
            if not is_int(value) or value <= 0:
                raise _bad(key, value, "a positive int (bytes)")
        elif key == "sync_load_budget_bytes":
            if not is_int(value) or not 0 <= value <= host_memory_bytes():
                raise _bad(key, value, "a non-negative int (bytes per scheduler step; 0: off) "
                                       f"up to this host's memory, {host_memory_bytes()}")
        elif key == "scan_idle":
            if not isinstance(value, bool):
                raise _bad(key, value, "true or false")
        elif key in _CHOICES:
            if value not in _CHOICES[key]:
                raise _bad(key, value, "one of " + ", ".join(map(repr, _CHOICES[key])))
        elif key in _OPTIONAL_COUNTS:
            if value is not None and (not is_int(value) or value < 0):
                raise _bad(key, value, "null or a non-negative int")
        elif key == "lazy_target_blocks" and value is not None and (
                not is_int(value) or value <= 0):
            raise _bad(key, value, "null or a positive int (0 would keep nothing offloaded: "
                                   "the lazy tier would store nothing)")
    tier = _resolve_setup(extra)
    p = tier.planner
    if not p.lazy and extra.get("lazy_target_blocks") is not None:
        raise ValueError(f"{_PREFIX}['lazy_target_blocks'] = {extra['lazy_target_blocks']!r} "
                         f"with the eager setup {tier.composition!r}: it sizes a lazy tier's "
                         "offload target; use a lazy setup or drop the key")
    if not p.restore:
        for key in _OPTIONAL_COUNTS:
            if extra.get(key) is not None:
                raise ValueError(f"{_PREFIX}[{key!r}] = {extra[key]!r} with the setup "
                                 f"{tier.composition!r}, which never re-stores: the cap "
                                 "bounds re-stores; add 'restore' to the setup or drop the key")
    values = {k: v for k, v in extra.items() if k in _KEYS}
    values["second_tier"] = parse_second_tier(extra.get("second_tier"))
    if tier.second_tier and values["second_tier"] is None:
        raise ValueError(f"{_PREFIX}['setup'] = {tier.composition!r} names a shared second "
                         "tier but 'second_tier' is not set: give the store's address there "
                         "(kvtriton.second_tier.config) or drop 'shared'")
    # The store's settings turn the setup's shared second tier on: the setup then names what
    # runs, as the simulator names it.
    values["setup"] = (tier.composition if tier.second_tier or values["second_tier"] is None
                       else f"{tier.composition}+shared")
    return ConnectorConfig(**values)


def check_host_memory(config: ConnectorConfig, ranks_on_host: int = 1,
                      total_bytes: int | None = None, *, cpu_blocks: int | None = None,
                      setup_as_written: str | None = None) -> None:
    """``ValueError`` naming ``cpu_bytes_per_rank`` when the CPU tiers of ``ranks_on_host``
    ranks would not fit in the machine's memory (``total_bytes``: the machine's, by default),
    or naming ``setup`` when they fit but not with the setup's eviction memory for a tier of
    ``cpu_blocks`` blocks (the null block included; the ``lfu`` sketch and the claims of
    ``hints`` or ``sessions``, one per engine: the scheduler's). That error names
    ``setup_as_written``, the ``setup`` value as the user wrote it, or else the canonical one.
    Checked at start-up, before anything is allocated: past it the allocation fails deep down
    (``OverflowError`` from ``mmap``, a bare ``ENOMEM`` or ``MemoryError``) or the machine
    swaps."""
    total = host_memory_bytes() if total_bytes is None else total_bytes
    need = config.cpu_bytes_per_rank * ranks_on_host
    ranks = f" x {ranks_on_host} ranks on this host" if ranks_on_host > 1 else ""
    if need > total:
        raise ValueError(f"{_PREFIX}['cpu_bytes_per_rank'] = {config.cpu_bytes_per_rank} "
                         f"({config.cpu_bytes_per_rank / 2**30:.4g} GiB){ranks} exceeds this "
                         f"machine's memory ({total / 2**30:.1f} GiB); give less")
    if cpu_blocks is None:
        return
    tier = config.tier
    sketch, claims = tier.eviction_bytes(cpu_blocks), claim_bytes(tier, cpu_blocks)
    state = sketch + claims
    if need + state > total:
        written = setup_as_written or config.setup
        what = eviction_state(sketch, claims)
        verb = "takes" if not claims else "take up to"
        fixes = (["use a smaller window W (lfu:W takes 4 to 8 x max(W, 8) bytes per tier "
                  "block)"] if sketch else [])
        fixes += ([f"drop '{'hints' if tier.hints else 'sessions'}' (its claims take up to "
                   "about 1 KiB per protected block)"] if claims else [])
        raise ValueError(
            f"{_PREFIX}['setup'] = {written!r}: its {what} for the {cpu_blocks - 1:,}-block "
            f"CPU tier {verb} {state} bytes ({state / 2**30:.4g} GiB), which with the tier's "
            f"{need} bytes ({need / 2**30:.4g} GiB{ranks}) exceeds this machine's memory "
            f"({total / 2**30:.1f} GiB); {' or '.join(fixes)}")
