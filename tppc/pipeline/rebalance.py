"""Dynamic balancing: measure every stage, refit the device rates, re-plan, swap the program.

Stage times drift from the plan (another process takes a core, clocks throttle, a GPU is
shared). ``cp.rebalance()`` measures a few traced calls, refits the rate of every device from
its stage's busy time, re-plans with the refitted rates and swaps the new program in when it
is faster by a margin; ``cp.auto_rebalance(every=N)`` does the same from the traces of every
N calls of the pipeline.

Terms:
    busy time: the seconds a stage spends computing during one call (the sum of its jobs in
        the executor's trace; waits excluded); the plan predicts it (``end - start`` of its
        jobs).
    rate: seconds measured per second predicted on one device of the cluster (1.0: as the
        cost model prices it). The planner prices device ``d``'s layers at ``rates[d]`` times
        the cost model (:meth:`tppc.cost_models.table.CostTable.scaled`).
    refit: ``rates[d] ← rates[d] · measured busy / predicted busy`` of the stage on device
        ``d``, the median over the measured calls; a device that runs no stage keeps its rate.
    gain: the current plan's makespan, predicted again under the refitted rates, over the
        re-plan's. The re-plan is swapped in when ``gain > 1 + margin``: the measured makespan
        is worse than the re-plan's (under the same rates, so the model's remaining error on
        the current plan carries over to the re-plan) by more than the margin.
    swap: between calls, never inside one. A call takes its program once, under the
        pipeline's lock, and runs it to the end; the swap replaces the planner (with the
        refitted rates), drops the cached programs of every length (re-planned with the new
        rates when next called) and installs the re-planned one, under the same lock. A
        concurrent caller sees either the old program or the new one; ``generate`` keeps the
        program of its prompt for all its steps.

Example:
    >>> report = cp.rebalance()                                         # doctest: +SKIP
    >>> print(report.table())
    >>> cp.auto_rebalance(every=50, margin=0.1)   # then call cp(...) as usual
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from tppc.cost_models.cluster import Cluster
from tppc.driver.planning import length_planner, price_plan
from tppc.errors import SpecError, TppcError
from tppc.planner.plan import Plan

if TYPE_CHECKING:
    from tppc.frontend.front_end import BoundCall, FrontEnd
    from tppc.program.program import Program

__all__ = ["AutoRebalance", "RebalanceReport", "Rebalancing", "Sample", "refit_rates"]


@dataclass(frozen=True)
class Sample:
    """One traced call: the program it ran, the rates that program was planned with, and
    the trace ``(stage, chunk, start, end)`` of its jobs."""

    front: Any
    program: Any
    rates: tuple[float, ...]
    trace: tuple[tuple[int, int, float, float], ...]

    @property
    def busy(self) -> tuple[float, ...]:
        """Measured busy seconds of every stage."""
        busy = [0.0] * len(self.program.stages)
        for s, _, start, end in self.trace:
            busy[s] += end - start
        return tuple(busy)

    @property
    def makespan(self) -> float:
        """First job's start to last job's end (seconds)."""
        return max(t[3] for t in self.trace) - min(t[2] for t in self.trace)


def predicted_busy(plan: Plan) -> tuple[float, ...]:
    """Predicted busy seconds of every stage of ``plan``."""
    return tuple(sum(e - s for s, e in zip(starts, ends, strict=True))
                 for starts, ends in zip(plan.start, plan.end, strict=True))


def refit_rates(samples: list[Sample], num_devices: int) -> tuple[float, ...]:
    """The refitted rate of every device (module docstring): per sample, the rate its
    program was planned with times measured / predicted busy of the stage on the device;
    the median over the samples. A device no sample measured keeps the latest rate."""
    per: list[list[float]] = [[] for _ in range(num_devices)]
    for sample in samples:
        plan = sample.program.plan
        for s, (measured, predicted) in enumerate(zip(sample.busy, predicted_busy(plan),
                                                      strict=True)):
            if predicted > 0 and measured > 0:
                d = plan.stages[s].device_index
                per[d].append(sample.rates[d] * measured / predicted)
    latest = samples[-1].rates
    return tuple(statistics.median(r) if r else latest[d] for d, r in enumerate(per))


@dataclass(frozen=True)
class RebalanceReport:
    """What one rebalance measured, predicted and did (times in seconds, makespans without
    warm-up).

    Attributes:
        swapped: whether the re-plan replaced the running program.
        reason: why (or why not).
        rates_before: device rates the running program was planned with.
        rates_after: the refitted rates (the pipeline keeps them only when ``swapped``).
        plan_before: the running plan.
        plan_after: the re-plan under ``rates_after`` (swapped in or not).
        busy_predicted: per stage of ``plan_before``, predicted busy time.
        busy_measured: per stage of ``plan_before``, median measured busy time.
        predicted_before: ``plan_before``'s makespan as predicted when it was made.
        predicted_before_refit: ``plan_before``'s makespan under ``rates_after``.
        predicted_after: ``plan_after``'s makespan under ``rates_after``.
        measured_before: median measured makespan of the calls before.
        measured_after: median measured makespan of as many calls after the swap (None: not
            measured, or not swapped).
        calls: traced calls the refit used.
        margin: the margin of the decision.
    """

    swapped: bool
    reason: str
    rates_before: tuple[float, ...]
    rates_after: tuple[float, ...]
    plan_before: Plan
    plan_after: Plan
    busy_predicted: tuple[float, ...]
    busy_measured: tuple[float, ...]
    predicted_before: float
    predicted_before_refit: float
    predicted_after: float
    measured_before: float
    measured_after: float | None
    calls: int
    margin: float

    @property
    def gain(self) -> float:
        """``predicted_before_refit / predicted_after`` (the decision's ratio)."""
        return self.predicted_before_refit / self.predicted_after

    def table(self) -> str:
        """The report as text: stages, rates, predicted and measured makespans."""
        def stages(plan: Plan) -> str:
            return " | ".join(f"dev {st.device_index}: {st.num_layers} layers" for st in
                              plan.stages) + f", {len(plan.boundaries) - 1} chunks"

        ms = 1e3
        after = "-" if self.measured_after is None else f"{self.measured_after * ms:.2f} ms"
        lines = [
            f"rates (s measured / s predicted per device): "
            f"{[round(r, 3) for r in self.rates_before]} -> "
            f"{[round(r, 3) for r in self.rates_after]}",
            "busy per stage: predicted " + ", ".join(f"{b * ms:.2f}" for b in
                                                     self.busy_predicted)
            + " ms; measured " + ", ".join(f"{b * ms:.2f}" for b in self.busy_measured) + " ms",
            f"before: {stages(self.plan_before)}; predicted {self.predicted_before * ms:.2f} "
            f"ms, under the refit {self.predicted_before_refit * ms:.2f} ms, measured "
            f"{self.measured_before * ms:.2f} ms",
            f"after:  {stages(self.plan_after)}; predicted {self.predicted_after * ms:.2f} "
            f"ms, measured {after}",
            f"{'swapped' if self.swapped else 'kept'}: {self.reason}",
        ]
        return "\n".join(lines)


class _Recording:
    """``run_call``'s view of a pipeline that remembers the front end and program it used."""

    def __init__(self, pipe: Any) -> None:
        self.pipe, self.front, self.used = pipe, None, None
        self.states = pipe.states

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]:
        self.front, bound = self.pipe.bind(args, kwargs)
        return self.front, bound

    def program(self, length: int, front: FrontEnd | None = None) -> Program:
        self.used = self.pipe.program(length, front)
        return self.used

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipe.execute(*args, **kwargs)



