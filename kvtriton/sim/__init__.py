"""The simulator: workloads, trace loaders, the serving loop, cache-only replay and the cost model.

Importing it does not import Triton or the transfer engine: integrity mode loads them when a
simulation asks for it.
"""

from kvtriton.setups import DEFAULT_SETUPS, TierSetup
from kvtriton.sim.cost import GPUS, MODELS, CostModel, transfer_s
from kvtriton.sim.replay import ReplayResult, SweepResult, capacity_sweep, max_hit_rate, replay
from kvtriton.sim.simulate import SimulationResult, simulate
from kvtriton.sim.trace_stats import trace_stats
from kvtriton.sim.traces import (
    CC_AGENTIC_SAMPLE,
    GLM5_SAMPLE,
    MOONCAKE_SYNTHETIC,
    STOP_REASONS,
    TraceError,
    data_path,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
)
from kvtriton.sim.workload import (
    HINTS,
    AgentConfig,
    Workload,
    WorkloadRequest,
    agent_workload,
    mark_session_close,
    without_closes,
)

__all__ = [
    "CC_AGENTIC_SAMPLE",
    "DEFAULT_SETUPS",
    "GLM5_SAMPLE",
    "GPUS",
    "HINTS",
    "MODELS",
    "MOONCAKE_SYNTHETIC",
    "STOP_REASONS",
    "AgentConfig",
    "CostModel",
    "ReplayResult",
    "SimulationResult",
    "SweepResult",
    "TierSetup",
    "TraceError",
    "Workload",
    "WorkloadRequest",
    "agent_workload",
    "capacity_sweep",
    "data_path",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "mark_session_close",
    "max_hit_rate",
    "replay",
    "simulate",
    "trace_stats",
    "transfer_s",
    "without_closes",
]
