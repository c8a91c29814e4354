"""KV-cache group specs and the layout that ties them together.

A model's KV cache is split into *groups*: layers that share a block table (all full-attention
layers, all sliding-window layers of one window, all Mamba layers). Every group has its own block
size in tokens; the scheduler block is their least common multiple, and hashes are computed every
``hash_block_size`` tokens, which must divide every group block size.

Each group block is made of *segments*, one per layer and part (K and V for attention, conv and
SSM state for Mamba). The CPU pool is block-major: one CPU block holds every segment of one group
block back to back, so ``KVLayout.cpu_block_bytes`` is the largest group's bytes per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvtriton.validation import is_int

__all__ = [
    "PRESETS",
    "FullAttentionSpec",
    "GroupSpec",
    "KVLayout",
    "MambaSpec",
    "Segment",
    "SlidingWindowSpec",
    "preset",
]


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not is_int(value) or value <= 0:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class Segment:
    """One contiguous piece of a group block: a layer's K or V page, or a Mamba state.

    ``nbytes`` is the bytes of this piece for one block; ``cpu_offset`` is where it sits inside the
    block-major CPU block; ``shape`` is the per-block tensor shape in elements of ``dtype``.
    """

    layer: int
    part: str
    nbytes: int
    cpu_offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _AttentionPages:
    """What both attention kinds share: one K and one V page per layer per block."""

    __slots__ = ()

    @property
    def page_shape(self) -> tuple[int, ...]:
        """Per-layer, per-part page shape: ``[block_size, num_kv_heads, head_size]``."""
        return (self.block_size, self.num_kv_heads, self.head_size)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * _dtype_size(self.dtype)

    def segment_parts(self) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
        return [(p, self.page_bytes, self.page_shape, self.dtype) for p in ("k", "v")]


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(_AttentionPages):
    """Full (causal) attention: a hit at n tokens needs every block of [0, n)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    dtype: torch.dtype = torch.bfloat16
    kind: str = field(default="full", init=False)

    def __post_init__(self) -> None:
        _require_positive(
            type(self).__name__,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            num_layers=self.num_layers,
        )



