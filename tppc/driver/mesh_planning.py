"""CFG × Ulysses × Ring × TP × PipeFusion in ``tppc.plan`` for diffusion transformers.

The front end's graph says what the model allows (:func:`mesh_limits`: each attention's
head count and the call's batch, read off the attention nodes; the sharding pass's shard
sizes; the meshes whose batch or token cut the graph refuses, tried once each on the model as
one stage); the cluster and the fixed degrees say which meshes exist
(:func:`tppc.planner.mesh_configurations.mesh_configurations`); each configuration is priced
as a table of groups (:func:`tppc.cost_models.group_costs.group_cost_table` with its mesh:
one worker's share of every layer plus the group's exchanges on its own links) and planned
by the placement + split planner (stages among the groups, patches);
:func:`tppc.planner.hybrid.plan_hybrid` keeps the best and says why, with a bound over every
configuration searched.

What pricing finds (each mesh's cut tried on the model, each configuration's table of
groups) depends on the front end, the length and the planner's options, and of the workload
only on whether it has stale steps (a ring's gather form for plans of several patches,
beside the ring form of its one-patch twin: :func:`mesh_plan`), so a planner keeps it
(:class:`MeshPrices`): a diffusion plan for a new step count (``cp.denoise``, the drop-in's
first call of a loop) re-solves, it does not re-price.

On a cluster of CPU devices each worker may run several devices' cores as intra-op threads
(``intra_op``, :mod:`tppc.planner.mesh_configurations`): such a configuration is priced on
the calibration measured with that many threads, for all its workers at once
(:func:`tppc.cost_models.intra_op.intra_op_workers`); with ``intra_op=None`` one whose
calibration a pin (``$TPPC_CALIBRATION``) lacks is not priced, and the plan's refusals say
so by name; a given ``intra_op`` without it is refused.

The configuration of one device a group (no degree above 1) is priced by the plain cost
table; when it is the only one (e.g. ``num_stages`` = the cluster's devices) it is planned
alone, so the plan is the PipeFusion plan tppc made before, bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from torch import fx

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.intra_op import intra_op_spec, intra_op_workers
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.node_shapes import tensor_vals
from tppc.cost_models.shard_costs import effective_roles
from tppc.cost_models.table import CostTable
from tppc.driver.options import CompileOptions
from tppc.errors import PlanError, SpecError, TppcError
from tppc.frontend.front_end import FrontEnd
from tppc.ir.records import SHARD_SIZES, TOKEN, ShardRole
from tppc.passes.meshcut.worker_graph import worker_graph
from tppc.passes.stages.partition_stages import split_stages
from tppc.planner.configurations import Configuration
from tppc.planner.devices import sub_table
from tppc.planner.hybrid import plan_hybrid
from tppc.planner.mesh_configurations import FixedDegrees, MeshLimits, mesh_configurations
from tppc.planner.plan import Plan
from tppc.program.mesh import Mesh

__all__ = ["MeshPrices", "capped", "mesh_limits", "mesh_plan", "wants_mesh"]

T = TypeVar("T")

#: ``plan(table_at, num_stages, seconds, one_patch=False) -> Plan``: the one-device-a-stage
#: planner of a length (``one_patch``: at most one patch a step).
PlanLength = Callable[..., Plan]


class MeshPrices:
    """What pricing meshes found, per front end, kept across one planner's plans (the
    module docstring): the least recently used of more than ``keep`` entries go first."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._kept: OrderedDict[tuple[Any, ...], tuple[FrontEnd, Any]] = OrderedDict()
        self._lock = threading.RLock()  # a value's make() may get another

    def get(self, front: FrontEnd, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """The value kept for ``front`` under ``key``, else ``make()`` kept."""
        full = (id(front), *key)
        with self._lock:
            hit = self._kept.get(full)
            if hit is not None and hit[0] is front:  # an id may be reused by a later front
                self._kept.move_to_end(full)
                return hit[1]
            value = make()
            self._kept[full] = (front, value)
            while len(self._kept) > self.keep:
                self._kept.popitem(last=False)
            return value


def _attention_shapes(gm: fx.GraphModule) -> list[tuple[int, ...]]:
    """``(batch, heads, tokens, dim)`` of every attention of ``gm`` (self and cross)."""
    out = []
    for node in gm.graph.nodes:
        info = node.meta.get(TOKEN)
        attention = "scaled_dot_product_attention" in str(node.target) or (
            info is not None and getattr(info, "role", None) == "mixing")
        vals = tensor_vals(node.meta.get("val")) if attention else []
        if vals and vals[0].dim() == 4:
            shape = tuple(vals[0].shape)
            if all(isinstance(d, int) for d in shape[:2]):
                out.append(shape)
    return out


def mesh_limits(front: FrontEnd, tokens: int) -> MeshLimits:
    """What ``front``'s model allows at ``tokens`` tokens (the module docstring)."""
    shapes = _attention_shapes(front.annotated)
    sizes = front.annotated.meta.get(SHARD_SIZES) or front.chunk.meta.get(SHARD_SIZES) or ()
    return MeshLimits(heads=tuple(sorted({int(s[1]) for s in shapes})) or (1,),
                      shard_sizes=tuple(int(s) for s in sizes),
                      batch=int(shapes[0][0]) if shapes else 1, tokens=tokens)


def _fixed(opts: CompileOptions) -> FixedDegrees:
    tp = opts.tensor_parallel
    if isinstance(tp, tuple):
        raise PlanError(f"tensor_parallel={tp}: a diffusion transformer's stages share one "
                        "mesh (every stage cuts the batch and the tokens alike). fix: one "
                        "degree, e.g. tensor_parallel=2")
    return FixedDegrees(cfg_parallel=opts.cfg_parallel, ulysses=opts.ulysses, ring=opts.ring,
                        tensor_parallel=tp, num_stages=opts.num_stages, intra_op=opts.intra_op,
                        every_device=opts.executor == "distributed")  # a rank per device


def wants_mesh(front: FrontEnd, opts: CompileOptions) -> bool:
    """Whether a bidirectional model's plan searches meshes: a degree above 1 given, or
    more than one device and not every degree fixed to 1 (``intra_op`` among them)."""
    if not front.bidirectional:
        return False
    given = [opts.cfg_parallel, opts.ulysses, opts.ring, opts.tensor_parallel, opts.intra_op]
    if any(d is not None and d != 1 for d in given):
        return True
    return Cluster.parse(opts.cluster).num_devices > 1 and any(d is None for d in given)


def _cuttable(front: FrontEnd, configs: list[Configuration], refused: list[str],
              opts: CompileOptions, prices: MeshPrices) -> list[Configuration]:
    """``configs`` less those whose batch or token cut the graph refuses: each distinct
    cfg × ring × ulysses is tried once on the whole model as one stage
    (:func:`tppc.passes.meshcut.worker_graph.worker_graph`, worker 0), and its refusal is
    recorded in ``refused`` (a video's frame blocks under Ring or Ulysses, an op that mixes
    batch elements under CFG...).

    Raises:
        PlanError: a degree the user gave is refused (the graph's reason).
    """
    meshes = {Mesh(cfg=c.cfg_parallel, ring=c.ring, ulysses=c.ulysses) for c in configs}
    meshes.discard(Mesh())
    if not meshes:
        return configs
    names = [layer.name for layer in front.ctx.layers]
    stage: list[fx.GraphModule | None] = []

    def whole() -> fx.GraphModule | None:
        try:
            return split_stages(front.chunk, names, [(0, len(names))]).stage_0
        except TppcError:  # not one stage (a front end of a few blocks): the compile checks
            return None

    def why(mesh: Mesh) -> str:
        if not stage:
            stage.append(prices.get(front, ("whole",), whole))
        if stage[0] is None:
            return ""
        try:
            worker_graph(stage[0], mesh, 0, what="the model as one stage")
        except TppcError as exc:
            return str(exc).splitlines()[0]
        return ""

    bad: dict[Mesh, str] = {}
    for mesh in sorted(meshes, key=lambda m: (m.cfg, m.ring, m.ulysses)):
        reason = prices.get(front, ("cut", mesh), lambda mesh=mesh: why(mesh))
        if reason:
            bad[mesh] = reason
    given = Mesh(cfg=opts.cfg_parallel or 1, ring=opts.ring or 1, ulysses=opts.ulysses or 1)
    if given in bad:
        raise PlanError(f"cfg_parallel={given.cfg}, ring={given.ring}, ulysses="
                        f"{given.ulysses}: {bad[given]}. fix: other degrees, or leave them "
                        "to the planner")
    refused.extend(f"{mesh}: {why}" for mesh, why in bad.items())
    return [c for c in configs
            if Mesh(cfg=c.cfg_parallel, ring=c.ring, ulysses=c.ulysses) not in bad]


def _calibrated(configs: list[Configuration], refused: list[str], opts: CompileOptions
                ) -> list[Configuration]:
    """``configs`` less the intra-op ones without a calibration of their threads and
    workers (module docstring), each recorded in ``refused``.

    Raises:
        SpecError: the ``intra_op`` the user gave has none (the calibration's reason).
    """
    out = []
    for config in configs:
        if config.intra_op > 1:
            try:
                intra_op_spec(config.intra_op, len(config.groups) * config.token_workers)
            except SpecError as exc:
                if opts.intra_op is not None:
                    raise
                refused.append(f"{config.label}: {str(exc).splitlines()[0]}")
                continue
        out.append(config)
    return out


def capped(table: CostTable, limit: int | None) -> CostTable:
    """``table`` with every row's capacity at most ``limit`` bytes (None: unchanged)."""
    if limit is None:
        return table
    return dataclasses.replace(table, capacities=tuple(min(c, limit) for c in table.capacities))


def mesh_plan(front: FrontEnd, opts: CompileOptions, tokens: int,
              table_at: Callable[[int], CostTable], plan_length: PlanLength,
              granularity: int, objective: str = "latency",
              rates: tuple[float, ...] | None = None, steps: int = 1,
              prices: MeshPrices | None = None, stale: bool = False,
              patches_free: bool = True) -> Plan:
    """The best plan over the meshes ``opts`` and the model allow (module docstring).

    Args:
        front: the front end (attention shapes, shard roles and sizes).
        opts: the options (``cluster``, the degrees, ``memory_limit``, ``time_limit``).
        tokens: the length priced, in tokens.
        table_at: the one-device-a-stage cost table at a length (capped already).
        plan_length: plans one table (rows = groups) with a stage count in some seconds.
        granularity: the grid step in tokens (for the bounds that order the search).
        objective: ``"latency"`` or ``"throughput_per_device"``.
        rates: measured/predicted seconds per device (a group takes its slowest member's).
        steps: the workload's steps (for the any-plan bound of a configuration).
        prices: what earlier plans of this planner priced (None: price afresh); it must
            belong to one planner (one ``opts`` and ``rates``).
        stale: the workload has stale PipeFusion steps. Their programs run a ring's
            attentions in the gather form when a step has more than one patch, in the ring
            form with one (:func:`tppc.pipefusion.denoise.patch_programs`), so each
            configuration with a ring is priced in both, as two candidates: the gather form
            (its time, its exchanges, a whole key length of K/V per worker), whose plans of
            one patch are dropped (not what runs), and its one-patch twin
            (``Configuration.one_patch``) in the ring form, planned with one patch.
        patches_free: the planner chooses the patch count (False: the caller fixed it
            above one, so a ring runs the gather form only and has no one-patch twin).

    Raises:
        PlanError: fixed degrees the model or the cluster cannot hold, named.
        PlanInfeasible: no configuration fits in memory (each one's reason in the error).
    """
    cluster = Cluster.parse(opts.cluster)
    limits = mesh_limits(front, tokens)
    configs, refused = mesh_configurations(cluster, limits, _fixed(opts))
    prices = prices or MeshPrices()
    configs = _calibrated(_cuttable(front, configs, refused, opts, prices), refused, opts)
    if stale and patches_free:  # a ring runs its ring form only with one patch: priced apart
        configs = [*configs, *(dataclasses.replace(c, one_patch=True)
                               for c in configs if c.ring > 1)]
    if len(configs) == 1 and all(len(g) == 1 for g in configs[0].groups):  # PipeFusion alone
        return plan_length(table_at, opts.num_stages or configs[0].fixed_stages,
                           opts.time_limit)
    roles: dict[str, ShardRole] = {}
    base: list[CostTable] = []
    ctx = front.ctx

    def gathers(config: Configuration) -> bool:
        """The programs of ``config``'s plans run a ring's gather form (module docstring)."""
        return stale and config.ring > 1 and not config.one_patch

    def price(config: Configuration) -> tuple[CostTable, tuple[str, ...]]:
        key = dataclasses.replace(config, one_patch=False)  # the form is the other key
        return prices.get(front, ("price", tokens, key, gathers(config)),
                          lambda: priced(config))

    def priced(config: Configuration) -> tuple[CostTable, tuple[str, ...]]:
        if all(len(g) == 1 for g in config.groups):
            if not base:
                base.append(table_at(tokens))
            return sub_table(base[0], tuple(g[0] for g in config.groups)), ()
        chain, groups = cluster, config.groups
        if config.intra_op > 1:  # a worker a device of the k-thread spec
            chain, groups = intra_op_workers(cluster, config.groups, config.intra_op,
                                             config.token_workers)
        if config.intra_op > 1 and config.token_workers == 1:  # the plain table of them
            table = build_cost_table(front.chunk, ctx.layers, chain, tokens,
                                     seq_symbol=ctx.seq_symbol, token_count=ctx.token_count,
                                     queue_depth=opts.queue_depth)
            words: tuple[str, ...] = ()
        else:
            if not roles:
                roles.update(effective_roles(front.chunk))
            table, words = group_cost_table(
                front.chunk, ctx.layers, chain, tokens, groups, roles=roles,
                queue_depth=opts.queue_depth, seq_symbol=ctx.seq_symbol,
                token_count=ctx.token_count,
                mesh=Mesh(cfg=config.cfg_parallel, ring=config.ring, ulysses=config.ulysses),
                ring_gather=gathers(config))
        if rates is not None:
            table = table.scaled([max(rates[d] for d in g) for g in config.groups])
        return capped(table, opts.memory_limit_bytes), words

    def plan_table(table: CostTable, stages: int | None, seconds: float,
                   config: Configuration) -> Plan | None:
        plan = plan_length(lambda _length: table, stages, seconds, one_patch=config.one_patch)
        if gathers(config) and patches_free and len(plan.boundaries) <= 2:
            return None  # one patch runs the ring form: the one-patch twin prices it
        return plan

    return plan_hybrid(configs, price, plan_table, cluster=cluster, granularity=granularity,
                       num_stages=opts.num_stages, objective=objective,
                       time_limit=opts.time_limit, infeasible=refused, steps=steps)
