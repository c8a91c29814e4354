"""Same-step loads: CPU hits loaded in the step that schedules them, within a byte budget per step.

vLLM's connector API lets a lookup answer a hit as synchronous (``get_num_new_matched_tokens``
returning ``load_kv_async=False``): the scheduler then computes the request in the step that
admits it, and the workers load its blocks before that step's forward pass, instead of the
request waiting a step for an asynchronous load. The forward pass waits for such a load, so a
budget bounds the bytes per step (``sync_load_budget_bytes``, as in vLLM 0.33's offloading
connector): a hit is loaded in the same step when its bytes fit what the step has left and at
least one of the request's tokens remains to compute; the budget is whole again the next step.

The connector (``kvtriton.vllm.scheduler_side``) and the simulator
(``kvtriton.sim.batch_scheduler``) apply the same rule through ``SyncLoadBudget``, and split the
step's one load transfer with ``split_sync_loads``. The connector waits for every worker's report
of a same-step load (``SyncLoadsInFlight``) before its request may look up again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvtriton.records import PlannerMeta, Transfer
from kvtriton.specs import KVLayout
from kvtriton.validation import is_int

__all__ = ["SyncLoadBudget", "SyncLoadsInFlight", "split_sync_loads"]


class SyncLoadBudget:
    """One scheduler's budget of same-step load bytes per step (0: every hit is asynchronous).

    A hit's bytes are ``KVLayout.hit_bytes``: every group's blocks covering its tokens (exact
    for full attention, an upper bound for sliding-window and Mamba groups, which load less)."""

    def __init__(self, layout: KVLayout, budget_bytes: int) -> None:
        if not is_int(budget_bytes) or budget_bytes < 0:
            raise ValueError(f"sync_load_budget_bytes must be a non-negative int, got "
                             f"{budget_bytes!r}")
        self.layout = layout
        self.budget_bytes = int(budget_bytes)
        self._left = self.budget_bytes
        #: Request id -> bytes reserved this step, in the order reserved.
        self.reserved: dict[str, int] = {}

    def reserve(self, req_id: str, num_computed_tokens: int, hit_tokens: int,
                num_tokens: int) -> bool:
        """Whether the hit of ``hit_tokens`` past ``num_computed_tokens`` (of a request of
        ``num_tokens``) is loaded in this step; if so its bytes are taken from the step's
        budget. A request looked up again in the same step gives its earlier reservation
        back first."""
        self.release(req_id)
        if not self.budget_bytes or hit_tokens <= 0 \
                or num_computed_tokens + hit_tokens >= num_tokens:
            return False  # off, no hit, or nothing left to compute: not schedulable
        nbytes = self.layout.hit_bytes(hit_tokens)
        if nbytes > self._left:
            return False
        self._left -= nbytes
        self.reserved[req_id] = nbytes
        return True

    def release(self, req_id: str) -> None:
        """``req_id`` loads nothing in this step after all: its bytes go back to the budget."""
        self._left += self.reserved.pop(req_id, 0)

    def new_step(self) -> None:
        """The step's transfers are built: the next step has the whole budget."""
        self.reserved.clear()
        self._left = self.budget_bytes


def split_sync_loads(meta: PlannerMeta, queued: Mapping[str, Transfer],
                     sync: Collection[str]) -> tuple[PlannerMeta, Transfer]:
    """``meta`` with the loads of the request ids ``sync`` taken out of its load, and those
    loads as one transfer under the same event. ``queued``: the loads the step accepted, by
    request (``OffloadPlanner.queued_loads()`` before ``build_meta``, which issues them in that
    order under one event); every id of ``sync`` must be one of them. The asynchronous rest
    keeps the event's entry in ``load_event_to_reqs`` (its requests are reported when their
    load lands); the same-step requests are not in it."""
    if not sync:
        return meta, Transfer()
    missing = [rid for rid in sync if rid not in queued]
    if missing:
        raise ValueError(f"same-step load of request {missing[0]!r}, which has no load queued "
                         "this step")
    ev = meta.load.event
    now, rest = Transfer(ev), Transfer(ev)
    for rid, t in queued.items():
        part = now if rid in sync else rest
        part.gpu_blocks += t.gpu_blocks
        part.cpu_blocks += t.cpu_blocks
        part.groups += t.groups
    if len(now) + len(rest) != len(meta.load):
        raise ValueError(f"load event {ev}: {len(meta.load)} pairs issued, the queued loads "
                         f"hold {len(now) + len(rest)}")
    to_reqs = dict(meta.load_event_to_reqs)
    left = [rid for rid in to_reqs.get(ev, ()) if rid not in sync]
    if left:
        to_reqs[ev] = left
    else:
        to_reqs.pop(ev, None)
        rest = Transfer()
    return PlannerMeta(meta.store, rest, to_reqs, meta.need_flush), now


class SyncLoadsInFlight:
    """The same-step loads issued and not yet reported by every one of ``world_size`` workers:
    by load event, its requests and how many workers reported it landed or failed. A request
    is in flight (``in``) from ``issued`` until the last report of its event; one load at a
    time, so vLLM's lookups of it wait."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._requests: dict[int, list[str]] = {}  # event -> its requests
        self._reports: dict[int, list[int]] = {}  # event -> [landed, failed] worker reports
        self._pending: set[str] = set()  # the requests of those events, for ``in``

    def issued(self, event: int, req_ids: list[str]) -> None:
        """The same-step loads of ``req_ids`` went out under ``event``."""
        self._requests[event] = list(req_ids)
        self._reports[event] = [0, 0]
        self._pending.update(req_ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._pending

    def __len__(self) -> int:
        return len(self._requests)

    def reported(self, landed: Mapping[int, int], failed: Mapping[int, int]
                 ) -> tuple[list[str], list[str]]:
        """Add one step's aggregated worker reports (event -> workers that reported it landed,
        or failed; events not in flight are ignored). Returns the requests whose events every
        worker has now reported: those that landed everywhere, and those that failed on some
        worker (its blocks are invalid: vLLM recomputes the request)."""
        for reports, i in ((landed, 0), (failed, 1)):
            for ev, n in reports.items():
                if ev in self._reports:
                    self._reports[ev][i] += n
        ok: list[str] = []
        broken: list[str] = []
        for ev, (done, bad) in list(self._reports.items()):
            if done + bad >= self.world_size:
                del self._reports[ev]
                rids = self._requests.pop(ev)
                self._pending.difference_update(rids)
                (broken if bad else ok).extend(rids)
        return ok, broken
