"""Plans given by hand: a placement and a split with no predicted times (tests, demos)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tppc.planner.plan import Plan, StagePlan
from tppc.planner.provenance import SolverInfo
from tppc.planner.workload import Workload

__all__ = ["manual_plan"]


def manual_plan(layers: int | Sequence[str], seq_len: int, *, cuts: Sequence[int],
                boundaries: Sequence[int], device_name: str = "cpu") -> Plan:
    """A :class:`Plan` with a given placement and split and no predicted times (tests, demos).

    Args:
        layers: number of layers (``ctx.layers``, prologue and epilogue included) or names.
        seq_len: tokens in the sequence.
        cuts: ``(0, e_1, ..., N)``: stage ``s`` runs layers ``[cuts[s], cuts[s+1])``.
        boundaries: ``(0, ..., seq_len)``: token offsets of the chunks.
        device_name: device preset of every stage.
    """
    names = [f"layer{i}" for i in range(layers)] if isinstance(layers, int) else list(layers)
    stages = tuple(
        StagePlan(index=s, layer_start=lo, layer_end=hi, device_index=s,
                  device_name=device_name, memory_bytes=0, capacity_bytes=0,
                  layer_names=tuple(names[lo:hi]))
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts)))
    zeros = tuple(tuple(0.0 for _ in range(len(boundaries) - 1)) for _ in stages)
    return Plan(workload=Workload(), seq_len=seq_len, granularity=1,
                boundaries=tuple(boundaries), stages=stages, start=zeros, end=zeros,
                latency=0.0, warmup_seconds=0.0, lower_bound=0.0, lower_bound_work=0.0,
                lower_bound_path=0.0,
                solver=SolverInfo(solver="given", status="given", objective=0.0, bound=0.0,
                                  gap=0.0, seconds=0.0))
