"""Integrity mode: real KV bytes move through the real ``TransferEngine`` during a simulation.

Every block the simulated model computes is filled with bytes derived from its key. A block is
checked at the moment it is registered under a key, in the GPU prefix cache (computed, or loaded
from the CPU tier) and in the CPU tier (a store completed), and every block loaded from the CPU
tier as it lands. Two things must hold: its bytes are its key's, and something wrote them for that
key since the block was last handed out: a computation or a load into a GPU block, a store from a
GPU block registered under that key into a CPU block. A block registered that nothing wrote, or
whose bytes differ, stops the run with ``IntegrityError`` naming the block, group, key and step.

The tensors belong to a miniature copy of the layout (same groups, block sizes and hash size; one
layer, one head of four int32 values; tiny Mamba states), so the check costs little while
exercising the same descriptor tables and copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from kvtriton.engine import TransferEngine
from kvtriton.engine.descriptors import allocate_kv_caches
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.records import PlannerMeta
from kvtriton.sim.errors import IntegrityError
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

__all__ = ["IntegrityChecker", "IntegrityError", "miniature"]

# Per block, what the checker tracks besides the bytes: the key written, its group, the key held.
_TRACKING_BYTES = 3 * 8
_NONE = -1


def miniature(layout: KVLayout) -> KVLayout:
    """``layout`` with the same groups and block sizes but tiny per-block segments."""
    groups = []
    for g in layout.groups:
        if isinstance(g, MambaSpec):
            groups.append(MambaSpec(g.block_size, (4,), (8,), 1, dtype=torch.int32))
        elif isinstance(g, SlidingWindowSpec):
            groups.append(SlidingWindowSpec(g.block_size, 1, 4, 1, g.sliding_window,
                                            dtype=torch.int32))
        else:
            groups.append(FullAttentionSpec(g.block_size, 1, 4, 1, dtype=torch.int32))
    return KVLayout(groups, layout.hash_block_size, name=f"{layout.name}-mini")


_MASK64 = (1 << 64) - 1


@lru_cache(maxsize=64)
def _positions(nbytes: int) -> np.ndarray:
    """One 64-bit word per 8 bytes of a segment, each distinct: bytes copied to the wrong offset
    within a block differ from the bytes expected there."""
    words = np.arange(1, -(-nbytes // 8) + 1, dtype=np.uint64)
    return words * np.uint64(0x9E3779B97F4A7C15)


@lru_cache(maxsize=1 << 14)
def _pattern(key: int, segment: int, nbytes: int) -> bytes:
    """Bytes a segment of the block keyed ``key`` holds: its positions' words XOR a word mixed
    from the key and segment. Bytes, so one memcmp compares a block. NumPy and bytes, not torch:
    a block is written and compared one at a time, and a torch op's dispatch on a few hundred
    bytes cost most of integrity mode's time."""
    mixed = (key * 0xBF58476D1CE4E5B9 + segment * 0x94D049BB133111EB + 1) & _MASK64
    return (_positions(nbytes) ^ np.uint64(mixed)).view(np.uint8)[:nbytes].tobytes()


def _bytes_of(pattern: bytes) -> np.ndarray:
    return np.frombuffer(pattern, dtype=np.uint8)


class _Provenance:
    """Per block of one tier: ``wrote`` the key whose bytes were last written into it and not
    yet registered (``_NONE``: nothing since), ``group`` the group of that write, ``holds`` the
    key it is registered under and was checked for (``_NONE`` once evicted)."""

    __slots__ = ("group", "holds", "wrote")

    def __init__(self, num_blocks: int) -> None:
        self.wrote = np.full(num_blocks, _NONE, dtype=np.int64)
        self.group = np.full(num_blocks, _NONE, dtype=np.int64)
        self.holds = np.full(num_blocks, _NONE, dtype=np.int64)


def _copied(src: _Provenance, src_blocks, dst: _Provenance, dst_blocks, groups) -> None:
    """Blocks ``src_blocks`` of one tier were copied into ``dst_blocks`` of the other: each
    destination now holds what its source was registered under, and is registered under
    nothing until its tier registers it."""
    s = np.asarray(src_blocks, dtype=np.int64)
    d = np.asarray(dst_blocks, dtype=np.int64)
    dst.wrote[d] = src.holds[s]
    dst.group[d] = groups
    dst.holds[d] = _NONE


