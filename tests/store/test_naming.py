"""Object names: one per block content, never shared by servers whose bytes differ."""

from __future__ import annotations

import pytest

from kvtriton.second_tier.naming import fingerprint, object_names, rank_fingerprints

FIELDS = {"model": "m", "revision": None, "dtype": "torch.bfloat16", "cache_dtype": "auto",
          "hash_block_size": 16, "groups": [["full", 16, 2 << 20]], "vllm": "0.32.0",
          "platform": "cuda", "cpu_isa": None, "attention_backend": "None",
          "hash_algo": "sha256", "hash_seed": None}


@pytest.mark.parametrize("field, other", [
    ("model", "m2"), ("dtype", "torch.float16"), ("groups", [["full", 32, 4 << 20]]),
    ("platform", "cpu"), ("vllm", "0.33.0"), ("hash_seed", "0"), ("cache_dtype", "fp8")])
def test_every_field_changes_the_fingerprint(field, other):
    assert fingerprint(FIELDS) != fingerprint({**FIELDS, field: other})


def test_ranks_differ_and_replicas_agree():
    fps = rank_fingerprints(FIELDS, tp_size=2, pp_size=2)
    assert len(set(fps)) == 4
    assert rank_fingerprints(dict(FIELDS), 2, 2) == fps  # another replica, same names
    assert rank_fingerprints(FIELDS, 4, 1)[0] != fps[0]  # another parallel layout
    names = object_names(fps[0], [b"\x01" * 36, b"\x02" * 36])
    assert names[0] != names[1] and names[0].startswith(f"kvt1-{fps[0]}-")
