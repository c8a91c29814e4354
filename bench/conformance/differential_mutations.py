"""Known bug classes planted in kvtriton's side, each of which the differential
(``bench.conformance.differential``) must catch.

``MUTATIONS`` maps a name to a context manager factory that applies the bug (a monkeypatch)
while it is open. Each planted call also counts when it *fired*: it did something the original
would not have (the cursor mutations run the original first and compare the cursors; a flush
mutation dry-runs the original flush; the others count the calls their change applies to).
``fired()`` reads the count, ``reset_fired()`` zeroes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

__all__ = ["MUTATIONS", "fired", "reset_fired"]

_fired = [0]


def fired() -> int:
    """How many times the open mutation changed what kvtriton did since ``reset_fired``."""
    return _fired[0]


def reset_fired() -> None:
    _fired[0] = 0


def _fire() -> None:
    _fired[0] += 1


@contextlib.contextmanager
def _patched(obj: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, make(old))
    try:
        yield
    finally:
        setattr(obj, name, old)


# ---- store cursors ------------------------------------------------------------------------------

def _cursor_variant(change):
    """``_advance_cursors`` with its arguments changed by ``change``; fired where the cursors
    it leaves differ from the original's."""
    def make(old):
        def advance(self, rows, ready, c, chosen, deferred, dups, budget):
            before = self._cursor.copy()
            old(self, rows, ready, c, chosen, deferred, dups, budget)
            want = self._cursor.copy()
            self._cursor[...] = before
            old(self, rows, ready, *change(c, chosen, deferred, dups, budget))
            if not np.array_equal(self._cursor, want):
                _fire()
        return advance
    return make


def _no_deferred_stop(c, chosen, deferred, dups, budget):
    return c, chosen, deferred[:0], dups, budget


def _one_past_deferred(c, chosen, deferred, dups, budget):
    pos = c.position.copy()
    pos[deferred] += 1
    return dataclasses.replace(c, position=pos), chosen, deferred, dups, budget


def _moves_after_budget(c, chosen, deferred, dups, budget):
    return c, chosen, deferred, dups, len(chosen) + 1


# ---- in-flight flags ----------------------------------------------------------------------------

def _flags_never_cleared(old):
    def set_in_flight(self, gpu_blocks, keys, value):
        if value:
            old(self, gpu_blocks, keys, value)
        elif len(gpu_blocks):
            _fire()
    return set_in_flight


def _flags_never_set(old):
    def set_in_flight(self, gpu_blocks, keys, value):
        if value and len(gpu_blocks):
            _fire()
        old(self, gpu_blocks, keys, False)  # the arrays still grow to the keys
    return set_in_flight


# ---- the finish flush ---------------------------------------------------------------------------

class _Dry(Exception):
    """Stops a dry run of ``_queue_flush`` at its allocation, with the blocks it chose."""


def _dry_flush(old, stores, rid, req, st) -> list[int]:
    """The GPU blocks the original ``_queue_flush`` would queue (it changes nothing before it
    allocates)."""
    def stop(job, *args, **kwargs):
        raise _Dry(list(job.gpu))

    stores.allocate = stop
    try:
        old(stores, rid, req, st)
    except _Dry as d:
        return d.args[0]
    finally:
        del stores.allocate
    return []


class _ShiftedCursor:
    """A selector whose cursors read one further on (for the flush only)."""

    def __init__(self, sel):
        self._sel = sel

    def __getattr__(self, name):
        return getattr(self._sel, name)

    def cursor(self, row, group):
        return self._sel.cursor(row, group) + 1


def _flush_wrong_cursor(old):
    def queue_flush(self, rid, req, st):
        would = _dry_flush(old, self, rid, req, st)
        sel = self._selector
        self._selector = _ShiftedCursor(sel)
        try:
            before = len(self._flush.gpu)
            old(self, rid, req, st)
            if self._flush.gpu[before:] != would:
                _fire()
        finally:
            self._selector = sel
    return queue_flush


def _flush_one_short(old):
    def queue_flush(self, rid, req, st):
        allocate = self.allocate

        def short(job, *args, **kwargs):
            if job.gpu:
                _fire()
                for col in (job.gpu, job.groups, job.keys):
                    col.pop()
            return allocate(job, *args, **kwargs)

        self.allocate = short
        try:
            return old(self, rid, req, st)
        finally:
            del self.allocate
    return queue_flush


