"""Content-addressed object names: what a block holds, never where it came from.

A block's name is ``kvt1-<fingerprint>-<hash>``: ``hash`` is vLLM's chained block hash with its
group id (``BlockHashWithGroupId``: the tokens of the block and of every block before it, with
their LoRA, multimodal and salt keys), and ``fingerprint`` a digest of everything else that makes
the bytes of a block differ: model and revision, dtypes, the groups' layout and block sizes, the
parallel layout and this worker's rank in it, the platform and its KV layout, vLLM's version, and
the hash function with its seed (so two servers whose block hashes are not comparable never
share a name). Replicas of one model on one kind of machine agree on every field and share
names; anything else cannot collide.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FORMAT", "fingerprint", "object_names", "rank_fingerprint", "rank_fingerprints"]

#: The object format's version, part of every fingerprint: a change to ``objects`` bumps it.
FORMAT = 1


def fingerprint(fields: Mapping[str, Any]) -> str:
    """16 hex digits of SHA-256 over ``fields`` (JSON, sorted keys) and ``FORMAT``."""
    text = json.dumps({**fields, "format": FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def rank_fingerprint(fields: Mapping[str, Any], tp_rank: int, pp_rank: int, tp_size: int,
                     pp_size: int) -> str:
    """The fingerprint of one worker of a ``tp_size`` x ``pp_size`` layout."""
    return fingerprint({**fields, "tp_rank": tp_rank, "pp_rank": pp_rank, "tp_size": tp_size,
                        "pp_size": pp_size})


def rank_fingerprints(fields: Mapping[str, Any], tp_size: int, pp_size: int) -> list[str]:
    """Every worker's fingerprint, in rank order (``rank = pp_rank * tp_size + tp_rank``)."""
    return [rank_fingerprint(fields, r % tp_size, r // tp_size, tp_size, pp_size)
            for r in range(tp_size * pp_size)]


def object_names(fp: str, hashes: Sequence[bytes]) -> list[str]:
    """The store's names of the blocks whose ``BlockHashWithGroupId`` bytes are ``hashes``."""
    prefix = f"kvt{FORMAT}-{fp}-"
    return [prefix + h.hex() for h in hashes]
