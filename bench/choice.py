"""How a study chooses on the train part of its split and reads a row's part: one rule and one
reader for every study that chooses (the tier studies' ``best_online``, the fleet's combination,
the same-step load budget).

A row's figures over one part of its split are ``row["parts"][part]``, over the whole run the
row itself (``kvtriton.sim.references.figures_of``, which the references read as well);
``figures`` is that reader for a row that must have the part. Here rather than in
``bench.tier_study.study``: that module loads the tier studies' workloads and process pool,
and the fleet study shares neither; this one imports only the reader.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtriton.sim.references import figures_of
from kvtriton.sim.splits import TRAIN

__all__ = ["choose_on_train", "figures"]


def figures(row: dict[str, Any], part: str | None) -> dict[str, Any]:
    """``row``'s figures over one part of its split (``part``: ``"train"``, ``"test"``) or
    over the whole run (None); a part the row lacks is a ``KeyError``."""
    fig = figures_of(row, part)
    if fig is None:
        raise KeyError(part)
    return fig


def choose_on_train(rows: Sequence[dict[str, Any]], objective: Callable[[dict[str, Any]], Any],
                    constraint: Callable[[dict[str, Any]], bool] | None = None,
                    part: str | None = TRAIN) -> dict[str, Any] | None:
    """The row of ``rows`` whose figures on ``part`` (default the train part; None: the whole
    run, for rows without a split) give the highest ``objective``, among those whose figures
    meet ``constraint`` (every row when None); ties: the first in ``rows``. None when no row
    qualifies. ``objective`` and ``constraint`` see the figures only (``figures``), so a
    choice on train cannot read the test part."""
    fair = [r for r in rows if constraint is None or constraint(figures(r, part))]
    return max(fair, key=lambda r: objective(figures(r, part))) if fair else None
