"""Per-layer prices of tensor-parallel groups: the cost table whose "devices" are groups.

Terms:
    group: the devices (indices into the cluster) that run one stage together, each with a
        ``1/t`` shard of the stage's ``column``/``row``/``sharded`` nodes
        (:mod:`.shard_costs`); ``t = len(group)``.
    group table: a :class:`CostTable` with one row per group, read by the planner exactly as
        a chain of devices: the link between two groups is the cluster's link from the last
        device of one to the first of the next; a group's capacity is its smallest member's.
    layer time at degree t: ``Σ_nodes roofline(shard of the node)`` on the member's spec (the
        slowest member's, on a mixed group) ``+ Σ_collectives collective_cost(kind, bytes per
        token · c, group)``. The collectives are added, not overlapped: the threads executor
        runs a stage's collectives between its own compute actions, and nothing else of that
        stage runs meanwhile (the next chunk's compute waits for them).
    thread group: a group of CPU devices whose calibration measured the threads executor's
        meetings (:mod:`.thread_groups`): its collectives are priced by that measurement
        (hand-off + the last member's serial sum or gather; an all-gather of an output the
        workers write in place costs the hand-off alone), not by a link, and a layer with a
        collective adds the barrier wait ``κ · compute``.
    memory per device: the layer's weights less ``(1 - 1/t)`` of its cut weights; its K/V
        ``/ t`` when the K/V written into its buffers is cut by heads (else whole: K/V heads
        replicated); activations, positional tables and workspaces whole (conservative).

A block cut at its waist (``LayerCost.parts``) is priced whole here: stages of a group end
at block boundaries. A degree of 1 is the plain cost table, so a plan without tensor
parallelism is priced as it always was.

Example:
    >>> table = group_cost_table(front.chunk, ctx.layers, "8xh100-sxm", 4096,
    ...                          groups=((0, 1, 2, 3), (4, 5, 6, 7)))  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import sympy
import torch
from torch import fx

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.compiled_times import vectorise
from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.layer_pricer import LayerExpr
from tppc.cost_models.mesh_costs import (
    SELF_ATTENTION,
    MeshExchanges,
    ceil_share,
    layer_traffic,
    mesh_kv_bytes,
    mesh_node_cost,
    mesh_words,
    ring_blocks,
    token_workers,
)
from tppc.cost_models.node_shapes import P, Shapes, TokenSubstitution, find_seq_symbol
from tppc.cost_models.roofline import node_time_terms
from tppc.cost_models.shard_costs import (
    LayerShards,
    effective_roles,
    layer_shards,
    shard_node_cost,
)
from tppc.cost_models.specs import DeviceSpec
from tppc.cost_models.table import CostTable, LayerCost, LinkCost, TimeFn
from tppc.cost_models.thread_groups import (
    ThreadGroupSpec,
    thread_collective_seconds,
    thread_group_of,
)
from tppc.errors import CostModelError
from tppc.ir.records import LayerInfo, ShardRole
from tppc.passes.meshcut.ring_form import graph_reason
from tppc.program.mesh import Mesh

__all__ = ["CollectiveTime", "GroupTime", "group_cost_table", "layer_collectives"]


@dataclass(frozen=True, eq=False)
class CollectiveTime:
    """Seconds of a layer's collectives for a chunk of ``c`` tokens on one group.

    Attributes:
        cluster: the cluster.
        group: the device indices.
        collectives: ``(kind, bytes per chunk token)`` of each collective.
        in_place: per collective, whether it gathers an output the workers write in place.
        threads: the group's thread-group spec (a CPU thread group), else None: each
            collective is priced by :func:`.collective_costs.collective_cost`.
    """

    cluster: Cluster
    group: tuple[int, ...]
    collectives: tuple[tuple[str, int], ...]
    in_place: tuple[bool, ...] = ()
    threads: ThreadGroupSpec | None = None
    _seen: dict[float, float] = field(default_factory=dict, repr=False)

    def seconds(self, c: float) -> float:
        """Seconds at ``c`` tokens (memoised: the planner asks for few distinct sizes)."""
        if c not in self._seen:
            self._seen[c] = sum(self._one(kind, float(per * c), j)
                                for j, (kind, per) in enumerate(self.collectives))
        return self._seen[c]

    def _one(self, kind: str, nbytes: float, j: int) -> float:
        if self.threads is not None:
            in_place = j < len(self.in_place) and self.in_place[j]
            return thread_collective_seconds(self.threads, kind, nbytes, len(self.group),
                                             in_place)
        return collective_cost(self.cluster, kind, nbytes,  # type: ignore[arg-type]
                               self.group).seconds

    def __call__(self, c: np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=float)
        values, inverse = np.unique(c, return_inverse=True)
        return np.array([self.seconds(float(v)) for v in values])[inverse].reshape(c.shape)


@dataclass(frozen=True, eq=False)
class GroupTime:
    """``time(c, p)`` of one layer on one group: the slowest member's shard + collectives
    (on a thread group, + the barrier wait ``κ · compute``); on a mesh, + its exchanges, the
    ring's passes hidden behind the self-attention (``attention``: its compute) where they
    fit (:mod:`.mesh_costs`)."""

    compute: tuple[TimeFn, ...]
    collectives: CollectiveTime | None
    exchanges: MeshExchanges | None = None
    attention: TimeFn | None = None

    def __call__(self, c: np.ndarray, p: np.ndarray) -> np.ndarray:
        out = self.compute[0](c, p)
        for fn in self.compute[1:]:
            out = np.maximum(out, fn(c, p))
        if self.collectives is not None and self.collectives.collectives:
            threads = self.collectives.threads
            if threads is not None:
                out = out * (1.0 + threads.imbalance)
            out = out + self.collectives(np.broadcast_to(np.asarray(c, dtype=float), out.shape))
        if self.exchanges is not None:
            serial, passes = self.exchanges(np.broadcast_to(np.asarray(c, dtype=float),
                                                            out.shape))
            hidden = self.attention(c, p) if self.attention is not None else 0.0
            out = out + serial + np.maximum(passes - hidden, 0.0)
        return out


class _GroupPricer:
    """Shard times per (layer, degree, device), memoised across identical blocks."""

    def __init__(self, gm: fx.GraphModule, layers: Sequence[LayerInfo], seq_len: int,
                 roles: Mapping[str, ShardRole], kwargs: dict) -> None:
        self.gm, self.layers, self.seq_len, self.kwargs = gm, layers, seq_len, kwargs
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.roles = roles
        self.fuse: bool | None = kwargs.get("fuse_elementwise")
        self.ring_overlap: bool = kwargs.pop("ring_overlap", False)
        self.ring_gather: bool = kwargs.pop("ring_gather", False)
        sym = kwargs.get("seq_symbol") or find_seq_symbol(gm)
        self.shapes = Shapes(TokenSubstitution.build(sym, kwargs.get("token_count")),
                             kwargs.get("default_attention", "causal"))
        self._exprs: dict[DeviceSpec, list[LayerExpr]] = {}
        self._shards: dict[str, LayerShards] = {}
        self._times: dict[tuple, TimeFn] = {}

    def ring_form(self, name: str) -> bool:
        """Whether a ring runs node ``name`` (a self-attention) in the ring form (never in
        the programs of stale patches: ``ring_gather``)."""
        node = self.nodes.get(name)
        return not self.ring_gather and node is not None and node.op == "call_function" \
            and node.target == torch.ops.tppc.chunk_attention.default \
            and not graph_reason(node)

    def exprs(self, device: DeviceSpec) -> list[LayerExpr]:
        if device not in self._exprs:
            self._exprs[device] = layer_expressions(self.gm, self.layers, device, self.seq_len,
                                                    **self.kwargs)
        return self._exprs[device]

    def shards(self, expr: LayerExpr) -> LayerShards:
        name = expr.info.name
        if name not in self._shards:
            self._shards[name] = layer_shards(self.nodes, [c.name for c in expr.nodes],
                                              self.roles, self.shapes, self.seq_len)
        return self._shards[name]

    def time(self, expr: LayerExpr, device: DeviceSpec, t: int, mesh: Mesh | None = None,
             attention_only: bool = False) -> TimeFn:
        """One worker's compute: its shard at degree ``t``, cut by ``mesh``'s token axes
        (``attention_only``: its self-attention nodes alone)."""
        shards = self.shards(expr)
        key = (id(expr.fn), shards.roles, device, t, mesh, attention_only)
        if key not in self._times:
            fuse = device.name.startswith("tpu") if self.fuse is None else self.fuse
            costs = [shard_node_cost(cost, role, t, a, b) for cost, role, a, b in zip(
                expr.nodes, shards.roles, shards.in_bytes, shards.out_bytes, strict=True)]
            blocks = [(cost, 1) for cost in costs]
            if mesh is not None:  # the ring form: one kernel per K/V block, and the merges
                blocks = [pair for cost in costs for pair in (
                    ring_blocks(mesh_node_cost(cost, mesh), mesh) if self.ring_form(cost.name)
                    else [(mesh_node_cost(cost, mesh), 1)])]
            if attention_only:
                blocks = [(cost, k) for cost, k in blocks if cost.op == SELF_ATTENTION]
            total = sympy.Add(*[k * node_time_terms(cost, device, fuse_elementwise=fuse).total()
                                for cost, k in blocks])
            self._times[key] = vectorise(total, self.seq_len)
        return self._times[key]


def layer_collectives(shards: LayerShards) -> str:
    """``"2 all_reduce of 16384 B/token"``: a layer's collectives in words ("" if none)."""
    counts: dict[tuple[str, int], int] = {}
    for kind, per in shards.collectives:
        counts[(kind, per)] = counts.get((kind, per), 0) + 1
    return ", ".join(f"{n} {kind} of {per} B/token" for (kind, per), n in counts.items())


