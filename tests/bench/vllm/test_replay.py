"""``replay`` steps the engine as ``vllm serve``'s engine core does: while the scheduler has
requests, which counts the connector's push work pending after the last output. Stepping on the
front end's unfinished requests alone left a lazy tier's stores of a finished request's blocks
until the next arrival, whose lookup then ran before them (and before the CPU evictions they
cause): ``lazy+hints`` hit 47.5-50.5% on ``cc_agentic`` over three runs, 45.4-47.0% stepped as
a server steps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from bench.vllm.engine_replay import StepRecorder, replay

PUSH_STEPS = 2  # steps of connector work a finish leaves


class _Scheduler:
    """vLLM's scheduler as the replay sees it: a finish leaves ``PUSH_STEPS`` steps of push
    work, reported by ``has_requests`` as vLLM's does."""

    def __init__(self, log: list) -> None:
        self.requests: dict = {}
        self.running: set[str] = set()
        self.pending = 0
        self.log = log

    def has_requests(self) -> bool:
        return bool(self.running) or self.pending > 0

    def schedule(self):
        if self.running:
            return SimpleNamespace(num_scheduled_tokens={})
        if self.pending:
            self.pending -= 1
            self.log.append("push")
        return SimpleNamespace(num_scheduled_tokens={})


class _Engine:
    """``LLMEngine``'s surface: each request finishes in one step."""

    def __init__(self, sched: _Scheduler) -> None:
        self.sched = sched
        self.log = sched.log

    def add_request(self, rid, prompt, params) -> None:
        self.sched.running.add(rid)
        self.log.append(f"add {rid}")

    def has_unfinished_requests(self) -> bool:
        return bool(self.sched.running)

    def step(self) -> list:
        self.sched.schedule()
        out = [SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=[7])],
                               finished=True) for rid in sorted(self.sched.running)]
        if out:
            self.sched.running.clear()
            self.sched.pending = PUSH_STEPS
        return out


def _request(rid: str, after: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, arrival_s=0.0, after=after, think_s=0.2,
                           hint=None, output_len=1)


def test_connector_work_is_drained_before_the_next_arrival():
    log: list[str] = []
    sched = _Scheduler(log)
    engine = _Engine(sched)
    # b is a's next turn, due its think time (0.2 s) after a finished: ages for two push steps.
    wl = [_request("a"), _request("b", after="a")]
    res = replay(engine, StepRecorder(sched), wl, {"a": [1, 2], "b": [1, 3]}, hints=False)
    assert res["requests"] == 2
    # The finish's push steps run at once, as vllm serve runs them, not when b arrives.
    assert log == ["add a", *["push"] * PUSH_STEPS, "add b", *["push"] * PUSH_STEPS]
    assert res["steps_without_tokens"] == 2 + 2 * PUSH_STEPS
