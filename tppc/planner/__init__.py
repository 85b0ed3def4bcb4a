"""Planner: optimal token splits and stage placement for a priced model.

Entry points:
    :func:`split_tokens`: cut one sequence into chunks (MILP, TeraPipe's DP as the oracle).
    :func:`plan_from_costs`: place layers on a chain of devices and split the sequence
        jointly, from a :class:`tppc.cost_models.table.CostTable`; returns a :class:`Plan`.
    :func:`plan_for`: simulate and package a given placement and split (baselines).
    :func:`simulate`: the flow-shop schedule behind every predicted latency.
    :func:`tppc.planner.hybrid.plan_hybrid`: tensor-parallel groups x the pipeline x
        replicas, searched by price over :mod:`tppc.planner.configurations`.
"""

from __future__ import annotations

from tppc.planner.dp import brute_force_split, terapipe_dp
from tppc.planner.evaluate import plan_for
from tppc.planner.joint import plan_from_costs
from tppc.planner.plan import PLAN_SCHEMA, Plan, StagePlan
from tppc.planner.provenance import SolverInfo
from tppc.planner.split import TokenSplit, split_tokens
from tppc.planner.workload import Workload
from tppc.program.schedule import Schedule, simulate

__all__ = [
    "PLAN_SCHEMA",
    "Plan",
    "Schedule",
    "SolverInfo",
    "StagePlan",
    "TokenSplit",
    "Workload",
    "brute_force_split",
    "plan_for",
    "plan_from_costs",
    "simulate",
    "split_tokens",
    "terapipe_dp",
]
