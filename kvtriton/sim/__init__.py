"""The simulator: workloads, trace loaders, cache-only replay and the cost model."""

# ---- workloads, traces, cache-only replay, cost model ------------------------------------------
from kvtriton.sim.cost import GPUS, MODELS, CostModel, transfer_s
from kvtriton.sim.replay import ReplayResult, SweepResult, capacity_sweep, max_hit_rate, replay
from kvtriton.sim.trace_stats import trace_stats
from kvtriton.sim.traces import (
    CC_AGENTIC_SAMPLE,
    MOONCAKE_SYNTHETIC,
    TraceError,
    data_path,
    load_kv_cache_tester,
    load_mooncake,
    load_trace,
)
from kvtriton.sim.workload import AgentConfig, Workload, WorkloadRequest, agent_workload

__all__ = [
    "CC_AGENTIC_SAMPLE",
    "GPUS",
    "MODELS",
    "MOONCAKE_SYNTHETIC",
    "AgentConfig",
    "CostModel",
    "ReplayResult",
    "SweepResult",
    "TraceError",
    "Workload",
    "WorkloadRequest",
    "agent_workload",
    "capacity_sweep",
    "data_path",
    "load_kv_cache_tester",
    "load_mooncake",
    "load_trace",
    "max_hit_rate",
    "replay",
    "trace_stats",
    "transfer_s",
]
# ---- end of workloads, traces, replay, cost block ----------------------------------------------

# ---- the serving-loop simulator ----
from kvtriton.sim.setups import DEFAULT_POLICIES, TIER_POLICIES, TierPolicy
from kvtriton.sim.simulate import SimulationResult, simulate

__all__ += ["DEFAULT_POLICIES", "TIER_POLICIES", "SimulationResult", "TierPolicy", "simulate"]
