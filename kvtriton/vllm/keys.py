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

*Bound* ids are recycled too, or a server would grow by one id (and every per-key array entry
behind it) for each distinct block it ever saw. ``recycle`` forgets the hashes of ids the caller
found unreferenced (in neither pool, no request, no transfer: ``SchedulerSide`` sweeps for them);
``id_of`` and ``reserve`` hand recycled ids out again before making new ones, so ``capacity``
follows the ids alive at once, not the ids ever made.
"""

from __future__ import annotations

import numpy as np

__all__ = ["KeyIds", "group_suffixes"]


def group_suffixes(num_groups: int) -> list[bytes]:
    """The bytes vLLM appends to a block hash for each group (``make_block_hash_with_group_id``)."""
    return [g.to_bytes(4, "big", signed=False) for g in range(num_groups)]


class KeyIds:
    """Interns ``BlockHashWithGroupId`` bytes as dense ids, with reservable ids."""

    __slots__ = ("_free", "_hashes", "_ids", "collisions", "recycled")

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._hashes: list[bytes | None] = []  # None: reserved and unbound, or free
        self._free: list[int] = []  # ids to hand out again (unbound reserved ones, recycled ones)
        self.collisions = 0
        self.recycled = 0  # bound ids recycled so far

    def __len__(self) -> int:
        """Ids handed out so far (the bound ones and the reserved ones still held)."""
        return len(self._hashes) - len(self._free)

    @property
    def capacity(self) -> int:
        """One past the largest id ever handed out: what arrays indexed by id must hold."""
        return len(self._hashes)

    @property
    def num_bound(self) -> int:
        """Ids bound to a hash now."""
        return len(self._ids)

    def id_of(self, key: bytes) -> int:
        """The id of ``key``, interning it if new (a recycled id first)."""
        kid = self._ids.get(key)
        if kid is None:
            if self._free:
                kid = self._free.pop()
                self._hashes[kid] = key
            else:
                kid = len(self._hashes)
                self._hashes.append(key)
            self._ids[key] = kid
        return kid

    def bound_ids(self) -> np.ndarray:
        """Every id bound to a hash now (int64, in no particular order)."""
        return np.fromiter(self._ids.values(), dtype=np.int64, count=len(self._ids))

    def recycle(self, kids: np.ndarray | list[int]) -> None:
        """Forget the hashes of bound ``kids`` and hand the ids out again. The caller vouches
        that nothing refers to them any more; an unbound id is a ``ValueError`` (nothing
        changes)."""
        kids = list(dict.fromkeys(int(k) for k in kids))
        hashes = self._hashes
        bad = [k for k in kids if not 0 <= k < len(hashes) or hashes[k] is None]
        if bad:
            raise ValueError(f"recycle: key ids {bad[:5]} are not bound")
        ids = self._ids
        for k in kids:
            del ids[hashes[k]]
            hashes[k] = None
        self._free.extend(kids)
        self.recycled += len(kids)

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
        return len(self._hashes) - len(self._ids) - len(self._free)
