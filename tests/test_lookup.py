"""Longest prefix hit per group kind, the hybrid fixpoint, and a brute-force reference."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtriton.hashing import chain_hashes, group_keys
from kvtriton.lookup import (
    find_longest_hit,
    full_attention_hit,
    mamba_hit,
    sliding_window_hit,
)
from kvtriton.pool import NULL_BLOCK, BlockPool
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec


def full(bs, layers=1):
    return FullAttentionSpec(bs, 1, 8, layers)


def swa(bs, window, layers=1):
    return SlidingWindowSpec(bs, 1, 8, layers, sliding_window=window)


def mamba(bs, layers=1):
    return MambaSpec(bs, (4, 3), (2, 8), layers)


def key(g, j):
    """Group g's key at hash boundary j; present keys map to a block id equal to the key."""
    return (g + 1) * 1000 + j


class Presence:
    """A dict-backed lookup that records every key it was asked about."""

    def __init__(self, present):
        self.present = set(present)
        self.asked = []

    def __call__(self, k):
        self.asked.append(k)
        return k if k in self.present else None


def keys_for(num_groups, n):
    return [[key(g, j) for j in range(n)] for g in range(num_groups)]


# ---- per-kind helpers -------------------------------------------------------------------------


def test_full_attention_left_to_right_stops_at_first_hole():
    ks = [key(0, j) for j in range(8)]
    look = Presence([ks[0], ks[1], ks[2], ks[4], ks[5]])  # hole at 3
    assert full_attention_hit(look, ks, 1, 8) == 3
    assert look.asked == ks[:4]  # nothing past the hole is asked


def test_full_attention_checks_primaries_only_and_whole_blocks():
    ks = [key(0, j) for j in range(10)]
    # ratio 2: primaries at 1, 3, 5, 7, 9; aliases (even) absent; primary 7 missing
    look = Presence([ks[1], ks[3], ks[5], ks[9]])
    assert full_attention_hit(look, ks, 2, 10) == 6
    assert look.asked == [ks[1], ks[3], ks[5], ks[7]]
    assert full_attention_hit(look, ks, 2, 5) == 4  # limit 5 allows only two whole blocks
    assert full_attention_hit(look, ks, 2, 1) == 0


def test_full_attention_fine_grained_hits_through_aliases():
    ks = [key(0, j) for j in range(8)]
    look = Presence(ks[:6])
    assert full_attention_hit(look, ks, 4, 8, fine_grained=True) == 6
    assert full_attention_hit(look, ks, 4, 8) == 4
    assert full_attention_hit(look, ks, 4, 5, fine_grained=True) == 5


def test_sliding_window_needs_only_the_window_right_to_left():
    ks = [key(0, j) for j in range(10)]
    look = Presence([ks[8], ks[9]])  # blocks 0-7 missing
    assert sliding_window_hit(look, ks, 1, 2, 10, 1) == 10
    assert look.asked == [ks[9], ks[8]]


def test_sliding_window_jumps_past_a_missing_block():
    ks = [key(0, j) for j in range(10)]
    look = Presence([ks[8], ks[5], ks[6]])
    # m=10: block 9 missing -> m=9: block 8 ok, 7 missing -> m=7: blocks 6, 5 ok.
    assert sliding_window_hit(look, ks, 1, 2, 10, 1) == 7
    assert look.asked == [ks[9], ks[8], ks[7], ks[6], ks[5]]
    # aligned to 2: m=10 -> 9 -> 8 (aligned): window 7, 6: 7 missing -> m=6: 5, 4: 4 missing
    # -> m=4: 3 missing -> m=2: 1 missing -> m=0.
    assert sliding_window_hit(Presence(look.present), ks, 1, 2, 10, 2) == 0
    assert sliding_window_hit(Presence(ks[3:]), ks, 1, 2, 10, 4) == 8


def test_sliding_window_with_ratio_and_zero_window():
    ks = [key(0, j) for j in range(12)]
    # ratio 3: block i is key 3i+2; window 2 blocks; block 3 (key 11) missing
    look = Presence([ks[2], ks[5], ks[8]])
    assert sliding_window_hit(look, ks, 3, 2, 12, 3) == 9
    assert sliding_window_hit(Presence([]), ks, 3, 0, 12, 3) == 12  # window 1: needs nothing
    assert sliding_window_hit(Presence([]), ks, 3, 1, 12, 3) == 0


def test_mamba_needs_state_exactly_at_the_boundary():
    ks = [key(0, j) for j in range(12)]
    look = Presence([ks[3], ks[7], ks[8]])  # states at boundaries 4 and 8; 8 is no boundary
    assert mamba_hit(look, ks, 2, 11, 2) == 8  # 10 missing, 8 present
    assert look.asked == [ks[9], ks[7]]
    assert mamba_hit(look, ks, 2, 7, 2) == 4
    assert mamba_hit(look, ks, 2, 11, 4) == 8
    assert mamba_hit(look, ks, 2, 3, 2) == 0
    assert mamba_hit(Presence(ks[:1]), ks, 2, 12, 2) == 0


