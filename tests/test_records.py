"""The records both roles exchange (``kvtriton.records``): ``Request`` refuses keys and counts
the planner could not index by.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvtriton.records import Request

KEYS = np.arange(4, dtype=np.int64).reshape(1, 4)
BAD_REQUESTS = {
    "negative-key": ({"keys": np.array([[0, -2]])}, "keys must be non-negative ids, got -2"),
    "float-keys": ({"keys": KEYS.astype(np.float64)}, "int64 array [groups, n], got dtype float64"),
    "int32-keys": ({"keys": KEYS.astype(np.int32)}, "got dtype int32"),
    "uint64-keys": ({"keys": KEYS.astype(np.uint64)}, "got dtype uint64"),
    "bool-keys": ({"keys": KEYS > 1}, "got dtype bool"),
    "list-keys": ({"keys": [[0, 1, 2, 3]]}, "int64 array [groups, n], got list"),
    "1-d-keys": ({"keys": KEYS[0]}, "got dtype int64, shape (4,)"),
    "bool-prompt": ({"num_prompt_tokens": True, "num_tokens": 64}, "got True"),
    "float-prompt": ({"num_prompt_tokens": 64.0}, "num_prompt_tokens must be a non-negative int"),
    "zero-prompt": ({"num_prompt_tokens": 0, "num_tokens": 64}, "must be positive, got 0"),
    "short-tokens": ({"num_tokens": 32}, "num_tokens=32 < num_prompt_tokens=64"),
    "negative-computed": ({"num_computed_tokens": -16}, "num_computed_tokens must be a non-neg"),
    "float-placeholders": ({"num_output_placeholders": 1.5}, "got 1.5"),
}


@pytest.mark.parametrize("bad", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_request_refuses_bad_keys_and_counts(bad):
    """Keys must be non-negative int64 ids (the planner's per-key arrays index by them, and a
    negative one would wrap to the end); counts must be ints in range."""
    fields, text = BAD_REQUESTS[bad]
    kw = {"keys": KEYS, "num_prompt_tokens": 64, "num_tokens": 64, **fields}
    with pytest.raises(ValueError, match=re.escape(text)):
        Request("r", **kw)


def test_request_accepts_numpy_ints_and_no_keys():
    r = Request("r", np.zeros((2, 0), dtype=np.int64), num_prompt_tokens=np.int64(8),
                num_tokens=8)
    assert r.keys.shape == (2, 0)
    assert Request("s", KEYS, num_prompt_tokens=64, num_tokens=64).keys is KEYS
