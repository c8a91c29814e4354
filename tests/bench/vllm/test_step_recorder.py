"""``StepRecorder`` reads a request's prefix hits once vLLM admitted it: a request the connector
had vLLM skip first (its lookup not known yet: a fetch from the second tier in flight) holds
zero stats until then, and was once recorded with them (bench.second_tier lost its store hits
so)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.request import RequestStatus

from bench.vllm.engine_replay import StepRecorder


class _Scheduler:
    def __init__(self) -> None:
        self.requests = {}
        self.outputs = []

    def schedule(self):
        return self.outputs.pop(0)


def _req(status, local=0, external=0):
    stats = SimpleNamespace(num_local_cached_tokens=local, num_external_cached_tokens=external)
    return SimpleNamespace(status=status, prefill_stats=stats, num_computed_tokens=0,
                           num_prompt_tokens=100)


def test_a_skipped_request_is_read_once_admitted():
    sched = _Scheduler()
    rec = StepRecorder(sched)
    skipped = _req(RequestStatus.WAITING)  # waits for its fetch: stats not set yet
    sched.requests = {"a": skipped}
    sched.outputs = [SimpleNamespace(num_scheduled_tokens={}),
                     SimpleNamespace(num_scheduled_tokens={}),
                     SimpleNamespace(num_scheduled_tokens={"a": 36})]
    sched.schedule()
    assert "a" not in rec.hits
    # Admitted with a load of 64 tokens from the CPU tier, 0 from the GPU.
    sched.requests["a"] = _req(RequestStatus.WAITING_FOR_REMOTE_KVS, 0, 64)
    sched.schedule()
    assert rec.hits["a"] == (0, 64)
    sched.requests["a"].num_computed_tokens = 100
    sched.schedule()
    assert rec.hits["a"] == (0, 64)