# ---- find_longest_hit: single kinds through a BlockPool -------------------------------------


def _cached_pool(token_ids, layout, num_blocks=32):
    """A pool holding every full block of ``token_ids`` for each group (primary keys only)."""
    pool = BlockPool(num_blocks)
    hbs = layout.hash_block_size
    hashes = chain_hashes(token_ids, hbs)
    blocks = []
    for g, spec in enumerate(layout.groups):
        r = spec.block_size // hbs
        gk = group_keys(hashes, g)
        prim = gk[r - 1::r]
        ids = pool.get_new_blocks(len(prim))
        for b, k in zip(ids, prim, strict=True):
            pool.cache_block(b, k)
        blocks.append(ids)
    return pool, [group_keys(hashes, g) for g in range(layout.num_groups)], blocks


def test_full_attention_cap_recomputes_last_token():
    layout = KVLayout([full(4)])
    tokens = list(range(20))
    pool, ks, (blocks,) = _cached_pool(tokens, layout)
    hit = find_longest_hit(layout, pool, ks, len(tokens) - 1)
    assert hit.num_tokens == 16 and hit.blocks == (blocks[:4],) and hit.iterations == 1
    # a longer request with the same 20-token prefix hits all 5 blocks
    ks21 = [group_keys(chain_hashes([*tokens, 7], 4), 0)]
    assert find_longest_hit(layout, pool, ks21, 20).num_tokens == 20
    assert find_longest_hit(layout, pool, ks, 0).num_tokens == 0
    assert find_longest_hit(layout, pool, ks, -5) == find_longest_hit(layout, pool, ks, 0)
    assert find_longest_hit(layout, pool, ks, 0).blocks == ([],)


def test_full_attention_hole_and_diverging_request():
    layout = KVLayout([full(4)])
    tokens = list(range(24))
    pool, ks, (blocks,) = _cached_pool(tokens, layout)
    other = [*tokens[:10], 99, *tokens[11:]]  # diverges inside block 2
    ks_other = [group_keys(chain_hashes(other, 4), 0)]
    assert find_longest_hit(layout, pool, ks_other, 23).num_tokens == 8
    pool.free_blocks(blocks)
    pool.evict_cached(blocks[1])
    hit = find_longest_hit(layout, pool, ks, 23)
    assert hit.num_tokens == 4 and hit.blocks == (blocks[:1],)


def test_fine_grained_hits_partial_block_through_alias():
    layout = KVLayout([full(4)], hash_block_size=1)
    cached = list(range(1, 9))
    kk = group_keys(chain_hashes(cached, 1), 0)
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, kk[3], kk[0:3])
    pool.cache_block(b, kk[7], kk[4:7])
    request = [group_keys(chain_hashes([*cached[:6], 99, 100, 101], 1), 0)]
    assert request[0][:6] == kk[:6] and request[0][6] != kk[6]
    assert find_longest_hit(layout, pool, request, 8) .num_tokens == 4
    hit = find_longest_hit(layout, pool, request, 8, fine_grained=True)
    assert hit.num_tokens == 6 and hit.blocks == ([a, b],)
    hit = find_longest_hit(layout, pool, request, 5, fine_grained=True)
    assert hit.num_tokens == 5 and hit.blocks == ([a, b],)
    hit = find_longest_hit(layout, pool, request, 3, fine_grained=True)
    assert hit.num_tokens == 3 and hit.blocks == ([a],)


def test_hit_blocks_come_from_the_first_registered_block():
    layout = KVLayout([full(2)])
    pool = BlockPool(6)
    b1, b2, b3 = pool.get_new_blocks(3)
    pool.cache_block(b1, 10)
    pool.cache_block(b2, 11)
    pool.cache_block(b3, 10)
    hit = find_longest_hit(layout, pool, [[10, 11, 12]], 5)
    assert hit.num_tokens == 4 and hit.blocks == ([b1, b2],)


# ---- hybrid -----------------------------------------------------------------------------------