class Rebalancing:
    """The dynamic-balancing half of :class:`tppc.CompiledPipeline` (mixed into it).

    Attributes:
        rates: the device rates the planner prices with (None: all 1.0, as calibrated).
        auto: the automatic mode (:meth:`auto_rebalance`), or None.
    """

    rates: tuple[float, ...] | None = None
    auto: AutoRebalance | None = None
    REBALANCE_REFUSAL: ClassVar[str | None] = None
    """Why this kind of pipeline cannot rebalance (None: it can)."""

    def rebalance(self, args: tuple[Any, ...] | None = None,
                  kwargs: Mapping[str, Any] | None = None, *, calls: int = 5,
                  margin: float = 0.1, measure_after: bool = True) -> RebalanceReport:
        """Measure ``calls`` traced calls on ``args``/``kwargs`` (default: the compile's
        example), refit the device rates, re-plan, and swap the re-plan in when
        ``gain > 1 + margin`` (module docstring); then measure as many calls again.

        Raises:
            SpecError: a given plan (nothing to re-plan), a distributed pipeline, no inputs,
                or a bad ``calls``/``margin``.
        """
        self._check_rebalance(calls, margin)
        if args is None:
            if self.example is None:
                raise SpecError("cp.rebalance() measures the compile's example, and this "
                                "pipeline has none. fix: cp.rebalance(args, kwargs)")
            args, kwargs = self.example
        samples = [self.traced_run(tuple(args), dict(kwargs or {}))[1] for _ in range(calls)]
        report = self.refit(samples, margin)
        if report.swapped and measure_after:
            after = [self.traced_run(tuple(args), dict(kwargs or {}))[1].makespan
                     for _ in range(calls)]
            report = _with_after(report, statistics.median(after))
        return report

    def auto_rebalance(self, every: int | None = 20, *, margin: float = 0.1) -> None:
        """From now on trace every call of the pipeline (``cp(...)``, ``cp.run``) and
        rebalance from the traces of every ``every`` calls, in the thread of the call that
        completes the window, after its outputs are made (that call returns after the
        re-plan). ``every=None`` turns it off. Reports: ``cp.auto.reports``."""
        if every is None:
            self.auto = None
            return
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SpecError(f"auto_rebalance(every={every!r}) must be a number of calls ≥ 1 "
                            "(or None to turn it off)")
        self._check_rebalance(1, margin)
        self.auto = AutoRebalance(every, margin)

    def traced_run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
                   timeout: float | None = None, executor: Any = None,
                   trace: list | None = None) -> tuple[Any, Sample]:
        """``run`` with every job traced; returns the outputs and the call's sample."""
        from tppc.calls.call import run_call

        trace = [] if trace is None else trace
        seen = len(trace)
        rates = self.device_rates()
        recording = _Recording(self)
        out = run_call(recording, args, kwargs, self._delivery(), timeout=timeout,
                       executor=executor, trace=trace)
        return out, Sample(recording.front, recording.used, rates, tuple(trace[seen:]))

    def device_rates(self) -> tuple[float, ...]:
        """The rate of every device of the cluster (1.0 until a rebalance refits it)."""
        return self.rates or (1.0,) * Cluster.parse(self.options.cluster).num_devices

    def refit(self, samples: list[Sample], margin: float = 0.1) -> RebalanceReport:
        """Refit the rates from ``samples`` (of one front end and length: the last
        sample's), re-plan, and swap when the gain exceeds ``1 + margin``."""
        last = samples[-1]
        front, old = last.front, last.program
        same = [s for s in samples if s.program is old]  # the makespans of the running program
        rates = refit_rates(samples, len(last.rates))
        length = old.plan.seq_len
        planner = length_planner(self.options, rates)
        plan = planner(front, length)
        before = price_plan(front, self.options, old.plan, rates)
        pred_before, pred_after = _makespan(before), _makespan(plan)
        gain = pred_before / pred_after if pred_after > 0 else 1.0
        if _layout(plan) == _layout(old.plan):
            swapped, reason = False, "the re-plan is the running plan"
        elif gain <= 1 + margin:
            swapped, reason = False, f"gain {gain:.3f} ≤ 1 + margin ({1 + margin:.3f})"
        else:
            swapped, reason = True, f"gain {gain:.3f} > 1 + margin ({1 + margin:.3f})"
            self._swap(front, plan, planner, rates)
        measured = [statistics.median(s.busy[i] for s in same) for i in range(len(old.stages))]
        return RebalanceReport(
            swapped=swapped, reason=reason, rates_before=last.rates, rates_after=rates,
            plan_before=old.plan, plan_after=plan, busy_predicted=predicted_busy(old.plan),
            busy_measured=tuple(measured), predicted_before=_makespan(old.plan),
            predicted_before_refit=pred_before, predicted_after=pred_after,
            measured_before=statistics.median(s.makespan for s in same),
            measured_after=None, calls=len(samples), margin=margin)

    def _swap(self, front: Any, plan: Plan, planner: Any, rates: tuple[float, ...]) -> None:
        """Install the re-plan between calls (module docstring)."""
        emitter = dataclasses.replace(self.programs.emitter, planner=planner)
        program = self._admit(emitter.emit(front, plan))  # outside the lock: calls go on
        with self._lock:
            self.rates = rates
            self.programs.hold(front, program, emitter)
            self.__dict__.pop("_denoise_plans", None)
            if front is self._front and plan.seq_len == self.plan.seq_len:
                self.plan = plan
            else:
                self.plan = self.program(self.plan.seq_len).plan

    def _check_rebalance(self, calls: int, margin: float) -> None:
        if self.REBALANCE_REFUSAL is not None:
            raise SpecError(self.REBALANCE_REFUSAL)
        if self.programs.emitter.planner is None:
            raise SpecError(f"{self.model_name} was compiled with a given plan, which tppc "
                            "keeps as is: there is nothing to re-plan. fix: compile with "
                            "plan=None (tppc plans), then rebalance")
        if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
            raise SpecError(f"calls={calls!r} must be a number of traced calls ≥ 1")
        if isinstance(margin, bool) or not isinstance(margin, int | float) or not margin >= 0:
            raise SpecError(f"margin={margin!r} must be a fraction ≥ 0 (0.1: swap when the "
                            "re-plan is predicted more than 10 % faster)")


