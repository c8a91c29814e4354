"""Group specs, ``KVLayout`` geometry and the model presets' true per-block sizes."""

import pytest
import torch

from kvtriton.specs import (
    PRESETS,
    FullAttentionSpec,
    KVLayout,
    MambaSpec,
    SlidingWindowSpec,
    preset,
)

KiB, MiB = 1 << 10, 1 << 20
BF16 = 2


# ---- presets: expected bytes computed here from the config numbers ---------------------------


def _attn_block_bytes(block, kv_heads, head, layers, elem=BF16):
    return layers * 2 * block * kv_heads * head * elem  # K and V pages per layer


def test_llama3_8b():
    layout = preset("llama3-8b")
    assert layout.name == "llama3-8b"
    assert layout.groups[0].page_bytes == 16 * 8 * 128 * BF16 == 32 * KiB
    assert layout.group_block_bytes == (2 * MiB,)
    assert layout.cpu_block_bytes == 2 * MiB == _attn_block_bytes(16, 8, 128, 32)
    assert layout.scheduler_block_size == 16 and layout.hash_block_size == 16
    assert len(layout.segments[0]) == 64


def test_llama3_8b_block_size_kwarg():
    assert preset("llama3-8b", block_size=32).cpu_block_bytes == 4 * MiB


def test_qwen3_8b():
    layout = preset("qwen3-8b")
    assert layout.cpu_block_bytes == _attn_block_bytes(16, 8, 128, 36) == 2304 * KiB
    assert len(layout.segments[0]) == 72


def test_gemma3_12b_full_plus_sliding_window():
    layout = preset("gemma3-12b")
    full, swa = layout.groups
    assert (full.kind, swa.kind) == ("full", "sliding_window")
    assert full.num_layers + swa.num_layers == 48 and full.num_layers == 48 // 6
    assert layout.group_block_bytes == (
        _attn_block_bytes(16, 8, 256, 8), _attn_block_bytes(16, 8, 256, 40))
    assert layout.group_block_bytes == (1 * MiB, 5 * MiB)
    assert layout.cpu_block_bytes == 5 * MiB
    assert swa.sliding_window == 1024
    assert swa.window_blocks == 64  # ceil(1023 / 16)
    assert layout.scheduler_block_size == 16 and layout.hash_block_size == 16


def test_nemotron_h_8b_full_plus_mamba():
    layout = preset("nemotron-h-8b")
    attn, mamba = layout.groups
    heads, head_dim, state, n_groups, kernel = 128, 64, 128, 8, 4
    conv_dim = heads * head_dim + 2 * n_groups * state
    conv_bytes = conv_dim * (kernel - 1) * BF16
    ssm_bytes = heads * head_dim * state * BF16
    assert conv_bytes == 61440 and ssm_bytes == 2 * MiB
    assert layout.group_block_bytes == (
        _attn_block_bytes(16, 8, 128, 4), 24 * (conv_bytes + ssm_bytes))
    assert layout.group_block_bytes == (256 * KiB, 51_806_208)
    assert layout.cpu_block_bytes == 51_806_208
    assert (attn.block_size, mamba.block_size) == (16, 256)
    assert layout.scheduler_block_size == 256 and layout.hash_block_size == 16
    seg0, seg1 = layout.segments[1][:2]
    assert (seg0.part, seg0.shape, seg0.nbytes) == ("conv", (10240, 3), conv_bytes)
    assert (seg1.part, seg1.shape, seg1.nbytes) == ("ssm", (128, 64, 128), ssm_bytes)


def test_every_preset_is_listed_and_unknown_is_named():
    assert sorted(PRESETS) == ["gemma3-12b", "llama3-8b", "nemotron-h-8b", "qwen3-8b"]
    with pytest.raises(ValueError, match="unknown model preset 'llama-9b'"):
        preset("llama-9b")


# ---- spec geometry ----------------------------------------------------------------------------

DTYPES = [(torch.float16, 2), (torch.bfloat16, 2), (torch.float32, 4), (torch.uint8, 1)]


@pytest.mark.parametrize(("dtype", "elem"), DTYPES, ids=["fp16", "bf16", "fp32", "fp8-as-u8"])
@pytest.mark.parametrize("head_size", [64, 80, 120])
def test_attention_page_bytes(dtype, elem, head_size):
    spec = FullAttentionSpec(16, 3, head_size, 5, dtype=dtype)
    assert spec.page_shape == (16, 3, head_size)
    assert spec.page_bytes == 16 * 3 * head_size * elem
    layout = KVLayout([spec])
    assert layout.cpu_block_bytes == 5 * 2 * 16 * 3 * head_size * elem


@pytest.mark.parametrize(
    ("window", "block", "blocks"),
    [(1, 16, 0), (2, 16, 1), (16, 16, 1), (17, 16, 1), (18, 16, 2), (33, 16, 2), (34, 16, 3),
     (5, 2, 2), (1024, 16, 64)],
)
def test_window_blocks_cover_last_window_minus_one_tokens(window, block, blocks):
    assert SlidingWindowSpec(block, 1, 8, 1, sliding_window=window).window_blocks == blocks


def test_mamba_segments_and_ssm_dtype():
    spec = MambaSpec(64, (12, 3), (4, 8, 16), 3, dtype=torch.bfloat16, ssm_dtype=torch.float32)
    layout = KVLayout([spec])
    conv, ssm = 12 * 3 * 2, 4 * 8 * 16 * 4
    assert [(s.part, s.nbytes, s.dtype, s.shape) for s in layout.segments[0][:2]] == [
        ("conv", conv, torch.bfloat16, (12, 3)), ("ssm", ssm, torch.float32, (4, 8, 16))]
    assert layout.group_block_bytes == (3 * (conv + ssm),)