@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(_AttentionPages):
    """Sliding-window attention: a hit at n needs the blocks covering tokens [n - w + 1, n)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    num_layers: int
    sliding_window: int
    dtype: torch.dtype = torch.bfloat16
    kind: str = field(default="sliding_window", init=False)

    def __post_init__(self) -> None:
        _require_positive(
            type(self).__name__,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            num_layers=self.num_layers,
            sliding_window=self.sliding_window,
        )


    @property
    def window_blocks(self) -> int:
        """Blocks a hit must find present: those covering the last ``sliding_window - 1`` tokens."""
        return math.ceil((self.sliding_window - 1) / self.block_size)



@dataclass(frozen=True, slots=True)
class MambaSpec:
    """Mamba (SSM) layers: a block holds the recurrent state at the boundary ending that block.

    ``block_size`` is the token distance between saved states. A hit at n tokens needs the state
    saved exactly at n. State shapes are per layer, per sequence, in elements of their dtype.
    """

    block_size: int
    conv_state_shape: tuple[int, ...]
    ssm_state_shape: tuple[int, ...]
    num_layers: int
    dtype: torch.dtype = torch.bfloat16
    ssm_dtype: torch.dtype | None = None
    kind: str = field(default="mamba", init=False)

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, block_size=self.block_size,
                          num_layers=self.num_layers)
        for name in ("conv_state_shape", "ssm_state_shape"):
            shape = getattr(self, name)
            if not shape or any(not isinstance(d, int) or d <= 0 for d in shape):
                raise ValueError(f"MambaSpec: {name} must be positive ints, got {shape!r}")

    def segment_parts(self) -> list[tuple[str, int, tuple[int, ...], torch.dtype]]:
        ssm_dtype = self.ssm_dtype or self.dtype
        return [
            ("conv", math.prod(self.conv_state_shape) * _dtype_size(self.dtype),
             self.conv_state_shape, self.dtype),
            ("ssm", math.prod(self.ssm_state_shape) * _dtype_size(ssm_dtype),
             self.ssm_state_shape, ssm_dtype),
        ]


GroupSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True)
class KVLayout:
    """The KV groups of one model and how their blocks map onto the block-major CPU pool.

    Example::

        layout = KVLayout([FullAttentionSpec(16, 8, 128, 32)], hash_block_size=16)
        layout.scheduler_block_size   # 16 tokens
        layout.cpu_block_bytes        # 2 MiB: 32 layers x (K + V) x 32 KiB
    """

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    name: str = "custom"

    def __init__(self, groups, hash_block_size: int | None = None, name: str = "custom"):
        groups = tuple(groups)
        if not groups:
            raise ValueError("KVLayout: at least one group is required, got none")
        for i, g in enumerate(groups):
            if not isinstance(g, FullAttentionSpec | SlidingWindowSpec | MambaSpec):
                raise ValueError(f"KVLayout: group {i} is not a group spec: {g!r}")
        if hash_block_size is None:
            hash_block_size = math.gcd(*(g.block_size for g in groups))
        _require_positive("KVLayout", hash_block_size=hash_block_size)
        for i, g in enumerate(groups):
            if g.block_size % hash_block_size:
                raise ValueError(
                    f"KVLayout: hash_block_size={hash_block_size} does not divide group {i}'s "
                    f"block_size={g.block_size}"
                )
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "hash_block_size", hash_block_size)
        object.__setattr__(self, "name", name)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @cached_property
    def scheduler_block_size(self) -> int:
        """Tokens in a scheduler block: the LCM of every group's block size."""
        return math.lcm(*(g.block_size for g in self.groups))

    @cached_property
    def segments(self) -> tuple[tuple[Segment, ...], ...]:
        """Per group, its segments in CPU-block order: layer-major, then part."""
        out = []
        for g in self.groups:
            segs, offset = [], 0
            for layer in range(g.num_layers):
                for part, nbytes, shape, dtype in g.segment_parts():
                    segs.append(Segment(layer, part, nbytes, offset, dtype, shape))
                    offset += nbytes
            out.append(tuple(segs))
        return tuple(out)

    @cached_property
    def group_block_bytes(self) -> tuple[int, ...]:
        """Bytes of one block of each group, summed over its layers and parts."""
        return tuple(sum(s.nbytes for s in segs) for segs in self.segments)

    @property
    def cpu_block_bytes(self) -> int:
        """Bytes of one CPU block: the largest group's bytes per block."""
        return max(self.group_block_bytes)

    def hit_bytes(self, num_tokens: int) -> int:
        """Bytes a CPU hit of ``num_tokens`` tokens loads at most: every group's blocks that
        cover them. Exact for full attention; a sliding window loads only its window and a
        Mamba group its last state, so for those it is an upper bound."""
        return sum(-(-num_tokens // g.block_size) * nbytes
                   for g, nbytes in zip(self.groups, self.group_block_bytes, strict=True))

    def blocks_for_bytes(self, nbytes: int) -> int:
        """How many CPU blocks fit in ``nbytes``."""
        return nbytes // self.cpu_block_bytes

    def tokens_per_cpu_block(self) -> int:
        """Tokens covered by one block of the first full-attention group (or group 0)."""
        for g in self.groups:
            if g.kind == "full":
                return g.block_size
        return self.groups[0].block_size

    def describe(self) -> str:
        parts = []
        for i, g in enumerate(self.groups):
            parts.append(f"g{i}:{g.kind}(bs={g.block_size},L={g.num_layers},"
                         f"{self.group_block_bytes[i] / 2**20:.2f}MiB/blk)")
        return (f"{self.name}: " + ", ".join(parts)
                + f", hash_block={self.hash_block_size}, sched_block={self.scheduler_block_size}")


def _llama3_8b(block_size: int = 16) -> KVLayout:
    # meta-llama/Meta-Llama-3-8B config.json: 32 layers, 8 KV heads, head_dim 128, bf16.
    return KVLayout([FullAttentionSpec(block_size, 8, 128, 32)], name="llama3-8b")


def _qwen3_8b(block_size: int = 16) -> KVLayout:
    # Qwen/Qwen3-8B config.json: 36 layers, 8 KV heads, head_dim 128, bf16.
    return KVLayout([FullAttentionSpec(block_size, 8, 128, 36)], name="qwen3-8b")


def _gemma3_12b(block_size: int = 16) -> KVLayout:
    # google/gemma-3-12b config: 48 layers, 8 KV heads, head_dim 256, sliding_window 1024,
    # one global layer every 6 (8 full, 40 local).
    return KVLayout(
        [
            FullAttentionSpec(block_size, 8, 256, 8),
            SlidingWindowSpec(block_size, 8, 256, 40, sliding_window=1024),
        ],
        name="gemma3-12b",
    )


def _nemotron_h_8b(block_size: int = 16, mamba_block_size: int = 256) -> KVLayout:
    # nvidia/Nemotron-H-8B-Base-8K config: 52 layers, of them 4 attention (8 KV heads, head_dim
    # 128) and 24 Mamba-2 (128 heads x head_dim 64, ssm_state 128, 8 groups, conv kernel 4).
    # conv state: (heads*head_dim + 2*groups*state) x (kernel - 1) = 10240 x 3;
    # ssm state: 128 x 64 x 128. States are saved every `mamba_block_size` tokens.
    return KVLayout(
        [
            FullAttentionSpec(block_size, 8, 128, 4),
            MambaSpec(mamba_block_size, (10240, 3), (128, 64, 128), 24),
        ],
        name="nemotron-h-8b",
    )


PRESETS = {
    "llama3-8b": _llama3_8b,
    "qwen3-8b": _qwen3_8b,
    "gemma3-12b": _gemma3_12b,
    "nemotron-h-8b": _nemotron_h_8b,
}


def preset(name: str, **kwargs) -> KVLayout:
    """A named model layout (``llama3-8b``, ``qwen3-8b``, ``gemma3-12b``, ``nemotron-h-8b``)."""
    try:
        factory = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None
    return factory(**kwargs)
