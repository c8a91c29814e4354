"""What one simulation run reports (``RunMetrics``), its row (``SetupRow``) and the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np

__all__ = ["PartRow", "RunMetrics", "SetupRow", "format_table"]


class PartRow(TypedDict, total=False):
    """One part's figures of a run (``SetupRow.parts``): the requests of that part only (a
    train or test part of a split, ``kvtriton.sim.splits``). Tokens are prompt tokens of the
    part's admitted requests; TTFTs are modeled seconds of its requests that produced a token."""

    requests: int
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    token_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_mean_s: float
    queue_delay_p50_s: float
    gain_points: float | None  # as SetupRow's, against the control's figures on the part
    headroom_share: float | None  # against the upper bound's figures on the part


class SetupRow(TypedDict, total=False):
    """One setup's figures in a simulation result (``SimulationResult.rows``, the JSON's
    ``rows``). Tokens are prompt tokens; times are modeled seconds except ``wall_s`` and the
    planner's milliseconds, which are measured."""

    setup: str  # the setup's name (a composition, or a preset's name when given one)
    composition: str  # canonical composition (kvtriton.setups)
    oracle: bool  # uses knowledge of the future: a reference or a bound, not an online setup
    cpu_blocks: int  # CPU tier size in blocks (0: no tier)
    gain_points: float | None  # token hit rate over the control's, in points
    headroom_share: float | None  # share of the control-to-upper-bound headroom gained
    requests: int
    finished: int
    rejected: int  # larger than the whole GPU pool
    prompt_tokens: int
    gpu_hit_tokens: int
    cpu_hit_tokens: int
    token_hit_rate: float  # (GPU + CPU hit tokens) / prompt tokens
    prefill_tokens: int
    recomputed_tokens: int  # tokens of blocks computed again after they were cached once
    stored_blocks: int
    restored_blocks: int
    restore_thrash: int
    loaded_blocks: int
    sync_loads: int  # CPU hits computed in the step that loaded them (sync_load_budget_bytes)
    handoff_stored: int
    lazy_stored: int
    admission_skipped: int
    protect_overflow: int
    sessions_expired: int
    hints_applied: dict[str, int]
    bytes_d2h: int
    bytes_h2d: int
    running_evictions: int
    chain_holes: int
    lookups_with_holes: int
    preemptions: int
    steps: int
    build_meta_ms_mean: float
    build_meta_ms_p99: float
    planner_ms_per_step: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    queue_delay_p50_s: float  # arrival to the step that first admitted it
    queue_delay_p90_s: float
    queue_delay_mean_s: float
    makespan_s: float
    wall_s: float
    ttft_all_s: list[float]
    integrity_blocks_checked: int
    integrity_registrations_checked: int
    integrity_blocks_filled: int
    parts: dict[str, PartRow]  # per part of the workload's split, when the run was given one


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


