"""What a setup's hit rate is measured against: the control, true upper bounds and oracle
references.

- An *upper bound* is a hit rate no setup of the same GPU + CPU memory can pass on the same
  requests: the unbounded tier (``eager+inf``, run in the same loop: every block computed once
  stays reachable, so any setup's hit is its hit too) and Belady's MIN in a cache-only replay
  of the GPU + CPU capacity (``belady_bound``: the best any eviction of that many blocks can
  do in the trace's order; a whole run only, since MIN maximises the hits of all requests
  together, not of one part's). The tighter of those present is a row's *upper bound*.
- An *oracle reference* is an online-impossible setup that is not a bound: next-use eviction
  (``NEXT_USE_REFERENCES``) is a strong heuristic that knows the future, and online setups do
  pass it (eager stores evict by next use only among what the tier holds).

A row's gain is in points of token hit rate over the control; a share is only ever a share of
the headroom from the control to an upper bound (``headroom_share``), so at most 100%. Every
reference is chosen per part: the better next-use row of the test part may be the other one.
"""

from __future__ import annotations

from typing import Any

from kvtriton.setups import CONTROL, NEXT_USE_REFERENCES, UPPER_BOUND_SETUPS

__all__ = ["add_references", "figures_of", "headroom_share", "oracle_reference", "upper_bound"]

#: Below this headroom (a fraction of hit rate: 2 points) no share is given: a share of a
#: smaller one magnifies noise (a 1-point loss against 0.4 points of headroom reads -250%).
MIN_HEADROOM = 0.02


def figures_of(row: dict[str, Any], part: str | None) -> dict[str, Any] | None:
    """``row``'s figures over ``part`` (its ``parts`` entry), or over the whole run (None)."""
    return row if part is None else row.get("parts", {}).get(part)


def headroom_share(hit_rate: float, control: float, upper: float) -> float | None:
    """Share of the headroom between the control's hit rate and an upper bound's that
    ``hit_rate`` gains (negative: below the control; None: under ``MIN_HEADROOM``)."""
    room = upper - control
    return (hit_rate - control) / room if room >= MIN_HEADROOM else None


def upper_bound(rows: list[dict[str, Any]], cache_only: dict[str, Any] | None = None,
                part: str | None = None) -> dict[str, Any] | None:
    """The tightest upper bound on ``part`` (None: the whole run) among the unbounded-tier rows
    of ``rows`` and, for the whole run, the cache-only Belady result ``cache_only``: its
    ``setup`` and ``token_hit_rate``; None where neither was run."""
    found = []
    for r in rows:
        f = figures_of(r, part)
        if r.get("composition") in UPPER_BOUND_SETUPS and f is not None:
            found.append({"setup": r["composition"], "token_hit_rate": f["token_hit_rate"]})
    if part is None and cache_only is not None:
        found.append({"setup": "belady (cache-only, GPU + CPU)",
                      "token_hit_rate": cache_only["hit_rate"]})
    return min(found, key=lambda b: b["token_hit_rate"]) if found else None


def oracle_reference(rows: list[dict[str, Any]], part: str | None = None
                     ) -> dict[str, Any] | None:
    """The better next-use row on ``part`` (None: the whole run): its ``setup`` and
    ``token_hit_rate``; None where none ran."""
    found = [{"setup": r["composition"], "token_hit_rate": f["token_hit_rate"]}
             for r in rows if r.get("composition") in NEXT_USE_REFERENCES
             and (f := figures_of(r, part)) is not None]
    return max(found, key=lambda b: b["token_hit_rate"]) if found else None


def _annotate(fig: dict[str, Any], control: dict[str, Any] | None,
              upper: dict[str, Any] | None, beyond_memory: bool) -> None:
    if control is None:
        fig["gain_points"] = fig["headroom_share"] = None
        return
    fig["gain_points"] = 100 * (fig["token_hit_rate"] - control["token_hit_rate"])
    # The unbounded tier has more memory than the bound it would be measured against.
    fig["headroom_share"] = None if upper is None or beyond_memory else headroom_share(
        fig["token_hit_rate"], control["token_hit_rate"], upper["token_hit_rate"])


def add_references(rows: list[dict[str, Any]], cache_only: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """Set ``gain_points`` (points over the control) and ``headroom_share`` (of the headroom to
    the upper bound) on every row of ``rows`` and on each of its ``parts``, each part against
    the control's and the upper bound's figures on that part; None where the control or the
    bound is missing, and no share for the unbounded tier's own rows (it has more memory).
    Returns the references, whole run and per part: ``{"upper_bound", "oracle_reference",
    "parts": {name: {...}}}``."""
    control = next((r for r in rows if r.get("composition") == CONTROL), None)
    names = sorted({p for r in rows for p in r.get("parts", {})})
    refs: dict[str, Any] = {"upper_bound": upper_bound(rows, cache_only),
                            "oracle_reference": oracle_reference(rows), "parts": {}}
    for name in names:
        refs["parts"][name] = {"upper_bound": upper_bound(rows, None, name),
                               "oracle_reference": oracle_reference(rows, name)}
    for r in rows:
        beyond = r.get("composition") in UPPER_BOUND_SETUPS
        _annotate(r, control, refs["upper_bound"], beyond)
        for name, fig in r.get("parts", {}).items():
            _annotate(fig, figures_of(control, name) if control else None,
                      refs["parts"][name]["upper_bound"], beyond)
    return refs
