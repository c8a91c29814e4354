"""The torch references (``kvtriton.kernels.reference``): the vectorized index copies match the
per-block loop on random schedules, whole destinations compared, on the lane's device.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.copy_rig import rebuild, same, setup_rig, snapshot, tensors
from kvtriton.engine import segment_views
from kvtriton.kernels.reference import (
    load_blocks_loop,
    load_blocks_ref,
    store_blocks_loop,
    store_blocks_ref,
)

pytestmark = pytest.mark.device_lane


def test_vectorized_reference_matches_loop_on_random_schedules(device):
    rig = setup_rig("mamba+full-fp16-fp32-fi", device, 9, 12)
    layout, caches, segments, pool = rig.layout, rig.caches, rig.segments, rig.pool
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(0, 12))
        cpu = rng.permutation(12)[:n]
        grp = rng.integers(0, layout.num_groups, n)
        gpu = rng.integers(0, 9, n)  # repeated sources allowed
        expected = pool.clone()
        store_blocks_loop(segments, expected, gpu, cpu, grp)
        store_blocks_ref(segments, pool, gpu, cpu, grp)
        assert torch.equal(pool, expected)

        dest = rng.permutation(layout.num_groups * 9)[:n]  # distinct (group, block) destinations
        grp, gpu = dest // 9, dest % 9
        cpu = rng.integers(0, 12, n)
        expected = snapshot(caches)
        load_blocks_loop(segment_views(layout, rebuild(caches, expected), "flashinfer"), pool,
                         gpu, cpu, grp)
        load_blocks_ref(segments, pool, gpu, cpu, grp)
        assert same(tensors(caches), expected)
