"""Chained 64-bit block hashes and the dense interning the planner's tensors index by.

A prefix is cut into ``hash_block_size``-token blocks; block i's hash is
``H(h_{i-1}, tokens of block i, extra keys)``, so equal hashes mean equal prefixes. The hash is
BLAKE2b truncated to 64 bits: deterministic across processes and machines (unlike ``hash()``) and
computed in C. Groups of a hybrid model share one CPU pool, so each group keys its blocks by
``group_key(h, group)``, a cheap 64-bit mix that keeps groups apart.

``HashIndex`` turns 64-bit keys into dense ids 0, 1, 2, ... so that presence and in-flight state
can live in flat tensors indexed by id.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvtriton.validation import is_int

if TYPE_CHECKING:
    from kvtriton.specs import KVLayout

__all__ = [
    "HashIndex",
    "chain_hashes",
    "group_key",
    "group_keys",
    "group_keys_array",
    "mix64",
    "mix64_array",
    "request_keys",
]

_MASK = (1 << 64) - 1
_ROOT = 0x6B76_7472_6974_6F6E  # "kvtriton": the parent hash of a sequence's first block


def _blake64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _encode_extra(extra: object) -> bytes:
    """A stable byte encoding of one block's extra keys (LoRA id, multimodal hashes, ...)."""
    return repr(extra).encode()


def chain_hashes(
    token_ids: Sequence[int] | np.ndarray,
    hash_block_size: int,
    *,
    parent: int | None = None,
    extra_keys: Sequence[object] | None = None,
    lora_id: int | None = None,
) -> list[int]:
    """Chained 64-bit hashes of every *full* ``hash_block_size``-token block of ``token_ids``.

    ``extra_keys[i]`` (optional) is folded into block i, as multimodal hashes are in vLLM;
    ``lora_id`` is folded into every block, so two adapters never share a prefix. A trailing
    partial block gets no hash. Returns one Python int in [0, 2**64) per full block.
    """
    if hash_block_size <= 0:
        raise ValueError(f"hash_block_size must be positive, got {hash_block_size}")
    raw = np.asarray(token_ids)
    if raw.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {raw.shape}")
    if raw.size and raw.dtype.kind not in "iu":
        # A cast would truncate 1.5 to 1 and hash it as token 1.
        raise ValueError(f"token_ids must be integers, got dtype {raw.dtype}")
    if parent is not None and not (is_int(parent) and 0 <= parent <= _MASK):
        raise ValueError(f"parent {parent!r} is not a 64-bit unsigned int")
    if lora_id is not None and not (is_int(lora_id) and -(1 << 63) <= lora_id < 1 << 63):
        raise ValueError(f"lora_id {lora_id!r} is not a 64-bit signed int")
    tokens = np.ascontiguousarray(raw, dtype=np.int64)
    n_full = len(tokens) // hash_block_size
    if extra_keys is not None and len(extra_keys) < n_full:
        raise ValueError(f"extra_keys has {len(extra_keys)} entries for {n_full} blocks")
    prev = _ROOT if parent is None else parent
    lora = b"" if lora_id is None else struct.pack("<q", lora_id)
    out = []
    for i in range(n_full):
        body = tokens[i * hash_block_size:(i + 1) * hash_block_size].tobytes()
        # A block with no extra keys (None) hashes as if none were given, so a text-only prefix
        # matches the blocks before a multimodal request's first image.
        extra = b"" if extra_keys is None or extra_keys[i] is None else _encode_extra(extra_keys[i])
        prev = _blake64(struct.pack("<Q", prev) + lora + body + extra)
        out.append(prev)
    return out


def mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijective 64-bit mix."""
    x &= _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def mix64_array(x: np.ndarray) -> np.ndarray:
    """``mix64`` of every element of a uint64 array (wrapping arithmetic, a new array)."""
    x = np.asarray(x, dtype=np.uint64).copy()
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return x


_GROUP_SALT = 0x9E3779B97F4A7C15


def group_key(h: int, group: int) -> int:
    """The key group ``group`` stores a block under, for the chain hash ``h`` at its end."""
    return mix64(h ^ (_GROUP_SALT * (group + 1)))


def group_keys(hashes: Iterable[int], group: int) -> list[int]:
    return [group_key(h, group) for h in hashes]


def group_keys_array(hashes: np.ndarray, group: int) -> np.ndarray:
    """``group_key(h, group)`` for every ``h`` of a uint64 array."""
    salt = np.uint64((_GROUP_SALT * (group + 1)) & _MASK)
    return mix64_array(np.asarray(hashes, dtype=np.uint64) ^ salt)


def request_keys(layout: KVLayout, index: HashIndex, block_hashes: Iterable[int]) -> np.ndarray:
    """Dense key ids ``[num_groups, len(block_hashes)]`` (int64) of a token sequence's chain
    hashes, one row per group of ``layout``, interned in ``index``."""
    hashes = [int(h) for h in block_hashes]
    out = np.empty((layout.num_groups, len(hashes)), dtype=np.int64)
    for g in range(layout.num_groups):
        out[g] = index.intern_many(group_key(h, g) for h in hashes)
    return out


class HashIndex:
    """Interns 64-bit hashes as dense ids ``0..len-1`` and maps them back.

    Ids are never reused, so a tensor indexed by id stays valid as the index grows; ``capacity``
    is a power-of-two bound that growing tensors can follow. ``intern`` is O(1) amortized.
    """

    def __init__(self, initial_capacity: int = 1024) -> None:
        if initial_capacity <= 0:
            raise ValueError(f"initial_capacity must be positive, got {initial_capacity}")
        self._ids: dict[int, int] = {}
        self._hashes = np.zeros(initial_capacity, dtype=np.uint64)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, h: int) -> bool:
        return h in self._ids

    @property
    def capacity(self) -> int:
        return len(self._hashes)

    def intern(self, h: int) -> int:
        """The dense id of ``h``, assigning the next one if ``h`` is new."""
        hid = self._ids.get(h)
        if hid is None:
            self._check(h)
            hid = len(self._ids)
            if hid == len(self._hashes):
                self._hashes = np.concatenate([self._hashes, np.zeros_like(self._hashes)])
            self._hashes[hid] = h
            self._ids[h] = hid
        return hid

    @staticmethod
    def _check(h: object) -> None:
        # A float would be stored truncated (1.5 -> 1) and break the round trip through hash_of.
        if not (is_int(h) and 0 <= h <= _MASK):
            raise ValueError(f"hash {h!r} is not a 64-bit unsigned int")

    def intern_many(self, hashes: Iterable[int]) -> np.ndarray:
        """Dense ids of ``hashes`` as an int64 array, interning new ones in order.

        Every new hash is checked first, so a bad one leaves the index unchanged.
        """
        hashes = list(hashes)
        for h in hashes:
            if h not in self._ids:
                self._check(h)
        return np.fromiter((self.intern(h) for h in hashes), dtype=np.int64, count=len(hashes))

    def get(self, h: int) -> int | None:
        """The id of ``h`` or ``None`` if it was never interned."""
        return self._ids.get(h)

    def hash_of(self, hid: int) -> int:
        """The 64-bit hash behind dense id ``hid``."""
        if not 0 <= hid < len(self._ids):
            raise ValueError(f"hash id {hid} out of range [0, {len(self._ids)})")
        return int(self._hashes[hid])
