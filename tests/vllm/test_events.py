"""The CPU tier's cache events (``kvtriton.vllm.events``) in vLLM's ``kv_events`` types, through
the scheduler role in vLLM's real ``Scheduler``: vLLM's field names, hashes and parent hashes,
``medium="CPU"``.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import BS, build, gpu_hash_list, run, tokens
from kvtriton.sim.vllm_scheduler import vllm_request

pytestmark = pytest.mark.scheduler_role


def test_kv_events_use_vllm_field_names(model_config_dir):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    s, _side, drv = build(model_config_dir, cpu_blocks=3, enable_kv_cache_events=True,
                         extra_config={"setup": "eager+restore"})
    seen = []
    take = s.connector.take_events

    def record():  # the scheduler drains the connector's events every step
        events = list(take())
        seen.extend(events)
        return events

    s.connector.take_events = record
    p = tokens(56, 3 * BS)
    drv.add(vllm_request("a", [*p, 1], 1, BS))
    run(drv)
    events, seen[:] = list(seen), []
    stored = [e for e in events if isinstance(e, BlockStored)]
    hashes = [maybe_convert_block_hash(h[:-4]) for h in gpu_hash_list(p)]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert stored[1].parent_block_hash == hashes[0] and stored[0].parent_block_hash is None
    assert stored[0].token_ids == p[:BS] and stored[0].block_size == BS
    assert all(e.medium == "CPU" and e.locality == "LOCAL" and e.group_idx == 0 for e in stored)
    drv.add(vllm_request("b", [*tokens(57, BS), 1], 1, BS))
    run(drv)
    removed = [e for e in seen if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[hashes[0]]]
