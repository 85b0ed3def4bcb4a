"""Tensor-parallel degrees in ``tppc.plan``: the configurations, their prices, the search.

The front end's graph says what can be cut (``SHARD`` roles on its nodes, copied onto the
chunk-step graph, whose own buffer writes take their source's cut; the sizes a degree must
divide in ``gm.meta[SHARD_SIZES]``: the sharding pass); the cluster says which
groups exist (:mod:`tppc.planner.configurations`); each configuration is priced as a table of
groups (:func:`tppc.cost_models.group_costs.group_cost_table`) and planned by the placement +
split planner; :func:`tppc.planner.hybrid.plan_hybrid` keeps the best.

A model with nothing to cut, a cluster of one device, or ``tensor_parallel=1`` plans exactly
as before (one device a stage; the same plan, bit for bit), unless the cluster's devices are
CPUs: then the intra-op configurations (one worker of ``k`` threads per group of ``k``
devices, :func:`tppc.planner.configurations.intra_op_configurations`) are priced beside them
on a ``k``-thread calibration (:mod:`tppc.cost_models.intra_op`), unless ``intra_op=1``. A
pinned calibration (``$TPPC_CALIBRATION``) without a ``k``-thread entry prices none: those
plans stay as they were.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.intra_op import intra_op_chain, intra_op_spec, intra_op_workers
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.shard_costs import effective_roles
from tppc.cost_models.table import CostTable
from tppc.driver.mesh_planning import capped
from tppc.driver.options import CompileOptions
from tppc.errors import PlanError, SpecError
from tppc.frontend.front_end import FrontEnd
from tppc.ir.records import SHARD_SIZES, ShardRole
from tppc.planner.configurations import (
    Configuration,
    check_degree,
    fixed_configuration,
    intra_op_configurations,
    tp_configurations,
)
from tppc.planner.devices import sub_table
from tppc.planner.hybrid import plan_hybrid
from tppc.planner.plan import Plan
from tppc.program.mesh import Mesh

__all__ = ["plan_groups_table", "shard_sizes", "tensor_parallel_plan", "wants_hybrid"]

#: ``plan(table_at, num_stages, seconds) -> Plan``: the one-device-a-stage planner of a length.
PlanLength = Callable[[Callable[[int], CostTable], "int | None", float], Plan]


def shard_sizes(front: FrontEnd) -> tuple[int, ...] | None:
    """The sizes a degree must divide, or None when nothing in the model was sharded."""
    for gm in (front.annotated, front.chunk):
        sizes = gm.meta.get(SHARD_SIZES)
        if sizes is not None:
            return tuple(int(s) for s in sizes)
    return None


def _intra_op_configs(opts: CompileOptions) -> list[Configuration]:
    """The intra-op configurations ``opts`` allow: the fixed one, or with ``intra_op=None``
    (and no tensor degree above 1) those whose ``k``-thread calibration exists or can be
    measured (a pin without one prices none; the module docstring)."""
    if opts.intra_op == 1:
        return []
    cluster = Cluster.parse(opts.cluster)
    if opts.intra_op is not None:
        if opts.num_stages is not None and opts.num_stages * opts.intra_op >                 cluster.num_devices:
            raise PlanError(f"intra_op={opts.intra_op} with num_stages={opts.num_stages} needs "
                            f"{opts.num_stages * opts.intra_op} CPU devices, the cluster "
                            f"{str(cluster)!r} has {cluster.num_devices}. fix: fewer stages, "
                            "a smaller intra_op, or a larger cluster")
        return intra_op_configurations(cluster, opts.intra_op)
    tp = opts.tensor_parallel
    if tp is not None and any(t > 1 for t in (tp if isinstance(tp, tuple) else (tp,))):
        return []
    out = []
    for config in intra_op_configurations(cluster):
        try:
            intra_op_spec(config.intra_op, len(config.groups))
        except SpecError:  # pinned without k threads: not priced (module docstring)
            continue
        out.append(config)
    return out


def wants_hybrid(front: FrontEnd, opts: CompileOptions) -> bool:
    """Whether degrees above 1 (tensor-parallel or intra-op) are possible and not excluded
    by ``tensor_parallel=1`` / ``intra_op=1``."""
    if _intra_op_configs(opts):
        return True
    tp = opts.tensor_parallel
    if tp is not None:  # fixed degrees: checked (named errors) by fixed_configuration
        return any(t > 1 for t in (tp if isinstance(tp, tuple) else (tp,)))
    return Cluster.parse(opts.cluster).num_devices > 1 and bool(shard_sizes(front))


def _intra_op_table(front: FrontEnd, opts: CompileOptions, tokens: int,
                    config: Configuration, rates: tuple[float, ...] | None) -> CostTable:
    """The cost table of an intra-op configuration: one row per group, each priced as one
    device of ``config.intra_op`` threads (:mod:`tppc.cost_models.intra_op`)."""
    ctx = front.ctx
    chain = intra_op_chain(Cluster.parse(opts.cluster), config.groups, config.intra_op)
    table = build_cost_table(front.chunk, ctx.layers, chain, tokens, seq_symbol=ctx.seq_symbol,
                             token_count=ctx.token_count, queue_depth=opts.queue_depth)
    if rates is not None:
        table = table.scaled([max(rates[d] for d in g) for g in config.groups])
    return capped(table, opts.memory_limit_bytes)


def _group_table(front: FrontEnd, opts: CompileOptions, tokens: int,
                 groups: tuple[tuple[int, ...], ...], rates: tuple[float, ...] | None,
                 roles: dict[str, ShardRole] | None = None, mesh: Mesh | None = None,
                 cluster: Cluster | None = None) -> tuple[CostTable, tuple[str, ...]]:
    ctx = front.ctx
    table, words = group_cost_table(
        front.chunk, ctx.layers, cluster or Cluster.parse(opts.cluster), tokens, groups,
        roles=effective_roles(front.chunk) if roles is None else roles,
        queue_depth=opts.queue_depth, seq_symbol=ctx.seq_symbol, token_count=ctx.token_count,
        mesh=mesh)
    if rates is not None:
        table = table.scaled([max(rates[d] for d in g) for g in groups])
    return table, words


def plan_groups_table(front: FrontEnd, opts: CompileOptions, plan: Plan,
                      rates: tuple[float, ...] | None = None) -> CostTable:
    """The cost table whose rows are ``plan``'s stage groups, in stage order (a plan with
    tensor-parallel or mesh stages priced again)."""
    groups = tuple(st.device_indices for st in plan.stages)
    first = plan.stages[0]
    tokens = plan.seq_len * plan.tokens_per_unit
    mesh = None if first.workers == first.tensor_parallel else Mesh(
        cfg=first.cfg_parallel, ring=first.ring, ulysses=first.ulysses)
    if first.intra_op > 1 and mesh is None:
        config = Configuration(groups, intra_op=first.intra_op)
        return _intra_op_table(front, opts, tokens, config, rates)
    if first.intra_op > 1:  # a DiT's mesh of intra-op workers: a worker a k-thread device
        chain, workers = intra_op_workers(Cluster.parse(opts.cluster), groups,
                                          first.intra_op, first.workers)
        table = _group_table(front, opts, tokens, workers, None, mesh=mesh, cluster=chain)[0]
        if rates is not None:
            table = table.scaled([max(rates[d] for d in g) for g in groups])
        return table
    return _group_table(front, opts, tokens, groups, rates, mesh=mesh)[0]


def tensor_parallel_plan(front: FrontEnd, opts: CompileOptions, tokens: int,
                         table_at: Callable[[int], CostTable], plan_length: PlanLength,
                         granularity: int, objective: str = "latency",
                         rates: tuple[float, ...] | None = None) -> Plan:
    """The best plan over the configurations ``opts`` and the model allow.

    Args:
        front: the front end (its graph's shard roles and sizes).
        opts: the options (``cluster``, ``tensor_parallel``, ``intra_op``, ``num_stages``,
            ``time_limit``).
        tokens: the length priced, in tokens.
        table_at: the one-device-a-stage cost table at a length (degree 1 reuses it).
        plan_length: plans one table (rows = groups) with a stage count in some seconds.
        granularity: the grid step in tokens (for the bounds that order the search).
        objective: ``"latency"`` or ``"throughput_per_device"``.
        rates: measured/predicted seconds per device (a group takes its slowest member's).

    Raises:
        PlanError: a fixed degree that does not divide the shard sizes or does not fit (an
            ``intra_op`` that does not divide the CPU devices, or on a non-CPU cluster).
        PlanInfeasible: no configuration fits in memory.
    """
    cluster = Cluster.parse(opts.cluster)
    sizes = shard_sizes(front) or ()
    across: list[Configuration] = []
    if opts.intra_op is not None and opts.intra_op > 1:
        configs: list[Configuration] = []
    elif opts.tensor_parallel is not None:
        configs = [fixed_configuration(cluster, sizes, opts.tensor_parallel, opts.num_stages)]
    else:
        configs = tp_configurations(cluster, sizes)
        across = tp_configurations(cluster, sizes, across_nodes=True)
    configs += _intra_op_configs(opts)
    roles: dict[str, ShardRole] | None = None
    base: list[CostTable] = []

    def price(config: Configuration) -> tuple[CostTable, tuple[str, ...]]:
        nonlocal roles
        if config.intra_op > 1:
            return _intra_op_table(front, opts, tokens, config, rates), ()
        if all(t == 1 for t in config.degrees):
            if not base:
                base.append(table_at(tokens))
            return sub_table(base[0], tuple(g[0] for g in config.groups)), ()
        for t in set(config.degrees):
            check_degree(t, sizes)
        roles = effective_roles(front.chunk) if roles is None else roles
        return _group_table(front, opts, tokens, config.groups, rates, roles)

    def plan_table(table: CostTable, stages: int | None, seconds: float,
                   _config: Configuration) -> Plan:
        return plan_length(lambda _length: table, stages, seconds)

    plan = plan_hybrid(configs, price, plan_table, cluster=cluster,
                       granularity=granularity, num_stages=opts.num_stages,
                       objective=objective, time_limit=opts.time_limit, across=across)
    if opts.tensor_parallel is not None and configs[0].spans_nodes:
        note = (f"tensor_parallel={opts.tensor_parallel} was given: a group crosses the "
                "inter-node link (priced so)")
        plan = dataclasses.replace(plan, choice=dataclasses.replace(
            plan.choice, spans_nodes=note)) if plan.choice else plan
    return plan
