"""The scheduler side of the CPU tier: ``OffloadPlanner``, its configuration and statistics.

The records it exchanges with workers live in ``kvtriton.records`` and are re-exported here.
"""

from kvtriton.planner.config import PlannerConfig
from kvtriton.planner.planner import OffloadPlanner
from kvtriton.planner.stats import PlannerStats, ScanOutcomes
from kvtriton.records import PlannerMeta, Request, StepOutput, Transfer

__all__ = [
    "OffloadPlanner",
    "PlannerConfig",
    "PlannerMeta",
    "PlannerStats",
    "Request",
    "ScanOutcomes",
    "StepOutput",
    "Transfer",
]
