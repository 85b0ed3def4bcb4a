"""One planner for tensor parallelism × the token pipeline × replicas.

Terms:
    configuration: the tensor-parallel groups, or the intra-op groups of CPU devices (one
        worker of ``k`` threads each) (:mod:`.configurations`); its cost table has
        one row per group (:func:`tppc.cost_models.group_costs.group_cost_table`), and the
        placement + split planner (``plan_table``) chooses the stages among the groups, the
        layers of each and the chunks, exactly as it does for a chain of devices.
    objective: ``"latency"`` (one call's makespan) or ``"throughput_per_device"`` (calls per
        second per device: ``1 / (latency · devices of one pipeline)``; the devices left over
        run replicas, which leave it unchanged). For the second the stage count is searched
        explicitly (the first ``k`` groups, ``k = 1 … groups``).
    any-plan bound of a configuration: ``max(serial / groups, path)``, with each layer on its
        fastest group: no plan of the configuration, on any subset of its groups, is faster.
    search: configurations (× stage counts) in order of that bound; one whose bound (× its
        devices, for throughput) cannot beat the best plan found is pruned (exact); each gets
        half of the time left (the last one all of it). When nothing inside nodes fits in memory, groups
        spanning nodes are tried, and the plan says why.
    bound of the plan: the least over every configuration of its certified bound (the
        planner's ``lower_bound`` where it was planned, its any-plan bound otherwise): no
        configuration searched has a faster plan.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.table import CostTable
from tppc.errors import PlanInfeasible
from tppc.planner.choice import HybridChoice, degrees_text
from tppc.planner.configurations import Configuration
from tppc.planner.plan import Plan

__all__ = ["OBJECTIVES", "PlanTable", "PriceGroups", "plan_hybrid"]

OBJECTIVES = ("latency", "throughput_per_device")

PriceGroups = Callable[[Configuration], tuple[CostTable, tuple[str, ...]]]
"""``price(config) -> (group table, collectives per layer in words)``."""

PlanTable = Callable[[CostTable, "int | None", float, Configuration], "Plan | None"]
"""``plan_table(table, num_stages, seconds, config) -> Plan`` (stages on rows of ``table``,
the groups of ``config``); None: ``config``'s best plan is not of its own form (a ring's
gather form planned one patch, which runs the ring form: its one-patch twin has it), so the
configuration has no plan of its own (not refused: no reason is recorded)."""

MIN_SECONDS = 0.2
"""Seconds a candidate gets at least (its first incumbent)."""


@dataclass
class _Candidate:
    config: Configuration
    table: CostTable
    words: tuple[str, ...]
    stages: int | None
    work: float
    path: float
    plan: Plan | None = None
    refused: bool = False

    @property
    def bound(self) -> float:
        return max(self.work, self.path)

    def devices(self, plan: Plan | None = None) -> int:
        if plan is not None:
            return sum(len(self.config.groups[st.device_index]) for st in plan.stages)
        return sum(len(g) for g in self.config.groups[:self.stages or 1])


_GROUP_NOTE = re.compile(r"\bdevice (\d+) \(")


def _group_words(group: tuple[int, ...]) -> str:
    """A group in a note: ``group of devices 4-7 (``."""
    return f"group of devices {group[0]}-{group[-1]} ("


def _any_bound(table: CostTable, stages: int | None, granularity: int, steps: int = 1
               ) -> tuple[float, float]:
    """``(steps · serial / stages, path)``, each layer on its fastest row (module
    docstring): every step runs every layer on every token."""
    length = float(table.seq_len)
    g = min(float(granularity), length)
    serial = float(table.times_at(length, 0.0).min(axis=0).sum())
    path = float(table.times_at(g, length - g).min(axis=0).sum())
    return steps * serial / (stages or min(table.num_devices, max(table.num_layers, 1))), path


def _value(c: _Candidate, plan: Plan, objective: str) -> float:
    return plan.latency * (c.devices(plan) if objective != "latency" else 1)


def _label(c: _Candidate, plan: Plan | None) -> str:
    if plan is None:
        return f"PP{c.stages} x {c.config.label}" if c.stages else \
            f"{c.config.label} (any number of stages)"
    return degrees_text(_degrees(c, plan))


def _degrees(c: _Candidate, plan: Plan) -> dict:
    tps = tuple(c.config.degrees[st.device_index] for st in plan.stages)
    return {"num_stages": plan.num_stages,
            "tensor_parallel": tps[0] if len(set(tps)) == 1 else tps,
            "cfg_parallel": c.config.cfg_parallel, "ulysses": c.config.ulysses,
            "ring": c.config.ring, "intra_op": c.config.intra_op, "replicas": 1}


def _replicas(cluster: Cluster, used: Sequence[int]) -> int:
    """Disjoint copies of the pipeline's devices (by device kind) the cluster holds."""
    need: dict[str, int] = {}
    for d in used:
        need[cluster.device_names[d]] = need.get(cluster.device_names[d], 0) + 1
    return min(sum(1 for n in cluster.device_names if n == kind) // k
               for kind, k in need.items())


def plan_hybrid(configs: Sequence[Configuration], price: PriceGroups, plan_table: PlanTable, *,
                cluster: Cluster, granularity: int, num_stages: int | None = None,
                objective: str = "latency", time_limit: float = 10.0,
                across: Sequence[Configuration] = (), infeasible: Sequence[str] = (),
                steps: int = 1) -> Plan:
    """The best plan over ``configs`` (module docstring); ``across``: configurations whose
    groups span nodes, searched only when none of ``configs`` fits; ``steps``: the calls'
    steps (diffusion: each runs every layer on every token), for the any-plan bound.

    Raises:
        PlanInfeasible: no configuration fits (the first configuration's error).
    """
    deadline = time.perf_counter() + time_limit
    refused = list(infeasible)
    first_error: PlanInfeasible | None = None
    for pool, spans in ((configs, False), (across, True)):
        if not pool:
            continue
        candidates = _candidates(pool, price, num_stages, objective, granularity, steps)
        if not spans:  # the solver's seconds start once the candidates are priced
            deadline = max(deadline, time.perf_counter() + time_limit)
        best, error = _search(candidates, plan_table, objective, deadline, refused)
        first_error = first_error or error
        if best is not None:
            note = "" if not spans else (
                "no configuration with groups inside one node fits ("
                + "; ".join(refused[-3:]) + "), so groups cross the inter-node link")
            return _package(best, candidates, cluster, objective, refused, note)
    if first_error is None:  # no candidate at all: every stage count above the layers
        raise PlanInfeasible(
            f"no configuration of {str(cluster)!r} can be planned: each needs more stages "
            f"than the model has layers ({'; '.join(refused[-3:]) or 'none refused'}). fix: "
            "fewer devices, or fix degrees whose groups leave fewer stages")
    raise first_error


def _candidates(pool: Sequence[Configuration], price: PriceGroups, num_stages: int | None,
                objective: str, granularity: int, steps: int = 1) -> list[_Candidate]:
    out = []
    for config in pool:
        table, words = price(config)
        fixed = config.fixed_stages or num_stages
        counts: Sequence[int | None] = [fixed]
        if fixed is None and objective != "latency":
            counts = range(1, min(table.num_devices, table.num_layers) + 1)
        for k in counts:
            if k is not None and k > min(table.num_devices, table.num_layers):
                continue
            work, path = _any_bound(table, k, granularity, steps)
            out.append(_Candidate(config, table, words, k, work, path))
    return out


def _search(candidates: list[_Candidate], plan_table: PlanTable, objective: str,
            deadline: float, refused: list[str]) -> tuple[_Candidate | None, PlanInfeasible | None]:
    def key(c: _Candidate) -> float:
        return c.bound * (c.devices() if objective != "latency" else 1)

    order = sorted(candidates, key=key)
    best: _Candidate | None = None
    error: PlanInfeasible | None = None
    for i, c in enumerate(order):
        if best is not None and (key(c) >= _value(best, best.plan, objective)
                                 or time.perf_counter() >= deadline):
            continue
        left = deadline - time.perf_counter()  # the most promising bound gets the most
        seconds = max(left / 2 if i < len(order) - 1 else left, MIN_SECONDS)
        try:
            c.plan = plan_table(c.table, c.stages, seconds, c.config)
            c.refused = c.plan is None  # no plan of its own form: its twin has it
        except PlanInfeasible as exc:
            error = error or exc
            c.refused = True
            refused.append(f"PP{c.stages or '*'} x {c.config.label}: {str(exc).splitlines()[0]}")
            continue
        if c.plan is None:
            continue
        if best is None or _value(c, c.plan, objective) < _value(best, best.plan, objective) \
                * (1 - 1e-9):
            best = c
    return best, error


def _package(best: _Candidate, candidates: list[_Candidate], cluster: Cluster, objective: str,
             refused: list[str], spans_note: str) -> Plan:
    plan = best.plan
    assert plan is not None
    groups = best.config.groups
    cfg = best.config
    stages = tuple(dataclasses.replace(
        st, device_index=groups[st.device_index][0], device_indices=groups[st.device_index],
        tensor_parallel=cfg.degrees[st.device_index], cfg_parallel=cfg.cfg_parallel,
        ulysses=cfg.ulysses, ring=cfg.ring, intra_op=cfg.intra_op) for st in plan.stages)
    used = [d for st in stages for d in st.device_indices]
    planned = [c for c in candidates if c.plan is not None]
    others = sorted((c for c in planned if c is not best),
                    key=lambda c: _value(c, c.plan, objective))
    runner = others[0] if others else None
    unit = "ms" if objective == "latency" else "ms x devices"
    mine = _value(best, plan, objective) * 1e3
    runner_text = why = ""
    if runner is not None:
        theirs = _value(runner, runner.plan, objective) * 1e3
        runner_text = f"{_label(runner, runner.plan)}: {theirs:.3f} {unit}"
        why = (f"{_label(best, plan)} predicts {mine:.3f} {unit}, {100 * (1 - mine / theirs):.1f}"
               f"% less than the runner-up {_label(runner, runner.plan)} ({theirs:.3f} {unit})")
    skipped = sorted((c for c in candidates if c.plan is None and not c.refused),
                     key=lambda c: c.bound * (1 if objective == "latency" else c.devices()))
    closer = skipped and runner is not None and objective == "latency" \
        and skipped[0].bound < _value(runner, runner.plan, objective)
    if (runner is None or closer) and skipped:  # an unplanned one may be the runner-up
        low = skipped[0].bound * (1 if objective == "latency" else skipped[0].devices()) * 1e3
        runner_text = f"{_label(skipped[0], None)}: at least {low:.3f} {unit} (its bound)"
        why = (f"{_label(best, plan)} predicts {mine:.3f} {unit}; no plan of "
               f"{_label(skipped[0], None)} can take less than {low:.3f} {unit} (its lower "
               "bound), so it was not planned")
        if low < mine:  # skipped by the deadline, not by its bound
            why = (f"{_label(best, plan)} predicts {mine:.3f} {unit}; "
                   f"{_label(skipped[0], None)} (bound {low:.3f} {unit}) and others were not "
                   "planned within the time limit, so the choice is not proven best: give "
                   "more time_limit, or fix the degrees")
    bounds = [(min(c.plan.lower_bound, c.bound) if c.plan.lower_bound > 0 else c.bound, c)
              if c.plan is not None else (c.bound, c) for c in candidates]
    low, low_c = min(bounds, key=lambda item: item[0])
    if low_c.plan is not None and low == low_c.plan.lower_bound:
        work, path = low_c.plan.lower_bound_work, low_c.plan.lower_bound_path
    else:
        work, path = low_c.work, low_c.path
    choice = HybridChoice(
        objective=objective, searched=len(planned), infeasible=tuple(refused),
        pruned=sum(1 for c in candidates if c.plan is None and not c.refused), runner_up=runner_text, why=why,
        collectives=tuple(w for st in stages for w in best.words[st.layer_start:st.layer_end]
                          if w) if any(st.group_size > 1 for st in stages) else (),
        spans_nodes=spans_note)
    notes = tuple(_GROUP_NOTE.sub(lambda m: _group_words(groups[int(m.group(1))]), n)
                  for n in plan.notes) if any(len(g) > 1 for g in groups) else plan.notes
    return dataclasses.replace(plan, stages=stages, replicas=_replicas(cluster, used),
                               choice=choice, notes=notes, lower_bound=low, lower_bound_work=work,
                               lower_bound_path=path)