class IntegrityChecker:
    """Owns the miniature KV tensors and the engine; the scheduler calls it as its
    ``kvtriton.sim.hooks.IntegrityHook``, the serving loop attaches it to both pools.

    ``blocks_checked``: loaded blocks checked as they landed; ``registrations_checked``: blocks
    checked as they were registered (GPU prefix cache and CPU tier); ``blocks_filled``: blocks
    computed."""

    def __init__(self, layout: KVLayout, num_gpu_blocks: int, num_cpu_blocks: int,
                 backend: str = "torch") -> None:
        self.layout = miniature(layout)
        kv = allocate_kv_caches(self.layout, num_gpu_blocks + 1)
        for group in kv:
            for layer in group:
                for t in (layer if isinstance(layer, tuple) else (layer,)):
                    t.fill_(-1)
        self.engine = TransferEngine(self.layout, kv, num_cpu_blocks + 1, backend=backend)
        # NumPy views sharing the engine's memory (CPU tensors), per group: (view, offset) of
        # each GPU segment, and the host pool.
        self._gpu_arrays = [[(view.numpy(), off) for view, off in segs]
                            for segs in self.engine.segments]
        self._cpu_array = self.engine.cpu_pool.numpy()
        self._gpu = _Provenance(num_gpu_blocks + 1)
        self._cpu = _Provenance(num_cpu_blocks + 1)
        self._key_group: dict[int, int] = {}
        self._gpu_pool: BlockPool | None = None
        self._cpu_pool: BlockPool | None = None
        self._loaded: set[int] = set()
        self._step: int | None = None
        self.blocks_checked = 0
        self.blocks_filled = 0
        self.registrations_checked = 0

    @staticmethod
    def bytes_needed(layout: KVLayout, num_gpu_blocks: int, num_cpu_blocks: int) -> int:
        """Memory a checker for these pool sizes allocates: every group's miniature tensors hold
        every GPU block id, the host pool one miniature CPU block per CPU block."""
        mini = miniature(layout)
        return ((num_gpu_blocks + 1) * (sum(mini.group_block_bytes) + _TRACKING_BYTES)
                + (num_cpu_blocks + 1) * (mini.cpu_block_bytes + _TRACKING_BYTES))

    # ---- the hook ---------------------------------------------------------------------------

    def attach(self, gpu: BlockPool, cpu: BlockPool | None) -> None:
        """Check every block registered in ``gpu`` (the prefix cache) and ``cpu`` (the tier, or
        None) as it is registered. Raises ``ValueError`` if a pool has more blocks than the
        tensors."""
        held = self.engine.segments[0][0][0].shape[0]
        if gpu.num_blocks > held:
            raise ValueError(f"integrity tensors hold {held} GPU blocks, the pool has "
                             f"{gpu.num_blocks}")
        if cpu is not None and cpu.num_blocks > self.engine.num_cpu_blocks:
            raise ValueError(f"integrity host pool holds {self.engine.num_cpu_blocks} CPU "
                             f"blocks, the tier has {cpu.num_blocks}")
        self._gpu_pool, self._cpu_pool = gpu, cpu
        gpu.add_listener(on_insert=self._on_gpu_insert, on_evict=self._on_gpu_evict)
        if cpu is not None:
            cpu.add_listener(on_insert=self._on_cpu_insert, on_evict=self._on_cpu_evict)

    def begin_step(self, step: int) -> None:
        """Scheduler step ``step`` begins: errors until the next one name it."""
        self._step = step

    def fill(self, group: int, block: int, key: int) -> None:
        """The model computed ``block`` of ``group``: write its key's bytes."""
        for s, (view, _) in enumerate(self._gpu_arrays[group]):
            view[block] = _bytes_of(_pattern(key, s, view.shape[1]))
        known = self._key_group.setdefault(key, group)
        if known != group:
            raise IntegrityError(f"{self._where()}key {key} computed in group {group} and in "
                                 f"group {known}")
        self._gpu.wrote[block] = key
        self._gpu.group[block] = group
        self.blocks_filled += 1

    def execute(self, meta: PlannerMeta) -> None:
        """Run one step's copies (done when submitted, on CPU tensors). A CPU block stored to
        now holds what its GPU source was registered under; a GPU block loaded into, what its
        CPU source was."""
        self.engine.execute(meta)
        self.engine.poll()
        st, ld = meta.store, meta.load
        if len(st):
            _copied(self._gpu, st.gpu_blocks, self._cpu, st.cpu_blocks, st.groups)
        if len(ld):
            _copied(self._cpu, ld.cpu_blocks, self._gpu, ld.gpu_blocks, ld.groups)
            self._loaded.update(ld.gpu_blocks)

    def check_load(self, request_id: str, keys: np.ndarray, tables: Sequence[Sequence[int]],
                   start: int, end: int, step: int) -> None:
        """Compare every block loaded for tokens ``[start, end)`` of ``request_id`` (its tables
        and keys ``[groups, hash blocks]``) with the bytes of its position's key."""
        hbs = self.layout.hash_block_size
        for g, spec in enumerate(self.layout.groups):
            r = spec.block_size // hbs
            table = tables[g]
            for pos in range(start // spec.block_size, -(-end // spec.block_size)):
                b = table[pos]
                if b == NULL_BLOCK or b not in self._loaded:
                    continue
                j = min((pos + 1) * r, end // hbs) - 1
                key = int(keys[g, j])
                for s, (view, _) in enumerate(self._gpu_arrays[g]):
                    if view[b].tobytes() != _pattern(key, s, view.shape[1]):
                        raise IntegrityError(
                            f"step {step}: request {request_id!r}: GPU block {b} (group {g}, "
                            f"position {pos}, segment {s}) does not hold key {key} after its "
                            "CPU load")
                self._loaded.discard(b)
                self.blocks_checked += 1

    # ---- registrations ----------------------------------------------------------------------

    def _where(self) -> str:
        return "" if self._step is None else f"step {self._step}: "

    def _registered(self, tier: str, prov: _Provenance, block: int, key: int,
                    segments: list[tuple[np.ndarray, int]]) -> None:
        """``block`` of ``tier`` was registered under its primary ``key``: something must have
        written that key's bytes into it since it was handed out, and they must be there."""
        wrote, g = int(prov.wrote[block]), int(prov.group[block])
        where = f"{self._where()}{tier} block {block} registered under key {key}"
        if wrote != key:
            cause = ("no computation, load or store wrote it" if wrote == _NONE
                     else f"the last write into it was for key {wrote}")
            raise IntegrityError(f"{where}, but {cause}")
        if self._key_group.get(key) != g:
            raise IntegrityError(f"{where} as group {g}, but the key was computed in group "
                                 f"{self._key_group.get(key)}")
        for s, (data, nbytes) in enumerate(segments):
            if data.tobytes() != _pattern(key, s, nbytes):
                raise IntegrityError(f"{where} (group {g}, segment {s}) does not hold its "
                                     "bytes")
        prov.wrote[block] = _NONE
        prov.holds[block] = key
        self.registrations_checked += 1

    def _on_gpu_insert(self, key: int, block: int) -> None:
        if self._gpu_pool.block_hash(block) != key:
            return  # an alias of the primary key, checked with it
        g = int(self._gpu.group[block])
        segs = [] if g == _NONE else [(v[block], v.shape[1]) for v, _ in self._gpu_arrays[g]]
        self._registered("GPU", self._gpu, block, key, segs)

    def _on_cpu_insert(self, key: int, block: int) -> None:
        if self._cpu_pool.block_hash(block) != key:
            return
        g = int(self._cpu.group[block])
        pool = self._cpu_array
        segs = [] if g == _NONE else [(pool[block, off:off + v.shape[1]], v.shape[1])
                                      for v, off in self._gpu_arrays[g]]
        self._registered("CPU", self._cpu, block, key, segs)

    def _on_gpu_evict(self, key: int, block: int) -> None:
        self._gpu.holds[block] = _NONE

    def _on_cpu_evict(self, key: int, block: int) -> None:
        self._cpu.holds[block] = _NONE