def test_segments_are_contiguous_and_block_major():
    layout = KVLayout(
        [FullAttentionSpec(4, 2, 8, 3), SlidingWindowSpec(2, 1, 16, 2, sliding_window=5),
         MambaSpec(8, (5, 3), (2, 7), 2)],
        hash_block_size=2,
    )
    assert [[(s.layer, s.part) for s in segs] for segs in layout.segments] == [
        [(0, "k"), (0, "v"), (1, "k"), (1, "v"), (2, "k"), (2, "v")],
        [(0, "k"), (0, "v"), (1, "k"), (1, "v")],
        [(0, "conv"), (0, "ssm"), (1, "conv"), (1, "ssm")],
    ]
    expected_nbytes = [4 * 2 * 8 * 2, 2 * 1 * 16 * 2, None]
    for gi, segs in enumerate(layout.segments):
        offset = 0
        for s in segs:
            assert s.cpu_offset == offset
            if expected_nbytes[gi] is not None:
                assert s.nbytes == expected_nbytes[gi]
            offset += s.nbytes
        assert offset == layout.group_block_bytes[gi]
    assert [s.nbytes for s in layout.segments[2]] == [30, 28, 30, 28]
    assert layout.group_block_bytes == (3 * 2 * 128, 2 * 2 * 64, 2 * (30 + 28))
    assert layout.cpu_block_bytes == 768
    assert layout.blocks_for_bytes(768 * 10 + 767) == 10
    assert layout.tokens_per_cpu_block() == 4
    assert layout.num_groups == 3


def test_scheduler_block_is_lcm_and_hash_block_defaults_to_gcd():
    layout = KVLayout([FullAttentionSpec(4, 1, 8, 1), SlidingWindowSpec(6, 1, 8, 1,
                                                                        sliding_window=7)])
    assert layout.hash_block_size == 2
    assert layout.scheduler_block_size == 12
    layout = KVLayout([FullAttentionSpec(16, 1, 8, 1), MambaSpec(96, (2,), (2,), 1)],
                      hash_block_size=8)
    assert layout.scheduler_block_size == 96 and layout.hash_block_size == 8


def test_tokens_per_cpu_block_without_full_attention_is_group0():
    layout = KVLayout([MambaSpec(32, (2,), (2,), 1), SlidingWindowSpec(16, 1, 8, 1,
                                                                       sliding_window=4)])
    assert layout.tokens_per_cpu_block() == 32


def test_describe_and_layout_is_hashable():
    layout = preset("gemma3-12b")
    text = layout.describe()
    assert text.startswith("gemma3-12b: g0:full(bs=16,L=8,1.00MiB/blk)")
    assert "g1:sliding_window(bs=16,L=40,5.00MiB/blk)" in text
    assert text.endswith("hash_block=16, sched_block=16")
    assert hash(layout) == hash(preset("gemma3-12b")) and layout == preset("gemma3-12b")


# ---- inconsistent specs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: FullAttentionSpec(0, 8, 128, 32), "block_size must be a positive int, got 0"),
        (lambda: FullAttentionSpec(16, -1, 128, 32), "num_kv_heads must be a positive int, got -1"),
        (lambda: FullAttentionSpec(16.0, 8, 128, 32), "block_size .* got 16.0"),
        (lambda: FullAttentionSpec(16, 8, 128, True), "num_layers .* got True"),
        (lambda: SlidingWindowSpec(16, 8, 128, 4, sliding_window=0),
         "sliding_window must be a positive int, got 0"),
        (lambda: MambaSpec(0, (2,), (2,), 1), "block_size must be a positive int, got 0"),
        (lambda: MambaSpec(16, (), (2,), 1), r"conv_state_shape must be positive ints, got \(\)"),
        (lambda: MambaSpec(16, (2,), (4, 0), 1), r"ssm_state_shape .* got \(4, 0\)"),
        (lambda: MambaSpec(16, (2.5,), (4,), 1), r"conv_state_shape .* got \(2.5,\)"),
        (lambda: MambaSpec(16, (2,), (4,), 0), "num_layers must be a positive int, got 0"),
        (lambda: KVLayout([]), "at least one group"),
        (lambda: KVLayout([FullAttentionSpec(16, 8, 128, 1), "mamba"]),
         "group 1 is not a group spec: 'mamba'"),
        (lambda: KVLayout([FullAttentionSpec(16, 8, 128, 1)], hash_block_size=0),
         "hash_block_size must be a positive int, got 0"),
        (lambda: KVLayout([FullAttentionSpec(16, 8, 128, 1)], hash_block_size=32),
         "hash_block_size=32 does not divide group 0's block_size=16"),
        (lambda: KVLayout([FullAttentionSpec(16, 8, 128, 1), MambaSpec(24, (2,), (2,), 1)],
                          hash_block_size=16),
         "hash_block_size=16 does not divide group 1's block_size=24"),
    ],
    ids=["bs0", "heads-neg", "bs-float", "layers-bool", "window0", "mamba-bs0", "conv-empty",
         "ssm-zero", "conv-float", "mamba-layers0", "no-groups", "not-a-spec", "hbs0",
         "hbs-too-big", "hbs-misaligned"],
)
def test_inconsistent_specs_raise_naming_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()
