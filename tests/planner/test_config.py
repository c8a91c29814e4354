"""``PlannerConfig`` (``kvtriton.planner.config``): every switch is checked when the config is
built, and a refusal names the bad value.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.planner_state import raises_naming
from kvtriton.planner import PlannerConfig
from kvtriton.setups import parse_setup


@pytest.mark.parametrize(("field", "value"), [
    ("max_restores_per_step", True), ("max_restores_per_step", 1.0),
    ("max_restores_per_step", -1), ("max_restores_per_key", False),
    ("max_restores_per_key", 2.5), ("lazy_target_blocks", True), ("lazy_target_blocks", 8.0),
    ("world_size", True), ("world_size", 2.0), ("world_size", 0),
    ("max_num_batched_tokens", True), ("max_num_batched_tokens", 8192.0),
    ("max_num_batched_tokens", 0), ("restore_share", True), ("restore_share", 1.5),
    ("restore_share", float("nan")), ("restore_share", "0.5"), ("restore", 1),
    ("scan_idle", "no"), ("lazy", None), ("fine_grained", np.float64(1.0)),
], ids=repr)
def test_planner_config_refuses_bools_and_floats_for_counts(field, value):
    """Counts take ints (NumPy's too), never bools or floats; switches take bools only; a share
    is a finite number in [0, 1]."""
    with raises_naming(value, also=field):
        PlannerConfig(**{field: value})


def test_planner_config_accepts_numpy_ints_and_int_shares():
    c = PlannerConfig(world_size=np.int64(2), max_restores_per_key=np.int32(1), restore_share=1)
    assert c.world_size == 2 and c.restore_share == 1


def test_admission_second_with_lazy_is_refused():
    with pytest.raises(ValueError, match="admission 'second'"):
        PlannerConfig(lazy=True, admission="second")
    with pytest.raises(ValueError, match="admission must be"):
        PlannerConfig(admission="often")


def test_hinted_admission_needs_lazy_mode():
    with pytest.raises(ValueError, match="'hinted' needs lazy mode"):
        PlannerConfig(admission="hinted")
    with pytest.raises(ValueError, match="'hinted' admission needs 'lazy'"):
        parse_setup("eager+hinted")
    with pytest.raises(ValueError, match="'second' and 'hinted' both set the admission"):
        parse_setup("lazy+second+hinted")
    p = parse_setup("hints+hinted+lazy")
    assert p.composition == "lazy+hinted+hints" and p.planner.admission == "hinted"