def group_cost_table(gm: fx.GraphModule, layers: Sequence[LayerInfo], cluster: Cluster | str,
                     seq_len: int, groups: Sequence[Sequence[int]], *,
                     roles: Mapping[str, ShardRole] | None = None, queue_depth: int = 2,
                     mesh: Mesh | None = None, **kwargs) -> tuple[CostTable, tuple[str, ...]]:
    """The group table (module docstring) and each layer's collectives in words.

    Args:
        gm: the chunk-step graph (its nodes' ``SHARD`` roles, or ``roles``).
        layers: ``ctx.layers``.
        cluster: the cluster.
        seq_len: the full sequence length L.
        groups: device indices of each group, in chain order.
        roles: effective roles by node name (default: :func:`.shard_costs.effective_roles`).
        queue_depth: as :func:`.layer_costs.build_cost_table`'s.
        mesh: every group's mesh (its ``tp`` is ``len(group) / (cfg · ring · ulysses)``;
            the group's devices in worker order): workers priced by :mod:`.mesh_costs`.
            None: each group is one tensor-parallel group (as before).
        **kwargs: ``seq_symbol``, ``token_count``, ``default_attention``, ``compute_dtype``,
            ``fuse_elementwise`` (as :func:`.layer_costs.build_cost_table`'s);
            ``ring_overlap``: price Ring attention as xDiT runs it (one kernel per K/V block,
            the passes hidden behind them) instead of as tppc's workers run it (the chunk's
            K/V gathered, then one kernel): :mod:`.mesh_costs`; ``ring_gather``: every
            self-attention in the gather form (the programs of stale PipeFusion patches
            emit it: each worker's K/V buffer holds the whole key length), its time, its
            exchanges and its K/V memory.

    Raises:
        CostModelError: an empty or repeated group member.
    """
    cluster = Cluster.parse(cluster)
    groups = tuple(tuple(g) for g in groups)
    flat = [d for g in groups for d in g]
    if not groups or not all(groups) or len(set(flat)) != len(flat):
        raise CostModelError(f"groups {groups} must be non-empty and name each device once")
    pricer = _GroupPricer(gm, layers, seq_len,
                          effective_roles(gm) if roles is None else roles, kwargs)
    rows: list[tuple[LayerCost, ...]] = []
    words: tuple[str, ...] = ()
    for group in groups:
        gmesh = _group_mesh(group, mesh)
        specs = list(dict.fromkeys(cluster.devices[d] for d in group))
        per_spec = [pricer.exprs(spec) for spec in specs]
        row = tuple(_row_layer(pricer, cluster, group, gmesh, per_spec, specs, i)
                    for i in range(len(per_spec[0])))
        rows.append(row)
        if not words:
            words = tuple(_words(pricer, e, gmesh) for e in per_spec[0])
    links = tuple(LinkCost(latency=(lk := cluster.link(a[-1], b[0])).latency,
                           bandwidth=lk.bandwidth) for a, b in itertools.pairwise(groups))
    first = pricer.exprs(cluster.devices[groups[0][0]])
    causal = any(c.kind == "attention" and (c.bytes.has(P) or c.matrix_flops.has(P))
                 for e in first for c in e.nodes)
    return CostTable(
        device_names=tuple(cluster.devices[g[0]].name for g in groups),
        capacities=tuple(min(int(cluster.devices[d].memory.capacity) for d in g)
                         for g in groups),
        layers=tuple(rows), links=links, seq_len=seq_len, causal=causal,
        unpriced_ops=tuple(sorted({op for e in first for op in e.unpriced})),
        queue_depth=queue_depth), words