class AutoRebalance:
    """The automatic mode (:meth:`Rebalancing.auto_rebalance`): counts and traces calls.

    Attributes:
        every: calls per refit.
        margin: the margin of each decision.
        reports: the reports of the last refits (at most 16), oldest first.
    """

    KEEP = 16

    def __init__(self, every: int, margin: float) -> None:
        self.every, self.margin = every, margin
        self.reports: list[RebalanceReport] = []
        self._samples: list[Sample] = []
        self._lock = threading.Lock()

    def run(self, cp: Rebalancing, args: tuple[Any, ...], kwargs: Mapping[str, Any], *,
            timeout: float | None = None, executor: Any = None,
            trace: list | None = None) -> Any:
        """One call of ``cp``, traced; every ``every``-th call then refits (and maybe swaps).
        A refit that fails warns and leaves the pipeline as it was."""
        out, sample = cp.traced_run(args, kwargs, timeout=timeout, executor=executor,
                                    trace=trace)
        with self._lock:
            self._samples.append(sample)
            if len(self._samples) < self.every:
                return out
            samples, self._samples = self._samples, []
        t0 = time.perf_counter()
        try:
            report = cp.refit(samples, self.margin)
        except TppcError as exc:
            warnings.warn(f"tppc auto_rebalance: the refit after {len(samples)} calls failed "
                          f"({exc}); the pipeline keeps its program", stacklevel=3)
            return out
        with self._lock:
            self.reports.append(report)
            del self.reports[: max(0, len(self.reports) - self.KEEP)]
        if cp.options.verbose:
            print(f"[tppc rebalance] {time.perf_counter() - t0:.2f} s\n{report.table()}")
        return out


def _makespan(plan: Plan) -> float:
    return plan.latency - plan.warmup_seconds


def _layout(plan: Plan) -> tuple[Any, ...]:
    return (plan.boundaries, tuple((st.device_index, st.layer_names) for st in plan.stages))


def _with_after(report: RebalanceReport, measured: float) -> RebalanceReport:
    return dataclasses.replace(report, measured_after=measured)
