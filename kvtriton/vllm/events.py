"""The CPU tier's cache events in vLLM's ``kv_events`` types (``take_events``).

The CPU pool records its events with dense key ids; vLLM's event consumers (routers, gateways)
expect one ``BlockStored`` / ``BlockRemoved`` per block hash, with vLLM's field names and its
external hash form, ``medium="CPU"`` and ``locality="LOCAL"``, as vLLM's SimpleCPUOffloadConnector
emits them. A store's payload (parent hash, token ids, LoRA) is captured when the store is issued,
while the request is at hand, and attached when the store completes; a hash registered without
one (a partial-block entry, a Mamba state) is emitted with an empty payload, as vLLM does too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import MEDIUM_CPU, AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_group_id,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

from kvtriton import pool_interface as kvpool
from kvtriton.vllm.keys import KeyIds

__all__ = ["KVEventTranslator", "StorePayload"]


@dataclass(slots=True)
class StorePayload:
    """What a ``BlockStored`` says about a block besides its hash."""

    parent_block_hash: bytes | None
    token_ids: list[int]
    lora_id: int | None
    lora_name: str | None
    extra_keys: tuple[Any, ...] | None


class KVEventTranslator:
    """Turns the CPU pool's events into vLLM's; ``remember`` a store's payload first."""

    def __init__(self, keys: KeyIds, kv_cache_groups: list[Any]) -> None:
        self._keys = keys
        self._specs = [g.kv_cache_spec for g in kv_cache_groups]
        self._payloads: dict[int, StorePayload] = {}

    def remember(self, key: int, payload: StorePayload) -> None:
        self._payloads[key] = payload

    def referenced_keys(self) -> list[int]:
        """The keys of payloads waiting for their store to complete."""
        return list(self._payloads)

    def forget(self, keys: list[int]) -> None:
        """Drop payloads of stores that will not complete (failed or abandoned)."""
        for k in keys:
            self._payloads.pop(k, None)

    def _stored(self, key: int, primary: bool) -> BlockStored | None:
        h = self._keys.hash_of(key)
        if h is None:
            return None
        g = get_group_id(h)
        spec = self._specs[g]
        p = self._payloads.pop(key, None) if primary else None
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(get_block_hash(h))],
            parent_block_hash=(None if p is None or p.parent_block_hash is None
                               else maybe_convert_block_hash(p.parent_block_hash)),
            token_ids=p.token_ids if p is not None else [],
            block_size=spec.block_size if primary else 0,
            lora_id=p.lora_id if p is not None else None,
            medium=MEDIUM_CPU,
            lora_name=p.lora_name if p is not None else None,
            extra_keys=to_event_extra_keys(p.extra_keys and [p.extra_keys]) if p else None,
            group_idx=g,
            kv_cache_spec_kind=get_kv_cache_spec_kind(spec).value,
            kv_cache_spec_sliding_window=get_kv_cache_spec_sliding_window(spec),
            locality="LOCAL",
        )

    def translate(self, events: list) -> list:
        out: list = []
        for ev in events:
            if isinstance(ev, kvpool.BlockStored):
                for i, key in enumerate(ev.block_hashes):
                    e = self._stored(key, primary=i == 0)
                    if e is not None:
                        out.append(e)
            elif isinstance(ev, kvpool.BlockRemoved):
                for key in ev.block_hashes:
                    h = self._keys.hash_of(key)
                    if h is not None:
                        out.append(BlockRemoved(
                            block_hashes=[maybe_convert_block_hash(get_block_hash(h))],
                            medium=MEDIUM_CPU, group_idx=get_group_id(h), locality="LOCAL"))
            elif isinstance(ev, kvpool.AllBlocksCleared):
                self._payloads.clear()
                out.append(AllBlocksCleared())
        return out
