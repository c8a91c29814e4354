"""What the differential (``bench.conformance.differential``) knows of kvtriton's side without
asking it.

kvtriton answers from its own books; a check that reads those books to excuse an answer lets a
wrong book excuse itself. These models are kept from what crosses the connector's boundary
(vLLM's requests, the transfers kvtriton issues, the reports the driver sends), so they hold
while vLLM and kvtriton are apart as well as in step:

- ``HashOrigins``: which request first made each block hash, seen from vLLM's requests. A key
  collision (``kvtriton.vllm.keys``: a position whose hash already had an id when the request
  hashed it) is possible only where another request made that hash first.
- ``TierModel``: the CPU tier's contents, pins and free queue, from the tier's rules (an LRU
  queue: a block taken is the head's, a hashed block freed joins the tail, an unhashed one the
  head; a completed store registers its hashes and frees its blocks head first; a failed one
  frees them unhashed; a lookup pins its hit, an allocation keeps the accepted part pinned as
  the load and releases the rest, a finish releases the hit and an unissued load).
- ``expected_flush``: the finish flush those rules give: every confirmed block past the store
  cursor whose hash is neither cached, in flight nor already queued, within the free blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["HashOrigins", "RuleBroken", "TierModel", "expected_flush"]


class RuleBroken(Exception):
    """kvtriton's side did what the tier's rules do not allow (a pin of nothing, say)."""


class HashOrigins:
    """The request that first made each block hash, and the positions a request hashed after
    another request had made the same hash (the only places a key collision may be)."""

    def __init__(self) -> None:
        self._maker: dict[bytes, str] = {}
        self._seen: dict[str, int] = {}  # rid -> its hash positions observed so far
        self._admitted: set[str] = set()
        self._collided: dict[str, set[int]] = {}
        self.requests: dict[str, object] = {}  # rid -> the vLLM request, while it lives

    def admitted(self, request) -> None:
        """``request`` was allocated: positions it hashes from now on are reserved ids."""
        self.observe(request)
        self._admitted.add(request.request_id)

    def observe(self, request) -> None:
        """Note the hashes ``request`` made since it was last seen."""
        self.requests[request.request_id] = request
        self._sweep([request])

    def observe_all(self) -> None:
        """Note the hashes every live request made since it was last seen. Two requests that
        made one hash since then are both marked: which came first is not known here."""
        self._sweep(list(self.requests.values()))

    def _sweep(self, requests: list) -> None:
        new: dict[bytes, list[tuple[str, int]]] = {}
        for request in requests:
            rid = request.request_id
            hashes = request.block_hashes
            start = self._seen.get(rid, 0)
            for j in range(start, len(hashes)):
                new.setdefault(hashes[j], []).append((rid, j))
            self._seen[rid] = max(start, len(hashes))
        for h, made in new.items():
            maker = self._maker.setdefault(h, made[0][0])
            makers = {rid for rid, _ in made} | {maker}
            for rid, j in made:
                if len(makers) > 1 and rid in self._admitted:
                    self._collided.setdefault(rid, set()).add(j)

    def finished(self, request) -> None:
        self.observe(request)
        rid = request.request_id
        self.requests.pop(rid, None)
        self._admitted.discard(rid)

    def collided(self, rid: str) -> set[int]:
        """Positions of ``rid`` hashed while it was admitted, another request having made the
        same hash before."""
        return self._collided.get(rid, set())


class TierModel:
    """kvtriton's CPU tier as its rules make it (block 0 is null): which hash each block holds,
    its references, and the free queue, head (next to be taken) first."""

    def __init__(self, num_blocks: int) -> None:
        # A fresh pool hands out 1, 2, ... (unhashed blocks enter at the head).
        self.free: list[int] = list(range(1, num_blocks))
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.where: dict[bytes, int] = {}
        self.hits: dict[str, list[int]] = {}  # rid -> blocks its pending hit pins, in order
        self.loads: dict[str, tuple[list[int], bool]] = {}  # rid -> (CPU blocks, issued)
        self.stores: dict[int, tuple[list[int], list[bytes]]] = {}  # event -> (blocks, hashes)
        self.flush: tuple[list[int], list[bytes]] = ([], [])  # queued for the next batch

    # ---- the pool's own moves --------------------------------------------------------------

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            raise RuleBroken(f"the tier model has {len(self.free)} free blocks, {n} taken")
        out = self.free[:n]
        del self.free[:n]
        for b in out:
            h = self.hash[b]
            if h is not None:
                self.hash[b] = None
                if self.where.get(h) == b:
                    del self.where[h]
            self.ref[b] = 1
        return out

    def _pin(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if not self.ref[b]:
                self.free.remove(b)
            self.ref[b] += 1

    def _release(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if self.ref[b] <= 0:
                raise RuleBroken(f"the tier model releases block {b}, which holds no pin")
            self.ref[b] -= 1
            if not self.ref[b]:
                if self.hash[b] is None:
                    self.free.insert(0, b)
                else:
                    self.free.append(b)

    # ---- the transfers' lifecycle ------------------------------------------------------------

    def blocks_of(self, hashes: Sequence[bytes]) -> list[int] | None:
        """The blocks holding ``hashes``, or None if one is not cached."""
        out = [self.where.get(h) for h in hashes]
        return None if None in out else out  # type: ignore[return-value]

    def cached_run(self, hashes: Sequence[bytes]) -> int:
        """How many of ``hashes``, from the first, are cached."""
        n = 0
        while n < len(hashes) and hashes[n] in self.where:
            n += 1
        return n

    def lookup(self, rid: str, blocks: list[int]) -> None:
        """``rid``'s new hit pins ``blocks`` in place of its old one; blocks in both stay
        pinned (only where neither names a block twice)."""
        old = self.hits.pop(rid, [])
        new = list(blocks)
        kept = set(old) & set(new)
        if kept and len(set(old)) == len(old) and len(set(new)) == len(new):
            old = [b for b in old if b not in kept]
            new_pins = [b for b in new if b not in kept]
        else:
            new_pins = new
        self._release(old)
        self._pin(new_pins)
        if blocks:
            self.hits[rid] = list(blocks)

    def accept(self, rid: str, n: int) -> list[int]:
        """``rid`` was allocated with ``n`` blocks of its hit: those stay pinned as its load,
        the rest of the hit is released. Returns the load's CPU blocks."""
        pending = self.hits.pop(rid, [])
        if n > len(pending):
            raise RuleBroken(f"{rid}: {n} blocks accepted of a pending hit of {len(pending)}")
        if not n:
            self._release(pending)
            return []
        load = pending[:n]
        self._pin(load)
        self._release(pending)
        self.loads[rid] = (load, False)
        return load

    def unissued_loads(self) -> list[str]:
        return [rid for rid, (_, issued) in self.loads.items() if not issued]

    def issue_loads(self) -> None:
        for rid, (blocks, _) in list(self.loads.items()):
            self.loads[rid] = (blocks, True)

    def store(self, event: int, hashes: list[bytes]) -> list[int]:
        """A store batch of new blocks for ``hashes`` (the queued flush joins it) under
        ``event``; returns the new blocks."""
        cpu = self._take(len(hashes))
        f_cpu, f_hashes = self.flush
        self.flush = ([], [])
        if event >= 0:
            self.stores[event] = (cpu + f_cpu, list(hashes) + f_hashes)
        return cpu

    def drop(self, rid: str) -> None:
        """``rid`` finished: its pending hit and a load not yet issued are released."""
        self._release(self.hits.pop(rid, []))
        ld = self.loads.get(rid)
        if ld is not None and not ld[1]:
            del self.loads[rid]
            self._release(ld[0])

    def queue_flush(self, hashes: list[bytes]) -> list[int]:
        cpu = self._take(len(hashes))
        self.flush[0].extend(cpu)
        self.flush[1].extend(hashes)
        return cpu

    def reports(self, finished_loads: Iterable[str], completed: Iterable[int],
                failed: Iterable[int]) -> None:
        """Loads finished, stores completed (hashes registered, blocks freed head first) and
        stores failed (blocks freed unhashed), in that order."""
        for rid in finished_loads:
            ld = self.loads.get(rid)
            if ld is not None and ld[1]:
                del self.loads[rid]
                self._release(ld[0])
        for ev in completed:
            if ev not in self.stores:
                continue
            cpu, hashes = self.stores.pop(ev)
            for b, h in zip(cpu, hashes, strict=True):
                self.hash[b] = h
                self.where[h] = b
            self._release(cpu)
        for ev in failed:
            if ev in self.stores:
                self._release(self.stores.pop(ev)[0])

    # ---- against the tier ------------------------------------------------------------------

    def differs(self, free: list[int], ref: Sequence[int], hashes: list[bytes | None]
                ) -> str | None:
        """What the tier (its free queue, references and block hashes) has otherwise than this
        model, or None."""
        for b in range(1, len(self.hash)):
            if hashes[b] != self.hash[b]:
                return (f"CPU block {b} holds {_short(hashes[b])}, the tier's rules give "
                        f"{_short(self.hash[b])}")
        for b in range(1, len(self.ref)):
            if ref[b] != self.ref[b]:
                return f"CPU block {b} has {ref[b]} pins, the tier's rules give {self.ref[b]}"
        if free != self.free:
            pairs = enumerate(zip(free, self.free, strict=False))  # the first mismatch
            i = next((i for i, (a, m) in pairs if a != m), min(len(free), len(self.free)))
            return (f"free queue {free[max(0, i - 2):i + 3]}... at {i} of {len(free)}, the "
                    f"tier's rules give {self.free[max(0, i - 2):i + 3]}...")
        return None


def _short(h: bytes | None) -> str:
    return "nothing" if h is None else h[:4].hex()


def expected_flush(table: Sequence[int], cursor: int, ready: int, position_hash: Sequence[bytes],
                   gpu_hash, skip: set[int], taken: set[bytes], busy_blocks: set[int],
                   free: int) -> list[int]:
    """The GPU blocks a finish flush must queue: positions ``cursor .. ready`` of ``table``
    whose block holds that position's hash (``position_hash``; ``gpu_hash(block)`` reads the
    GPU pool), not at a position in ``skip``, the hash not in ``taken`` (cached, in flight or
    already queued) and the block not in ``busy_blocks`` (a store in flight), at most ``free``
    of them, in table order."""
    out: list[int] = []
    seen = set(taken)
    for p in range(cursor, ready):
        b = table[p]
        h = gpu_hash(b)
        if p in skip or h is None or h != position_hash[p] or h in seen or b in busy_blocks:
            continue
        if len(out) >= free:
            break
        out.append(b)
        seen.add(h)
    return out