# ---- loads --------------------------------------------------------------------------------------

def _load_one_short(old):
    def commit(self, rid, load, num_external_tokens):
        if load is not None and load.gpu:
            _fire()
            load = type(load)(load.gpu[:-1], load.cpu[:-1], load.groups[:-1])
        return old(self, rid, load, num_external_tokens)
    return commit


# ---- store reports ------------------------------------------------------------------------------

def _failed_registered(old):
    def complete(self, ev, failed):
        if failed:
            _fire()
        return old(self, ev, False)
    return complete


def _wrong_free_order(old):
    def complete(self, ev, failed):
        job = self._jobs.get(ev) or self._abandoned.get(ev)
        if job is None or len(job.gpu) < 2:
            return old(self, ev, failed)
        _fire()
        cfg = self._config
        flip = "tail_first" if cfg.cpu_free_order == "head_first" else "head_first"
        self._config = dataclasses.replace(cfg, cpu_free_order=flip)
        try:
            return old(self, ev, failed)
        finally:
            self._config = cfg
    return complete


# ---- key binding --------------------------------------------------------------------------------

class _DroppingKeys:
    """A mirror's ``KeyIds`` that leaves the positions ``drop`` picks unbound, as a collision
    would, though no other request made their hash."""

    def __init__(self, keys, mirror, drop: Callable[[int], bool]) -> None:
        self._keys, self._mirror, self._drop = keys, mirror, drop

    def __getattr__(self, name):
        return getattr(self._keys, name)

    def bind(self, key: bytes, kid: int) -> bool:
        j = int(np.flatnonzero((self._mirror.req.keys == kid).any(axis=0))[0])
        if self._drop(j) and key not in self._keys._ids:
            _fire()
            return False
        return self._keys.bind(key, kid)


def _bind_dropping(drop: Callable[[int], bool]):
    def make(old):
        def bind(self):
            keys = self._keys
            self._keys = _DroppingKeys(keys, self, drop)
            try:
                return old(self)
            finally:
                self._keys = keys
        return bind
    return make


def _mutation(attr_path: str, make):
    def apply():
        from kvtriton.planner import loads, scan, stores
        from kvtriton.vllm import requests
        owners = {"FusedSelector": scan.FusedSelector, "Stores": stores.Stores,
                  "Loads": loads.Loads, "RequestMirror": requests.RequestMirror}
        cls_name, name = attr_path.split(".")
        return _patched(owners[cls_name], name, make)
    return apply


#: name -> a context manager factory that applies the bug while it is open.
MUTATIONS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "cursor_not_stopped_by_deferred": _mutation("FusedSelector._advance_cursors",
                                                _cursor_variant(_no_deferred_stop)),
    "cursor_one_past_deferred": _mutation("FusedSelector._advance_cursors",
                                          _cursor_variant(_one_past_deferred)),
    "cursor_moves_after_budget_spent": _mutation("FusedSelector._advance_cursors",
                                                 _cursor_variant(_moves_after_budget)),
    "in_flight_flags_never_cleared": _mutation("FusedSelector.set_in_flight",
                                               _flags_never_cleared),
    "in_flight_flag_never_set": _mutation("FusedSelector.set_in_flight", _flags_never_set),
    "flush_from_wrong_cursor": _mutation("Stores._queue_flush", _flush_wrong_cursor),
    "flush_one_short": _mutation("Stores._queue_flush", _flush_one_short),
    "load_one_short": _mutation("Loads.commit", _load_one_short),
    "failed_store_registered": _mutation("Stores._complete", _failed_registered),
    "wrong_free_order": _mutation("Stores._complete", _wrong_free_order),
    # Every third hash position a request makes once admitted (decode) left unbound, and the
    # same only from position 8 on (a bug that long requests alone show).
    "bind_dropped": _mutation("RequestMirror.bind", _bind_dropping(lambda j: j % 3 == 0)),
    "bind_dropped_deep": _mutation("RequestMirror.bind",
                                   _bind_dropping(lambda j: j >= 8 and j % 3 == 0)),
}