def test_alignment_to_scheduler_block():
    # full bs 4 + Mamba bs 16, hash block 4: the scheduler block is 16 tokens.
    layout = KVLayout([full(4), mamba(16)])
    assert layout.scheduler_block_size == 16 and layout.hash_block_size == 4
    ks = keys_for(2, 10)
    present = [key(0, j) for j in range(10)] + [key(1, 3), key(1, 7)]  # states at 16 and 32
    hit = find_longest_hit(layout, Presence(present), ks, 39)
    assert hit.num_tokens == 32
    assert hit.blocks == ([key(0, j) for j in range(8)], [NULL_BLOCK, key(1, 7)])
    # every full block present up to 36 tokens is not enough: 32 -> without the state at 32, 16
    hit = find_longest_hit(layout, Presence(present[:-1]), ks, 39)
    assert hit.num_tokens == 16 and hit.blocks == ([key(0, j) for j in range(4)], [key(1, 3)])
    # a smaller align lets full attention stop at any of its blocks but Mamba still needs a state
    hit = find_longest_hit(layout, Presence(present), ks, 39, align=4)
    assert hit.num_tokens == 32


def test_sliding_window_group_ignores_blocks_before_the_window():
    layout = KVLayout([full(2), swa(2, window=5)])  # window blocks: ceil(4 / 2) = 2
    ks = keys_for(2, 12)
    present = [key(0, j) for j in range(12)] + [key(1, 9), key(1, 10)]
    hit = find_longest_hit(layout, Presence(present), ks, 22)
    assert hit.num_tokens == 22 and hit.iterations == 1
    assert hit.blocks == ([key(0, j) for j in range(11)],
                          [NULL_BLOCK] * 9 + [key(1, 9), key(1, 10)])


def test_hybrid_fixpoint_iterates_until_all_groups_agree():
    """Full (bs 4), sliding window (bs 2, w=5: the last 2 blocks) and Mamba (bs 4), hash block
    2 tokens, scheduler block 4, a 41-token request (cap 40). In tokens:

    - full attention: blocks 0-8 present, block 9 (tokens 36-39) missing -> 36;
    - sliding window: every 2-token block present except 12 (tokens 24-25) and 17 (34-35);
    - Mamba: states at 4, 8, 12, 16, 20, 28, 36, 40; missing at 24 and 32.

    Pass 1: full 40 -> 36; SW at 36 needs blocks 16, 17: 17 missing -> 32 (blocks 14, 15 ok);
    Mamba at 32 missing -> 28. Pass 2: full accepts 28; SW at 28 needs 12, 13: 12 missing ->
    24 (10, 11 ok); Mamba at 24 missing -> 20. Pass 3: everyone accepts 20.
    """
    layout = KVLayout([full(4), swa(2, window=5), mamba(4)], hash_block_size=2)
    assert layout.scheduler_block_size == 4
    ks = keys_for(3, 21)
    present = (
        [key(0, 2 * i + 1) for i in range(9)]
        + [key(1, i) for i in range(21) if i not in (12, 17)]
        + [key(2, t // 2 - 1) for t in (4, 8, 12, 16, 20, 28, 36, 40)]
    )
    hit = find_longest_hit(layout, Presence(present), ks, 41 - 1)
    assert hit.num_tokens == 20
    assert hit.iterations == 3
    assert hit.blocks == (
        [key(0, 2 * i + 1) for i in range(5)],
        [NULL_BLOCK] * 8 + [key(1, 8), key(1, 9)],
        [NULL_BLOCK] * 4 + [key(2, 9)],
    )
    assert _brute_force(layout, set(present), ks, 40)[0] == 20


def test_hybrid_no_hit():
    layout = KVLayout([full(2), mamba(4)])
    ks = keys_for(2, 8)
    hit = find_longest_hit(layout, Presence([key(0, j) for j in range(8)]), ks, 15)
    assert hit.num_tokens == 0 and hit.blocks == ([], []) and hit.iterations == 1


def test_align_below_a_group_block_size_keeps_whole_blocks():
    # With align (2 tokens) below the full group's block size (4), the fixpoint settles on whole
    # full blocks: at 6 tokens, inside full block 1, it would ask for the alias key of boundary 6
    # (an AssertionError when absent, a partial non-fine-grained hit when present).
    layout = KVLayout([full(4), swa(2, window=3)], hash_block_size=2)
    ks = keys_for(2, 4)
    present = [key(0, 1), key(0, 3), key(1, 0), key(1, 1), key(1, 2)]  # SW block 3 missing
    hit = find_longest_hit(layout, Presence(present), ks, 8, align=2)
    assert hit.num_tokens == 4
    assert hit.blocks == ([key(0, 1)], [NULL_BLOCK, key(1, 1)])
    hit = find_longest_hit(layout, Presence([*present, key(0, 2)]), ks, 8, align=2)
    assert hit.num_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(align=3), "align=3 is not a multiple of hash_block_size=2"),
        (dict(align=0), "align must be a positive int, got 0"),
        (dict(align=-4), "align must be a positive int, got -4"),
        (dict(align=4.0), "align must be a positive int, got 4.0"),
        (dict(fine_grained=True), "fine_grained hits need a layout of full-attention groups"),
    ],
    ids=["misaligned", "zero", "negative", "float", "fine-hybrid"],
)
def test_find_longest_hit_bad_input(kwargs, match):
    layout = KVLayout([full(4), swa(2, window=3)], hash_block_size=2)
    with pytest.raises(ValueError, match=match):
        find_longest_hit(layout, Presence([]), keys_for(2, 4), 8, **kwargs)


