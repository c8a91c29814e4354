"""Records a scheduler-side planner and a worker-side engine exchange; both roles import this
module, and it imports neither.

Keys are dense ids from a shared ``HashIndex`` (``kvtriton.hashing``): both block pools and the
planner's arrays are indexed by them. ``Request.keys[g, j]`` is group g's key for the hash
boundary after token ``(j + 1) * hash_block_size``. The glossary of these words is in
``docs/glossary.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvtriton.validation import check_request_keys, is_int

__all__ = ["HINTS", "PlannerMeta", "Request", "StepOutput", "Transfer"]

#: The continuation hints a request may end with (None is no hint): ``"continue"``: this turn's
#: context will be reused soon (an agent turn that ended in a tool call); ``"close"``: the client
#: closes the session after this turn (nothing of it will be asked for again by this
#: conversation). The simulator's workloads, the planner and the connector read this one tuple.
HINTS = ("continue", "close")


@dataclass(slots=True, eq=False)
class Request:
    """A request as the planner sees it.

    ``keys`` covers every full hash block the request will ever have (prompt and output, as far
    as the workload knows them); only the first ``num_tokens // hash_block_size`` exist yet.
    ``num_output_placeholders`` are scheduled-but-unconfirmed tokens (async scheduling), which a
    store must not trust.
    """

    request_id: str
    keys: np.ndarray
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int = 0
    num_output_placeholders: int = 0
    lora_id: int | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        for name in ("num_prompt_tokens", "num_tokens", "num_computed_tokens",
                     "num_output_placeholders"):
            v = getattr(self, name)
            if (type(v) is not int and not is_int(v)) or v < 0:  # plain ints first: cheap
                raise ValueError(f"request {rid!r}: {name} must be a non-negative int, got {v!r}")
        if self.num_prompt_tokens == 0:
            raise ValueError(f"request {rid!r}: num_prompt_tokens must be positive, got 0")
        if self.num_tokens < self.num_prompt_tokens:
            raise ValueError(f"request {rid!r}: num_tokens={self.num_tokens} < "
                             f"num_prompt_tokens={self.num_prompt_tokens}")
        check_request_keys(rid, self.keys)

    @property
    def confirmed_tokens(self) -> int:
        return self.num_computed_tokens - self.num_output_placeholders


@dataclass(slots=True)
class StepOutput:
    """What the scheduler decided this step, in the shape a connector receives it.

    ``new_block_ids[req][g]`` are the GPU blocks appended to the request's table for group g this
    step (for a request that was preempted and resumed: its whole new table). ``boundary_handoffs``
    lists, per request, ``(boundary_tokens, gpu_block_id, group)`` Mamba states saved this step.
    """

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    resumed_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    boundary_handoffs: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)
    # Request order of this step (scan order); defaults to the order of num_scheduled_tokens.
    order: list[str] | None = None


@dataclass(slots=True)
class Transfer:
    """One direction's copies for one step: pair i moves GPU block ``gpu_blocks[i]`` of group
    ``groups[i]`` to or from CPU block ``cpu_blocks[i]``. ``event`` is -1 when empty."""

    event: int = -1
    gpu_blocks: list[int] = field(default_factory=list)
    cpu_blocks: list[int] = field(default_factory=list)
    groups: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.gpu_blocks)


@dataclass(slots=True)
class PlannerMeta:
    """A step's transfers for the workers: one store, one load, and which requests each
    in-flight load event serves."""

    store: Transfer
    load: Transfer
    load_event_to_reqs: dict[int, list[str]]
    need_flush: bool = False
