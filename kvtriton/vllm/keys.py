"""Dense key ids for vLLM's block hashes, and ids reserved for hashes a request has not made yet.

The planner indexes its arrays by dense int keys (glossary: *key*). vLLM names a cached block by a
``BlockHashWithGroupId``: the chain hash bytes of the block's last hash boundary followed by the
4-byte big-endian group id. ``KeyIds`` interns those bytes exactly (no truncation, so no
collision can merge two prefixes).

*Reserved* ids exist because the planner takes a request's keys once, at admission, for every
position it will ever have, while vLLM hashes a block only once its tokens exist (decode appends
them step by step). At admission the adapter reserves one id per future (group, hash position);
when vLLM later hashes that position the hash is *bound* to the reserved id, which becomes its
key from then on. A hash that already has an id when its position is bound (another request
made the same tokens first) keeps the older id; the reserved one stays unbound and that position
is never stored for this request (counted in ``collisions``). Unbound reserved ids were never in a
pool, so they are recycled once the request's row is released.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KeyIds", "group_suffixes"]


def group_suffixes(num_groups: int) -> list[bytes]:
    """The bytes vLLM appends to a block hash for each group (``make_block_hash_with_group_id``)."""
    return [g.to_bytes(4, "big", signed=False) for g in range(num_groups)]


class KeyIds:
    """Interns ``BlockHashWithGroupId`` bytes as dense ids, with reservable ids."""

    __slots__ = ("_free", "_hashes", "_ids", "collisions")

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._hashes: list[bytes | None] = []  # None: a reserved id not bound to a hash
        self._free: list[int] = []  # recycled reserved ids
        self.collisions = 0

    def __len__(self) -> int:
        """Ids handed out so far (the bound ones and the reserved ones still held)."""
        return len(self._hashes) - len(self._free)

    @property
    def capacity(self) -> int:
        """One past the largest id ever handed out: what arrays indexed by id must hold."""
        return len(self._hashes)

    def id_of(self, key: bytes) -> int:
        """The id of ``key``, interning it if new."""
        kid = self._ids.get(key)
        if kid is None:
            kid = len(self._hashes)
            self._hashes.append(key)
            self._ids[key] = kid
        return kid

    def get(self, key: bytes) -> int | None:
        return self._ids.get(key)

    def hash_of(self, kid: int) -> bytes | None:
        """The bytes behind ``kid``, or None for a reserved id not yet bound."""
        return self._hashes[kid]

    def reserve(self, n: int) -> np.ndarray:
        """``n`` fresh ids for hashes not yet made (int64), recycled ones first."""
        take = min(n, len(self._free))
        out = np.empty(n, dtype=np.int64)
        if take:
            out[:take] = self._free[len(self._free) - take:]
            del self._free[len(self._free) - take:]
        start = len(self._hashes)
        out[take:] = np.arange(start, start + n - take)
        self._hashes.extend([None] * (n - take))
        return out

    def bind(self, key: bytes, kid: int) -> bool:
        """Make reserved ``kid`` the id of ``key``; False (a collision) if ``key`` has one."""
        if key in self._ids:
            self.collisions += 1
            return False
        if self._hashes[kid] is not None:
            raise ValueError(f"key id {kid} is already bound")
        self._hashes[kid] = key
        self._ids[key] = kid
        return True

    def release(self, kids: np.ndarray | list[int]) -> None:
        """Recycle the reserved ids among ``kids`` that were never bound (bound ones stay)."""
        hashes = self._hashes
        self._free.extend(k for k in map(int, kids) if hashes[k] is None)

    def num_reserved(self) -> int:
        """Reserved ids held now (handed out, not bound, not recycled)."""
        return sum(h is None for h in self._hashes) - len(self._free)
