"""Which devices of the cluster take part: a plan may leave slow devices idle.

Terms:
    device set: the devices that run stages, in chain order; stage ``s`` runs on the ``s``-th
        device of the set. Activations between two chosen devices cross every link between
        them: latencies add, the slowest link sets the bandwidth.
    candidates: every non-empty device set when the cluster has at most
        :data:`EXHAUSTIVE_DEVICES` devices; otherwise, for each size ``k``, the ``k`` devices
        that run the whole model fastest (for identical devices: the first ``k``).

Each candidate is planned (``plan_from_costs`` with ``num_stages = k``) unless its lower
bound (serial work / k, or one chunk's path through every layer) already reaches the best
latency found: such a set cannot give a faster plan, so skipping it is exact. The plan keeps
the fastest candidate and says, for each idle device, why it was left out.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable

from tppc.cost_models.table import CostTable, LinkCost
from tppc.errors import PlanInfeasible
from tppc.planner.evaluate import lower_bounds
from tppc.planner.plan import Plan
from tppc.planner.workload import Workload

__all__ = ["EXHAUSTIVE_DEVICES", "choose_devices", "sub_table"]

EXHAUSTIVE_DEVICES = 6
"""Clusters of at most this many devices try every device set (``2^D - 1``)."""


def sub_table(table: CostTable, devices: tuple[int, ...]) -> CostTable:
    """The cost table of a chain made of ``devices`` (indices into ``table``, increasing)."""
    links = []
    for a, b in itertools.pairwise(devices):
        hops = table.links[a:b]
        links.append(LinkCost(latency=sum(lk.latency for lk in hops),
                              bandwidth=min(lk.bandwidth for lk in hops)))
    return dataclasses.replace(
        table,
        device_names=tuple(table.device_names[d] for d in devices),
        capacities=tuple(table.capacities[d] for d in devices),
        pools=tuple(table.pools[d] for d in devices) if table.pools else (),
        layers=tuple(table.layers[d] for d in devices),
        links=tuple(links),
    )


def _candidates(table: CostTable) -> list[tuple[int, ...]]:
    n = table.num_devices
    if n <= EXHAUSTIVE_DEVICES:
        sets = [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
    else:
        speed = [float(row.sum()) for row in table.times_at(table.seq_len, 0.0)]
        order = sorted(range(n), key=lambda d: (speed[d], d))
        sets = [tuple(sorted(order[:k])) for k in range(1, n + 1)]
    return [s for s in sets if len(s) <= table.num_layers]


def choose_devices(
    table: CostTable,
    plan: Callable[[CostTable, int, float], Plan],
    workload: Workload,
    granularity: int,
    time_limit: float,
) -> Plan:
    """Plan on the best device set (see the module docstring).

    Args:
        table: the whole cluster's cost table.
        plan: ``plan(sub_table, num_stages, seconds)`` plans on a device set.
        workload: for the lower bounds.
        granularity: for the lower bounds.
        time_limit: seconds for all candidates together.

    Raises:
        PlanInfeasible: when no device set fits (the error of the whole cluster).
    """
    t0 = time.perf_counter()
    sets = sorted(_candidates(table), key=lambda s: -len(s))  # all devices first
    bounds = {s: max(lower_bounds(sub_table(table, s), len(s), workload, granularity,
                                  ranged=False)) for s in sets}
    full = sets[0]
    sets.sort(key=lambda s: (s != full, bounds[s]))
    best: Plan | None = None
    best_set: tuple[int, ...] = ()
    tried: dict[tuple[int, ...], float] = {}
    first_error: PlanInfeasible | None = None
    for s in sets:
        left = time_limit - (time.perf_counter() - t0)
        if best is not None and (bounds[s] >= best.latency or left <= 0):
            continue
        try:
            got = plan(sub_table(table, s), len(s), max(left, 0.05) if best is None else left)
        except PlanInfeasible as exc:
            first_error = first_error or exc
            continue
        tried[s] = got.latency
        if best is None or got.latency < best.latency * (1 - 1e-9):
            best, best_set = got, s
    if best is None:
        assert first_error is not None
        raise first_error
    stages = tuple(dataclasses.replace(st, device_index=best_set[st.index])
                   for st in best.stages)
    notes = list(best.notes)
    for d in sorted(set(range(table.num_devices)) - set(best_set)):
        with_d = [v for s, v in tried.items() if d in s]
        bound = min((bounds[s] for s in sets if d in s), default=math.inf)
        why = (f"the fastest plan using it takes {min(with_d) * 1e3:.3f} ms" if with_d else
               f"no plan using it can beat {best.latency * 1e3:.3f} ms (lower bound "
               f"{bound * 1e3:.3f} ms)")
        notes.append(f"device {d} ({table.device_names[d]}) left idle: {why}; this plan takes "
                     f"{best.latency * 1e3:.3f} ms")
    return dataclasses.replace(best, stages=stages, notes=tuple(notes))
