"""The planner's checks of what workers and the scheduler hand it each step, run at the entry
(``OffloadPlanner.build_meta``, ``update_connector_output``) before anything is applied."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain

import numpy as np

from kvtriton.records import StepOutput
from kvtriton.validation import check_block_ids, is_int

__all__ = ["check_reports", "check_step"]

_SEQUENCES = {tuple, list}
_ID_SEQUENCES = {tuple, list, np.ndarray}


def check_step(step: StepOutput, num_groups: int, num_gpu_blocks: int) -> None:
    """``ValueError`` for a step whose new blocks or hand-offs are not block ids of the GPU
    pool (``num_gpu_blocks``) in the layout's ``num_groups`` groups. The step's new blocks are
    checked all at once, with no Python-level loop over them."""
    G, n_gpu = num_groups, num_gpu_blocks
    new = step.new_block_ids.values()
    if new:
        per_group = list(chain.from_iterable(new)) \
            if not set(map(type, new)) - _SEQUENCES and set(map(len, new)) == {G} else None
        if per_group is None or set(map(type, per_group)) - _ID_SEQUENCES:
            _explain_new_blocks(step, G, n_gpu)
        try:
            check_block_ids(list(chain.from_iterable(per_group)), n_gpu, "new_block_ids")
        except ValueError:
            _explain_new_blocks(step, G, n_gpu)
            raise
    for rid, entries in step.boundary_handoffs.items():
        for entry in entries:
            what = f"step.boundary_handoffs[{rid!r}] entry {entry!r}"
            if not isinstance(entry, tuple | list) or len(entry) != 3:
                raise ValueError(f"{what}: expected (boundary_tokens, gpu_block_id, group)")
            _, gb, g = entry
            if not is_int(g) or not 0 <= g < G:
                raise ValueError(f"{what}: group {g!r} out of range [0, {G})")
            check_block_ids([gb], n_gpu, what)


def _explain_new_blocks(step: StepOutput, G: int, n_gpu: int) -> None:
    """Raise the ``ValueError`` naming the request, group and id of a bad step."""
    for rid, new_ids in step.new_block_ids.items():
        if not isinstance(new_ids, tuple | list) or len(new_ids) != G:
            got = (f"{len(new_ids)} lists" if isinstance(new_ids, tuple | list)
                   else repr(new_ids))
            raise ValueError(f"step.new_block_ids[{rid!r}] must hold one list of new GPU "
                             f"blocks per group ({G}), got {got}")
        for g, ids in enumerate(new_ids):
            check_block_ids(ids, n_gpu, f"step.new_block_ids[{rid!r}] group {g}")


def check_reports(completed: Mapping[int, int] | Iterable[int], failed: Iterable[int],
                  events_issued: int) -> tuple[dict[int, int], list[int]]:
    """Store reports as (event -> report count, failed events); ``ValueError`` for an event
    never issued (store events are numbered ``0 .. events_issued - 1``) or a count that is not
    positive."""
    def event(ev: object) -> int:
        # A NumPy integer is an event id like any other; a bool or a float is not one.
        if not is_int(ev) or not 0 <= ev < events_issued:
            raise ValueError(f"store event {ev!r} was never issued")
        return int(ev)

    if not isinstance(completed, Mapping):
        counts: dict[int, int] = {}
        for ev in map(event, completed):
            counts[ev] = counts.get(ev, 0) + 1
        completed = counts
    out: dict[int, int] = {}
    for ev, count in completed.items():
        if not is_int(count) or count <= 0:
            raise ValueError(f"store event {ev!r}: report count must be a positive int, got "
                             f"{count!r}")
        ev = event(ev)
        out[ev] = out.get(ev, 0) + int(count)
    failed = [event(ev) for ev in failed]
    both = sorted(set(out) & set(failed))
    if both:
        raise ValueError(f"store event {both[0]} reported both completed and failed in one "
                         "call")
    return out, failed


def check_request_ids(ids: Iterable[str], what: str) -> list[str]:
    """``ids`` as a list of request ids; ``ValueError`` for a single string (it would be read
    letter by letter) or an id that is not a string."""
    if isinstance(ids, str | bytes):
        raise ValueError(f"{what} must be a collection of request ids, got the string {ids!r}")
    out = list(ids)
    bad = [r for r in out if not isinstance(r, str)]
    if bad:
        raise ValueError(f"{what}: request ids are strings, got {bad[0]!r}")
    return out
