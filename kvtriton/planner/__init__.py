"""The scheduler side of the CPU tier: ``OffloadPlanner`` and its records."""

from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.planner import OffloadPlanner
from kvtriton.planner.records import PlannerMeta, Request, StepOutput, Transfer, request_keys
from kvtriton.planner.stats import PlannerStats, ScanOutcomes

__all__ = [
    "OffloadPlanner",
    "PlannerConfig",
    "PlannerMeta",
    "PlannerStats",
    "Request",
    "ScanOutcomes",
    "StepOutput",
    "Transfer",
    "request_keys",
]