def _group_mesh(group: tuple[int, ...], mesh: Mesh | None) -> Mesh | None:
    """The group's mesh (``tp`` from its size), None for a plain tensor-parallel group."""
    if mesh is None:
        return None
    n = token_workers(mesh)
    if len(group) % n:
        raise CostModelError(f"group {group} of {len(group)} devices cannot hold "
                             f"cfg x ring x ulysses = {n} workers; give groups of a multiple "
                             f"of {n}")
    return Mesh(cfg=mesh.cfg, ring=mesh.ring, ulysses=mesh.ulysses, tp=len(group) // n)


def _words(pricer: _GroupPricer, expr: LayerExpr, mesh: Mesh | None) -> str:
    shards = pricer.shards(expr)
    if mesh is None:
        return layer_collectives(shards)
    return mesh_words(layer_traffic(expr.nodes, shards, expr.act_bytes_per_token,
                                    pricer.seq_len, pricer.ring_form), mesh)


def _row_layer(pricer: _GroupPricer, cluster: Cluster, group: tuple[int, ...],
               mesh: Mesh | None, per_spec: list[list[LayerExpr]], specs: list[DeviceSpec],
               i: int) -> LayerCost:
    """Layer ``i`` on ``group``: its time and one worker's memory (module docstrings)."""
    expr = per_spec[0][i]
    shards = pricer.shards(expr)
    t = len(group) if mesh is None else mesh.tp
    kv = expr.kv_bytes_per_token
    kv = kv // t if shards.kv_sharded else kv
    weights = expr.weight_bytes - shards.sharded_weight_bytes \
        + math.ceil(shards.sharded_weight_bytes / t)
    if mesh is None:
        moves = CollectiveTime(cluster, group, shards.collectives, shards.in_place,
                               thread_group_of([cluster.devices[d] for d in group])
                               if cluster.nodes[group[0]] == cluster.nodes[group[-1]] else None
                               ) if t > 1 else None
        fns = tuple(pricer.time(exprs[i], spec, t) for exprs, spec in zip(per_spec, specs))
        return LayerCost(
            name=expr.info.name, time=GroupTime(fns, moves), weight_bytes=weights,
            kv_bytes_per_token=kv, act_bytes_per_token=expr.act_bytes_per_token,
            peak_bytes_per_token=expr.peak_bytes_per_token,
            positional_bytes_per_token=expr.positional_bytes_per_token,
            workspace_bytes_per_key=expr.workspace_bytes_per_key)
    last = i == len(per_spec[0]) - 1
    traffic = layer_traffic(expr.nodes, shards, expr.act_bytes_per_token, pricer.seq_len,
                            pricer.ring_form)
    exchanges = MeshExchanges(cluster, group, mesh, traffic, last=last,
                              overlap=pricer.ring_overlap,
                              seq_len=pricer.seq_len) if len(group) > 1 else None
    fns = tuple(pricer.time(exprs[i], spec, t, mesh) for exprs, spec in zip(per_spec, specs))
    attention = pricer.time(expr, specs[0], t, mesh, attention_only=True) \
        if mesh.ring > 1 and traffic.self_attention and pricer.ring_overlap else None
    n = token_workers(mesh)
    return LayerCost(
        name=expr.info.name, time=GroupTime(fns, None, exchanges, attention),
        weight_bytes=weights, kv_bytes_per_token=mesh_kv_bytes(kv, traffic, mesh),
        act_bytes_per_token=ceil_share(expr.act_bytes_per_token, (n,)),
        peak_bytes_per_token=ceil_share(expr.peak_bytes_per_token, (n,)),
        positional_bytes_per_token=expr.positional_bytes_per_token,
        workspace_bytes_per_key=expr.workspace_bytes_per_key)