@dataclass(slots=True)
class RunMetrics:
    """Counters of one run. Tokens are prompt tokens unless named otherwise; times in seconds
    are modeled, except ``planner_s``/``build_meta_ms`` and ``wall_s``, which are measured.
    Token counts, hit rates and TTFTs cover the admitted requests; ``rejected`` counts the
    others (larger than the whole GPU pool)."""

    setup: str
    requests: int = 0
    finished: int = 0
    rejected: int = 0
    steps: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    cpu_hit_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    #: CPU hits loaded and computed in the same step (``sync_load_budget_bytes``).
    sync_loads: int = 0
    bytes_d2h: int = 0
    bytes_h2d: int = 0
    planner_s: float = 0.0
    wall_s: float = 0.0
    makespan_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    #: Per admitted request: modeled seconds from its arrival to the step that first admitted
    #: it (the queueing delay).
    queue_by_request: dict[str, float] = field(default_factory=dict)
    build_meta_ms: list[float] = field(default_factory=list)
    planner: dict = field(default_factory=dict)
    #: Finished requests per hint the CPU tier was given ("none": no hint), with hints on.
    hints: dict = field(default_factory=dict)
    #: Per admitted request id: (prompt tokens, GPU hit, CPU hit tokens) at its first admission.
    tokens_by_request: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    #: Per request id that produced a token: its modeled TTFT in seconds.
    ttft_by_request: dict[str, float] = field(default_factory=dict)

    @classmethod
    def merged(cls, runs: Sequence[RunMetrics]) -> RunMetrics:
        """The metrics of ``runs`` together (a fleet's replicas, each request in one of
        them): counts and per-request figures summed or joined, the makespan the longest."""
        out = cls(setup=runs[0].setup)
        for m in runs:
            for name in ("requests", "finished", "rejected", "steps", "prompt_tokens",
                         "gpu_hit_tokens", "cpu_hit_tokens", "prefill_tokens",
                         "recomputed_tokens", "preemptions", "sync_loads", "bytes_d2h",
                         "bytes_h2d",
                         "planner_s", "wall_s"):
                setattr(out, name, getattr(out, name) + getattr(m, name))
            out.makespan_s = max(out.makespan_s, m.makespan_s)
            out.ttft_s += m.ttft_s
            out.build_meta_ms += m.build_meta_ms
            for mine, theirs in ((out.planner, m.planner), (out.hints, m.hints)):
                for k, v in theirs.items():
                    if isinstance(v, int | float):
                        mine[k] = mine.get(k, 0) + v
            out.queue_by_request.update(m.queue_by_request)
            out.tokens_by_request.update(m.tokens_by_request)
            out.ttft_by_request.update(m.ttft_by_request)
        return out

    def part_rows(self, parts: Mapping[str, str]) -> dict[str, PartRow]:
        """The figures of each part of ``parts`` (request id -> part name), in order of first
        appearance; a request without a part is in none."""
        acc: dict[str, list] = {}
        for rid, label in parts.items():
            a = acc.setdefault(label, [0, 0, 0, 0, [], []])
            tokens = self.tokens_by_request.get(rid)
            if tokens is not None:
                a[0] += 1
                a[1] += tokens[0]
                a[2] += tokens[1]
                a[3] += tokens[2]
            ttft = self.ttft_by_request.get(rid)
            if ttft is not None:
                a[4].append(ttft)
            queued = self.queue_by_request.get(rid)
            if queued is not None:
                a[5].append(queued)
        return {label: {"requests": n, "prompt_tokens": p, "gpu_hit_tokens": g,
                        "cpu_hit_tokens": c, "token_hit_rate": (g + c) / p if p else 0.0,
                        "ttft_p50_s": _pct(t, 50), "ttft_p90_s": _pct(t, 90),
                        "ttft_mean_s": sum(t) / len(t) if t else float("nan"),
                        "queue_delay_p50_s": _pct(q, 50)}
                for label, (n, p, g, c, t, q) in acc.items()}

    def summary(self) -> SetupRow:
        """Flat figures for tables and JSON."""
        p = self.planner
        hits = self.gpu_hit_tokens + self.cpu_hit_tokens
        queue = list(self.queue_by_request.values())
        return {
            "setup": self.setup,
            "requests": self.requests,
            "finished": self.finished,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "gpu_hit_tokens": self.gpu_hit_tokens,
            "cpu_hit_tokens": self.cpu_hit_tokens,
            "token_hit_rate": hits / self.prompt_tokens if self.prompt_tokens else 0.0,
            "prefill_tokens": self.prefill_tokens,
            "recomputed_tokens": self.recomputed_tokens,
            "stored_blocks": p.get("blocks_stored", 0),
            "restored_blocks": p.get("scan_restored", 0),
            "restore_thrash": p.get("restore_thrash", 0),
            "loaded_blocks": p.get("blocks_loaded", 0),
            "sync_loads": self.sync_loads,
            "handoff_stored": p.get("handoff_stored", 0),
            "lazy_stored": p.get("lazy_stored", 0),
            "admission_skipped": p.get("admission_skipped", 0),
            "protect_overflow": p.get("protect_overflow", 0),
            "sessions_expired": p.get("sessions_expired", 0),
            "hints_applied": dict(self.hints),
            "bytes_d2h": self.bytes_d2h,
            "bytes_h2d": self.bytes_h2d,
            "running_evictions": p.get("running_evictions", 0),
            "chain_holes": p.get("chain_holes", 0),
            "lookups_with_holes": p.get("lookups_with_holes", 0),
            "preemptions": self.preemptions,
            "steps": self.steps,
            "build_meta_ms_mean": float(np.mean(self.build_meta_ms)) if self.build_meta_ms
            else 0.0,
            "build_meta_ms_p99": _pct(self.build_meta_ms, 99) if self.build_meta_ms else 0.0,
            "planner_ms_per_step": 1e3 * self.planner_s / self.steps if self.steps else 0.0,
            "ttft_p50_s": _pct(self.ttft_s, 50),
            "ttft_p90_s": _pct(self.ttft_s, 90),
            "ttft_p99_s": _pct(self.ttft_s, 99),
            "ttft_mean_s": sum(self.ttft_s) / len(self.ttft_s) if self.ttft_s else 0.0,
            "queue_delay_p50_s": _pct(queue, 50),
            "queue_delay_p90_s": _pct(queue, 90),
            "queue_delay_mean_s": sum(queue) / len(queue) if queue else float("nan"),
            "makespan_s": self.makespan_s,
            "wall_s": self.wall_s,
            "ttft_all_s": [round(t, 6) for t in self.ttft_s],
        }


_COLUMNS = [
    ("setup", "setup", "{}"),
    ("rejected", "rejected", "{:,}"),
    ("token_hit_rate", "hit rate", "{:.1%}"),
    ("gain_points", "gain pt", "{:+.1f}"),
    ("headroom_share", "headroom", "{:.0%}"),
    ("gpu_hit_tokens", "GPU hit tok", "{:,}"),
    ("cpu_hit_tokens", "CPU hit tok", "{:,}"),
    ("recomputed_tokens", "recomputed", "{:,}"),
    ("stored_blocks", "stored", "{:,}"),
    ("restored_blocks", "re-stored", "{:,}"),
    ("running_evictions", "run. evict", "{:,}"),
    ("chain_holes", "holes", "{:,}"),
    ("preemptions", "preempt", "{:,}"),
    ("ttft_p50_s", "TTFT p50 s", "{:.3f}"),
    ("ttft_p90_s", "p90 s", "{:.3f}"),
    ("ttft_p99_s", "p99 s", "{:.3f}"),
    ("planner_ms_per_step", "plan ms/step", "{:.3f}"),
    ("wall_s", "wall s", "{:.1f}"),
]


def format_table(rows: list[SetupRow]) -> str:
    """A fixed-width table of ``RunMetrics.summary()`` rows."""
    cells = [[title for _, title, _ in _COLUMNS]]
    cells += [["-" if r.get(key) is None else fmt.format(r[key]) for key, _, fmt in _COLUMNS]
              for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(_COLUMNS))]
    lines = []
    for n, row in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
