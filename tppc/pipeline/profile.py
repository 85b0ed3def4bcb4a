"""Predicted against measured: ``cp.profile(*args)`` runs one traced call.

Terms:
    job: chunk ``j`` on stage ``s``. The plan predicts its start and end (the simulated flow
        shop of the cost model); the ``threads`` executor records when it really ran.
    error: ``(measured - predicted) / predicted`` of the call's latency (makespan).

Example:
    >>> prof = cp.profile(ids)                                         # doctest: +SKIP
    >>> print(prof.table())
    >>> tppc.plan_timeline(prof.plan, "plan.png", measured=prof)   # Gantt chart, measured overlaid
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tppc.planner.plan import Plan

if TYPE_CHECKING:
    from tppc.frontend.front_end import BoundCall, FrontEnd
    from tppc.program.program import Program

__all__ = ["JobTiming", "Profile", "Profiled", "profile_call"]


class Profiled(Protocol):
    """What :func:`profile_call` needs of a pipeline (a :class:`tppc.CompiledPipeline`)."""

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]: ...

    def program(self, length: int, front: FrontEnd | None = None) -> Program: ...

    def run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None, *,
            timeout: float | None = None, executor: Any = None,
            trace: list | None = None) -> Any: ...


@dataclass(frozen=True)
class JobTiming:
    """One job, predicted and measured (seconds from the call's first job)."""

    stage: int
    chunk: int
    tokens: tuple[int, int]
    predicted_start: float
    predicted_end: float
    measured_start: float
    measured_end: float


@dataclass(frozen=True)
class Profile:
    """A traced call: every job's predicted and measured times.

    Attributes:
        plan: the plan of the call's length.
        jobs: one :class:`JobTiming` per (stage, chunk).
        predicted: predicted latency (the plan's makespan, warm-up excluded).
        measured: measured makespan (first job's start to last job's end).
        wall: the whole call as the caller saw it (input checks and output assembly too).
    """

    plan: Plan
    jobs: tuple[JobTiming, ...]
    predicted: float
    measured: float
    wall: float

    @property
    def error(self) -> float:
        """Relative error of the predicted makespan (positive: slower than predicted)."""
        return (self.measured - self.predicted) / self.predicted if self.predicted else 0.0

    @property
    def bubble(self) -> float:
        """Measured idle share ``1 - Σ busy / (stages · makespan)``."""
        stages = self.plan.num_stages
        busy = sum(j.measured_end - j.measured_start for j in self.jobs)
        return 1.0 - busy / (stages * self.measured) if self.measured else 0.0

    def table(self) -> str:
        """Per stage: predicted and measured busy time; then the makespans and the error."""
        lines = [f"{'stage':>5} {'chunks':>6} {'predicted busy':>15} {'measured busy':>14}"]
        for s in range(self.plan.num_stages):
            jobs = [j for j in self.jobs if j.stage == s]
            pred = sum(j.predicted_end - j.predicted_start for j in jobs)
            meas = sum(j.measured_end - j.measured_start for j in jobs)
            lines.append(f"{s:>5} {len(jobs):>6} {pred * 1e3:>12.2f} ms {meas * 1e3:>11.2f} ms")
        lines.append(f"makespan: predicted {self.predicted * 1e3:.2f} ms, measured "
                     f"{self.measured * 1e3:.2f} ms ({100 * self.error:+.1f} %), call "
                     f"{self.wall * 1e3:.2f} ms, measured bubble {100 * self.bubble:.1f} %")
        return "\n".join(lines)


def profile_call(cp: Profiled, args: tuple[Any, ...], kwargs: dict[str, Any], *,
                 warmup: int = 1) -> Profile:
    """Run ``cp`` with the ``threads`` executor (after ``warmup`` untimed calls, which plan
    the length and warm the kernels) and time every job of the last call."""
    front, bound = cp.bind(args, kwargs)
    program = cp.program(bound.length, front)
    for _ in range(warmup):
        cp.run(args, kwargs, executor="threads")
    trace: list[tuple[int, int, float, float]] = []
    t0 = time.perf_counter()
    cp.run(args, kwargs, executor="threads", trace=trace)
    wall = time.perf_counter() - t0
    first = min(t[2] for t in trace)
    plan = program.plan
    offset = plan.warmup_seconds
    jobs = tuple(sorted(
        (JobTiming(stage=s, chunk=j, tokens=program.chunks[j],
                   predicted_start=_at(plan.start, s, j) - offset,
                   predicted_end=_at(plan.end, s, j) - offset,
                   measured_start=start - first, measured_end=end - first)
         for s, j, start, end in trace), key=lambda t: (t.stage, t.chunk)))
    predicted = max(j.predicted_end for j in jobs)
    measured = max(j.measured_end for j in jobs)
    return Profile(plan=plan, jobs=jobs, predicted=predicted, measured=measured, wall=wall)


def _at(table: tuple[tuple[float, ...], ...], s: int, j: int) -> float:
    row = table[s] if s < len(table) else ()
    return float(row[j]) if j < len(row) else 0.0
