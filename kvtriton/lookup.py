"""Longest prefix hit in a block pool, per group kind and for hybrid models.

Keys: ``keys[g][j]`` is group g's key for the hash boundary after token ``(j+1) * hash_block_size``
(``group_key(chain_hash_j, g)``). Group g's block i ends at boundary ``(i+1) * r_g - 1`` with
``r_g = block_size_g / hash_block_size``; that key is its primary, the boundaries inside it are
its aliases. A pool answers presence per key.

What a hit at n tokens needs:
- full attention: every block of [0, n), found left to right;
- sliding window w: the blocks covering the last ``w - 1`` tokens before n, searched right to left;
- Mamba: the state block saved exactly at boundary n;
- hybrid: the largest n aligned to ``align`` (the scheduler block by default) that every group
  accepts. Each group answers "largest accepted m <= n", so iterating over the groups until no
  group lowers n reaches the fixpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import lcm

from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

__all__ = ["Hit", "find_longest_hit", "full_attention_hit", "mamba_hit", "sliding_window_hit"]

Lookup = Callable[[int], "int | None"]


@dataclass(slots=True)
class Hit:
    """``num_tokens`` hit; ``blocks[g]`` the pool blocks of group g covering them (null where a
    group needs no data), and how many fixpoint passes it took."""

    num_tokens: int
    blocks: tuple[list[int], ...]
    iterations: int


def full_attention_hit(lookup: Lookup, keys: Sequence[int], ratio: int, limit: int,
                       fine_grained: bool = False) -> int:
    """Hash blocks (not tokens) of the longest present prefix, at most ``limit`` hash blocks.

    Only primary keys (every ``ratio``-th) are checked unless ``fine_grained``, when a trailing
    partial block can hit through an alias.
    """
    return _full_walk(lookup, keys, ratio, limit, fine_grained)[0]


def _full_walk(lookup: Lookup, keys: Sequence[int], ratio: int, limit: int,
               fine_grained: bool, prefix: Callable[[Sequence[int]], list[int]] | None = None
               ) -> tuple[int, list[int]]:
    """``full_attention_hit`` and the blocks it found, one per step of the walk. ``prefix``:
    the pool's own walk (``BlockPool.cached_prefix``), the same blocks as ``lookup`` key by
    key."""
    step = 1 if fine_grained else ratio
    walk = keys[step - 1:max(limit, 0):step]  # the walk's keys, n + step <= limit
    if prefix is not None:
        found = prefix(walk)
        return len(found) * step, found
    found = []
    append = found.append
    for k in walk:
        b = lookup(k)
        if b is None:
            break
        append(b)
    return len(found) * step, found


def sliding_window_hit(lookup: Lookup, keys: Sequence[int], ratio: int, window_blocks: int,
                       limit: int, align: int) -> int:
    """Largest m <= ``limit`` (hash blocks, a multiple of ``align`` and ``ratio``) whose last
    ``window_blocks`` group blocks are present; 0 if none. Searched right to left: a missing block
    rules out every m whose window contains it, so the search jumps past it."""
    m = limit - limit % align
    while m > 0:
        last = m // ratio - 1  # last group block before m
        first = max(0, last - window_blocks + 1)
        i = last
        while i >= first and lookup(keys[(i + 1) * ratio - 1]) is not None:
            i -= 1
        if i < first:
            return m
        # Block i is missing: every window that holds it fails, so m must end at or before it.
        m = i * ratio
        m -= m % align
    return 0


def mamba_hit(lookup: Lookup, keys: Sequence[int], ratio: int, limit: int, align: int) -> int:
    """Largest boundary m <= ``limit`` (hash blocks, a multiple of ``align`` and ``ratio``) with
    its state present; 0 if none."""
    m = limit - limit % align
    while m > 0:
        if lookup(keys[m - 1]) is not None:
            return m
        m -= align
    return 0


def find_longest_hit(
    layout: KVLayout,
    pool: BlockPool | Lookup,
    keys: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    align: int | None = None,
    fine_grained: bool = False,
) -> Hit:
    """The longest hit of the prefix whose per-group keys are ``keys``, capped at ``max_tokens``.

    ``max_tokens`` is the cap (callers pass ``num_tokens - 1 - num_computed`` so the last token is
    always recomputed). ``align`` defaults to the scheduler block; ``fine_grained`` lets
    full-attention-only layouts hit at any hash boundary (aliases included).
    """
    hbs = layout.hash_block_size
    if len(keys) != layout.num_groups:
        raise ValueError(f"keys has {len(keys)} groups, layout has {layout.num_groups}")
    is_pool = isinstance(pool, BlockPool)
    lookup = pool.get_cached_block if is_pool else pool
    prefix = pool.cached_prefix if is_pool else None
    if fine_grained:
        if any(g.kind != "full" for g in layout.groups):
            raise ValueError("fine_grained hits need a layout of full-attention groups only")
        align_h = 1
    else:
        align_tok = layout.scheduler_block_size if align is None else align
        if not isinstance(align_tok, int) or align_tok <= 0:
            raise ValueError(f"align must be a positive int, got {align_tok!r}")
        if align_tok % hbs:
            raise ValueError(f"align={align_tok} is not a multiple of hash_block_size={hbs}")
        align_h = align_tok // hbs
    n_keys = min(len(k) for k in keys)
    limit = min(max(max_tokens, 0) // hbs, n_keys)
    n = limit - limit % align_h
    ratios = [g.block_size // hbs for g in layout.groups]
    full_cache: dict[int, tuple[int, list[int]]] = {}

    def accept(gi: int, n: int) -> int:
        spec, r, ks = layout.groups[gi], ratios[gi], keys[gi]
        if isinstance(spec, SlidingWindowSpec):
            return sliding_window_hit(lookup, ks, r, spec.window_blocks, n, lcm(align_h, r))
        if isinstance(spec, MambaSpec):
            return mamba_hit(lookup, ks, r, n, lcm(align_h, r))
        assert isinstance(spec, FullAttentionSpec)
        if gi not in full_cache:  # monotone in n: compute once up to the global limit
            full_cache[gi] = _full_walk(lookup, ks, r, limit, fine_grained, prefix)
        m = min(full_cache[gi][0], n)
        # Whole blocks only, unless fine-grained: an align below the block size must not let
        # the fixpoint settle inside a block (a hit through an alias key).
        return m - m % (align_h if fine_grained else lcm(align_h, r))

    iterations = 0
    while True:
        iterations += 1
        before = n
        for gi in range(layout.num_groups):
            n = min(n, accept(gi, n))
        if n == before or n == 0:
            break
    return Hit(n * hbs, _hit_blocks(layout, lookup, keys, n, ratios, full_cache, fine_grained),
               iterations)


def _hit_blocks(layout: KVLayout, lookup: Lookup, keys, n: int, ratios, walks,
                fine_grained: bool) -> tuple[list[int], ...]:
    out = []
    for gi, spec in enumerate(layout.groups):
        r, ks = ratios[gi], keys[gi]
        n_blocks = -(-n // r)
        if gi in walks:  # full attention: the walk already found them
            found = walks[gi][1]
            blocks = ([found[min((i + 1) * r, n) - 1] for i in range(n_blocks)] if fine_grained
                      else found[:n_blocks])
        elif isinstance(spec, MambaSpec):
            blocks = [NULL_BLOCK] * n_blocks
            if n_blocks:
                blocks[-1] = lookup(ks[n - 1])
        elif isinstance(spec, SlidingWindowSpec):
            first = max(0, n_blocks - spec.window_blocks)
            blocks = [NULL_BLOCK] * first + [
                lookup(ks[(i + 1) * r - 1]) for i in range(first, n_blocks)]
        else:
            blocks = [lookup(ks[min((i + 1) * r, n) - 1]) for i in range(n_blocks)]
        assert None not in blocks
        out.append(blocks)
    return tuple(out)
