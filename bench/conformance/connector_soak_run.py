"""A long run of vLLM's real ``Scheduler`` with ``KVTritonConnector``: is the connector's memory
bounded however many distinct blocks it sees?

Requests arrive as others finish (``concurrency`` at once). Each prompt is a shared prefix
followed by tokens of its own; every ``repeat_every``-th request repeats a recent prompt, so the
CPU tier serves hits and the planner's re-store and load paths run too. Outputs are distinct per
request (``kvtriton.sim.vllm_scheduler``). So almost every block a request makes is new: after ``n``
requests the connector has seen about ``n * (blocks per request - shared)`` distinct blocks,
counted here by construction (``distinct_blocks``), never by asking the connector.

Every ``sample_every`` requests a ``SoakSample`` records the connector's key ids (bound now,
capacity), the planner's per-key slots and the process RSS. With recycling off
(``recycle=False``, the control) the ids and slots grow with the distinct blocks; with it on
they stay within what the pools and running requests hold.

``record=True`` also keeps, per step, the vLLM hashes of the blocks stored and loaded (bytes, so
independent of key ids): two runs of one schedule, recycling on and off, must record the same.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.conformance.scheduler_driver import Driver
from kvtriton.sim.vllm_scheduler import make_scheduler, vllm_request
from kvtriton.specs import FullAttentionSpec

__all__ = ["ConnectorSoak", "SoakSample", "rss_mib"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_mib() -> float:
    """Resident set size of this process in MiB (``/proc/self/statm``; 0 where absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE / 2**20
    except OSError:
        return 0.0


@dataclass(slots=True)
class SoakSample:
    """The connector's memory after ``requests_done`` requests."""

    step: int
    requests_done: int
    distinct_blocks: int  # blocks of distinct content made so far (by construction)
    key_ids_bound: int  # ids bound to a vLLM hash now
    key_id_capacity: int  # one past the largest id ever handed out
    planner_key_slots: int  # per-key entries in the planner's selector
    cpu_cached_keys: int
    sweeps: int
    recycled: int
    rss_mib: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Recorder:
    """Per step: the hashes (bytes) of the blocks stored and of the CPU blocks loaded."""

    steps: list[tuple[tuple[bytes | None, ...], tuple[bytes | None, ...]]] = field(
        default_factory=list)


class ConnectorSoak:
    """A vLLM scheduler with the connector and a stream of mostly fresh requests.

    Sizes are in blocks of ``block_size`` tokens; ``prompt_blocks`` includes the
    ``shared_blocks`` every prompt starts with; each request samples ``output_blocks`` blocks of
    tokens.
    """

    def __init__(self, model_dir: str | Path, *, gpu_blocks: int = 64, cpu_blocks: int = 128,
                 block_size: int = 16, concurrency: int = 8, prompt_blocks: int = 8,
                 shared_blocks: int = 2, output_blocks: int = 2, repeat_every: int = 5,
                 restore: bool = True, recycle: bool = True, record: bool = False,
                 extra_config: dict[str, Any] | None = None) -> None:
        if not 0 <= shared_blocks < prompt_blocks:
            raise ValueError(f"shared_blocks must be in [0, prompt_blocks={prompt_blocks}), "
                             f"got {shared_blocks}")
        self.block_size = bs = block_size
        # The setups the per-axis key meant (re-store on or off, tail first, LRU, eager).
        extra = {"setup": "eager+restore+tail" if restore else "eager+tail",
                 **(extra_config or {})}
        self.scheduler = make_scheduler(model_dir, [FullAttentionSpec(bs, 1, 8, 1)],
                                        num_gpu_blocks=gpu_blocks, cpu_blocks=cpu_blocks,
                                        max_num_seqs=concurrency,
                                        max_num_batched_tokens=4 * prompt_blocks * bs,
                                        extra_config=extra)
        self.side = self.scheduler.connector.scheduler_side
        self.side.auto_recycle = recycle
        self.driver = Driver(self.scheduler)
        self.concurrency = concurrency
        self.prompt_blocks = prompt_blocks
        self.shared_blocks = shared_blocks
        self.output_tokens = output_blocks * bs
        self.repeat_every = repeat_every
        self._shared = [1 + (i * 7919) % 29000 for i in range(shared_blocks * bs)]
        self._recent: deque[list[int]] = deque(maxlen=8)
        self._next = 0
        self.distinct_blocks = shared_blocks
        self.requests_done = 0
        self.recorder = _Recorder() if record else None

    def _prompt(self, i: int) -> list[int]:
        if self.repeat_every and i % self.repeat_every == self.repeat_every - 1 and self._recent:
            prompt = self._recent[i % len(self._recent)]
            self.distinct_blocks += self.output_tokens // self.block_size
            return prompt
        own = (self.prompt_blocks - self.shared_blocks) * self.block_size
        prompt = self._shared + [1 + (i * 104729 + j * 7919 + 13) % 29000 for j in range(own)]
        self._recent.append(prompt)
        self.distinct_blocks += self.prompt_blocks - self.shared_blocks \
            + self.output_tokens // self.block_size
        return prompt

    def _admit(self) -> None:
        s = self.scheduler
        while len(s.requests) < self.concurrency:
            i = self._next
            self._next += 1
            self.driver.add(vllm_request(f"soak-{i}", self._prompt(i), self.output_tokens,
                                         self.block_size))

    def _record(self, so: Any) -> None:
        meta = so.kv_connector_metadata
        blocks = self.scheduler.kv_cache_manager.block_pool.blocks
        keys = self.side.keys
        stored = tuple(blocks[b].block_hash for b in meta.store.gpu_blocks)
        cpu = self.side.cpu_pool
        loaded = tuple(keys.hash_of(k) if (k := cpu.block_hash(b)) is not None else None
                       for b in meta.load.cpu_blocks)
        self.recorder.steps.append((stored, loaded))

    def sample(self) -> SoakSample:
        side = self.side
        return SoakSample(step=self.driver.step_no, requests_done=self.requests_done,
                          distinct_blocks=self.distinct_blocks,
                          key_ids_bound=side.keys.num_bound,
                          key_id_capacity=side.keys.capacity,
                          planner_key_slots=side.planner.selector.key_slots,
                          cpu_cached_keys=side.cpu_pool.num_cached_keys,
                          sweeps=side.sweeps, recycled=side.keys.recycled, rss_mib=rss_mib())

    def run(self, num_requests: int, sample_every: int,
            on_sample: Callable[[SoakSample], None] | None = None,
            check_every: int = 0) -> list[SoakSample]:
        """Serve ``num_requests`` requests; a sample every ``sample_every`` finished requests
        (and one at the end). ``check_every``: run the planner's invariant checks every that
        many steps (0: never)."""
        samples: list[SoakSample] = []
        s, drv = self.scheduler, self.driver
        next_sample = sample_every
        while self.requests_done < num_requests or s.has_requests() or drv.pending():
            if self._next < num_requests:
                self._admit()
            before = len(s.requests)
            so, _ = drv.step()
            if self.recorder is not None and so.kv_connector_metadata is not None:
                self._record(so)
            self.requests_done += before - len(s.requests)
            if check_every and drv.step_no % check_every == 0:
                self.side.planner.check_invariants()
            if self.requests_done >= next_sample:
                next_sample += sample_every
                samples.append(self.sample())
                if on_sample is not None:
                    on_sample(samples[-1])
        samples.append(self.sample())
        return samples