def test_find_longest_hit_wrong_group_count():
    layout = KVLayout([full(4), swa(2, window=3)], hash_block_size=2)
    with pytest.raises(ValueError, match="keys has 1 groups, layout has 2"):
        find_longest_hit(layout, Presence([]), keys_for(1, 4), 8)


# ---- brute-force reference --------------------------------------------------------------------


def _brute_force(layout, present, keys, max_tokens, align=None, fine_grained=False):
    """Try every admissible n from the cap down; check each group's requirement in tokens."""
    hbs = layout.hash_block_size
    if fine_grained:
        step = hbs
    else:
        step = math.lcm(layout.scheduler_block_size, align or layout.scheduler_block_size)
    top = min(max(max_tokens, 0), min(len(k) for k in keys) * hbs)
    n = top - top % step
    while n > 0:
        blocks = []
        for g, spec in enumerate(layout.groups):
            bs, ks = spec.block_size, keys[g]
            if isinstance(spec, MambaSpec):
                need = {n // bs - 1: ks[n // hbs - 1]}
            elif isinstance(spec, SlidingWindowSpec):
                lo = max(0, n - spec.sliding_window + 1)  # tokens [lo, n) are attended
                need = {i: ks[(i + 1) * bs // hbs - 1] for i in range(lo // bs, n // bs)}
            elif fine_grained:  # every hash boundary up to n, the last block maybe partial
                if not all(ks[j] in present for j in range(n // hbs)):
                    break
                need = {i: ks[min((i + 1) * bs, n) // hbs - 1] for i in range(-(-n // bs))}
            else:
                need = {i: ks[(i + 1) * bs // hbs - 1] for i in range(n // bs)}
            if not all(k in present for k in need.values()):
                break
            blocks.append([need.get(i, NULL_BLOCK) for i in range(-(-n // bs))])
        else:
            return n, tuple(blocks)
        n -= step
    return 0, tuple([] for _ in layout.groups)


@st.composite
def hybrid_cases(draw):
    hbs = draw(st.sampled_from([1, 2]))
    groups = []
    for _ in range(draw(st.integers(1, 3))):
        bs = hbs * draw(st.sampled_from([1, 2, 3, 4]))
        kind = draw(st.sampled_from(["full", "swa", "mamba"]))
        if kind == "full":
            groups.append(full(bs))
        elif kind == "swa":
            groups.append(swa(bs, draw(st.integers(1, 4 * bs))))
        else:
            groups.append(mamba(bs))
    layout = KVLayout(groups, hash_block_size=hbs)
    sched_h = layout.scheduler_block_size // hbs
    n_keys = sched_h * draw(st.integers(0, 4)) + draw(st.integers(0, sched_h))
    ks = keys_for(len(groups), n_keys)
    every = [k for row in ks for k in row]
    # Mostly a few holes (long hits that groups cut differently), sometimes a random half.
    if every and draw(st.integers(0, 3)):
        present = set(every) - draw(st.sets(st.sampled_from(every), max_size=4))
    else:
        present = {k for k in every if draw(st.booleans())}
    max_tokens = draw(st.just(n_keys * hbs - 1) | st.integers(-1, n_keys * hbs + 3))
    return layout, present, ks, max_tokens


@settings(max_examples=max(300, settings.default.max_examples))
@given(hybrid_cases(), st.sampled_from([None, 1, 2, 3]))
def test_find_longest_hit_matches_brute_force(case, align_mult):
    layout, present, ks, max_tokens = case
    align = None if align_mult is None else align_mult * layout.hash_block_size
    hit = find_longest_hit(layout, Presence(present), ks, max_tokens, align=align)
    n, blocks = _brute_force(layout, present, ks, max_tokens, align)
    assert hit.num_tokens == n
    assert hit.blocks == blocks
    assert hit.iterations >= 1


@given(hybrid_cases())
def test_fine_grained_matches_brute_force(case):
    layout, present, ks, max_tokens = case
    layout = KVLayout([g for g in layout.groups if g.kind == "full"] or [full(2)],
                      hash_block_size=layout.hash_block_size if any(
                          g.kind == "full" for g in layout.groups) else None)
    ks = ks[: layout.num_groups]
    hit = find_longest_hit(layout, Presence(present), ks, max_tokens, fine_grained=True)
    assert (hit.num_tokens, hit.blocks) == _brute_force(
        layout, present, ks, max_tokens, fine_grained=True)
