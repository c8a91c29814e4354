"""The planner's checks of what workers and the scheduler hand it each step, run at the entry
(``OffloadPlanner.build_meta``, ``update_connector_output``) before anything is applied."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import chain
from typing import Any

import numpy as np

from kvtriton.records import StepOutput
from kvtriton.validation import check_block_ids, is_int

__all__ = ["check_key_ids", "check_reports", "check_request_ids", "check_step"]

_SEQUENCES = {tuple, list}
_ID_SEQUENCES = {tuple, list, np.ndarray}


def check_step(step: StepOutput, num_groups: int, num_gpu_blocks: int) -> None:
    """``ValueError`` for a step whose new blocks or hand-offs are not block ids of the GPU
    pool (``num_gpu_blocks``) in the layout's ``num_groups`` groups. The step's new blocks are
    checked all at once, with no Python-level loop over them, and so are its scheduled-token
    counts (ints >= 0: a float or a negative count is refused, not truncated)."""
    _check_scheduled_tokens(step.num_scheduled_tokens)
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


def _check_scheduled_tokens(scheduled: Any) -> None:
    if not isinstance(scheduled, Mapping):
        raise ValueError("step.num_scheduled_tokens must map request ids to token counts, got "
                         f"{type(scheduled).__name__}")
    counts = scheduled.values()
    if not counts:
        return
    # The set of the counts' types and their minimum are C-level passes; the loop naming the
    # request runs only on the way to the error.
    if set(map(type, counts)) - _INT or min(counts) < 0:
        for rid, n in scheduled.items():
            if not is_int(n) or n < 0:
                raise ValueError(f"step.num_scheduled_tokens[{rid!r}] must be an int >= 0, "
                                 f"got {n!r}")


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
    if isinstance(failed, Mapping | str | bytes):
        raise ValueError("failed_stores must be a collection of store events, got a "
                         f"{type(failed).__name__}: {failed!r:.80}")
    failed = [event(ev) for ev in failed]
    both = sorted(set(out) & set(failed))
    if both:
        raise ValueError(f"store event {both[0]} reported both completed and failed in one "
                         "call")
    return out, failed


def check_request_ids(ids: Iterable[str], what: str) -> list[str]:
    """``ids`` as a list of request ids; ``ValueError`` for a single string (it would be read
    letter by letter), a mapping (its keys would be read as the ids, its values dropped) or an
    id that is not a string."""
    if isinstance(ids, str | bytes):
        raise ValueError(f"{what} must be a collection of request ids, got the string {ids!r}")
    if isinstance(ids, Mapping):
        raise ValueError(f"{what} must be a collection of request ids, got a "
                         f"{type(ids).__name__}: {ids!r:.80}")
    out = list(ids)
    bad = [r for r in out if not isinstance(r, str)]
    if bad:
        raise ValueError(f"{what}: request ids are strings, got {bad[0]!r}")
    return out


def check_key_ids(keys: Iterable[int] | np.ndarray, what: str) -> np.ndarray:
    """``keys`` as an int64 array; ``ValueError`` naming the first bad one unless every key is
    an int >= 0 (a float is refused, not truncated; a negative id would wrap)."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1 or (keys.size and keys.dtype.kind not in "iu"):
            raise ValueError(f"{what}: expected a 1-D array of integer key ids, got dtype "
                             f"{keys.dtype} and shape {keys.shape}")
        out = keys.astype(np.int64, copy=False)
    else:
        if isinstance(keys, Mapping | str | bytes):
            raise ValueError(f"{what}: expected a collection of key ids, got a "
                             f"{type(keys).__name__}: {keys!r:.80}")
        ids = list(keys)
        bad = next((k for k in ids if not is_int(k)), None) if set(map(type, ids)) - _INT \
            else None
        if bad is not None:
            raise ValueError(f"{what}: key id {bad!r} is not an int")
        out = np.array(ids, dtype=np.int64) if ids else np.zeros(0, dtype=np.int64)
    if out.size and (low := int(out.min())) < 0:
        raise ValueError(f"{what}: key ids must be non-negative, got {low}")
    return out


_INT = {int}
