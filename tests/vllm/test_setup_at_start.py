"""A setup at a real vLLM scheduler's start (issue 36, items 6 and 7): a name whose numbers a
general format writes with an exponent starts as written, and an ``lfu:W`` sketch larger than
the machine is one error naming ``setup`` before anything is allocated, not a ``MemoryError``.
"""

from __future__ import annotations

import logging
import os

import pytest

pytest.importorskip("vllm")
os.environ["HF_HUB_OFFLINE"] = "1"

from helpers.vllm_driver import FULL
from kvtriton.sim.vllm_scheduler import make_scheduler

pytestmark = pytest.mark.scheduler_role


@pytest.fixture
def start_up_lines():
    """The scheduler side's log records (kvtriton's loggers may not propagate to caplog's)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("kvtriton.vllm.scheduler_side")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    yield lines
    log.removeHandler(handler)
    log.setLevel(level)


@pytest.mark.parametrize("setup", ["eager+restore:0.00001", "eager+lfu:1000000"])
def test_a_setup_with_tiny_or_huge_numbers_starts_as_written(model_config_dir, start_up_lines,
                                                             setup):
    # Eight CPU blocks: even lfu:1000000's sketch is 32 MiB here.
    s = make_scheduler(model_config_dir, [FULL], num_gpu_blocks=16, cpu_blocks=8,
                       extra_config={"setup": setup})
    assert s.connector.config.setup == setup
    assert any(f"(setup {setup} (" in line for line in start_up_lines), start_up_lines


def test_the_start_up_line_gives_the_sketch_size(model_config_dir, start_up_lines):
    make_scheduler(model_config_dir, [FULL], num_gpu_blocks=16, cpu_blocks=1000,
                   extra_config={"setup": "eager+lfu:64"})
    # 4 rows of 64 x 1,000 counters, rounded up to 2^16: 256 KiB.
    assert any("GiB/rank + LFU sketch 0.2 MiB" in line for line in start_up_lines), \
        start_up_lines


def test_a_sketch_larger_than_the_machine_is_one_error_at_start(model_config_dir):
    # 262,143 CPU blocks (256 MiB of this tiny model's KV): lfu:1000000's sketch is 1 TiB. The
    # error names the setup as written, not its canonical name (eager+lfu:1000000).
    with pytest.raises(ValueError) as e:
        make_scheduler(model_config_dir, [FULL], num_gpu_blocks=16, cpu_blocks=262_143,
                       extra_config={"setup": "lfu:1000000.0+eager"})
    msg = str(e.value)
    assert msg.startswith("KVTritonConnector: kv_connector_extra_config['setup'] = "
                          "'lfu:1000000.0+eager': its LFU sketch for the 262,143-block CPU tier "
                          f"takes {1 << 40} bytes"), msg
    assert "exceeds this machine's memory" in msg and "\n" not in msg, msg
