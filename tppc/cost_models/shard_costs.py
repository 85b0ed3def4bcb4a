"""The work of one node on one worker of a tensor-parallel group of ``t``, and what it sends.

Terms:
    role: the node's :class:`tppc.ir.records.ShardRole` (``node.meta[SHARD]``, written by
        the sharding pass on the annotated graph, copied onto the chunk-step graph).
    effective role: the role, or for a node without one (the chunk-step emitter's own
        nodes: K/V buffer writes, ``chunk_attention``) ``sharded`` when one of its inputs
        carries a cut value (``sharded``/``column``), else ``replicated``; a graph with
        no role at all is replicated throughout.
    shard of a node: what one of the ``t`` workers does (see :func:`shard_node_cost`):
        ``column`` (weight rows cut): its matmuls have ``n / t`` output columns, it reads
        the whole input and ``1/t`` of the weight, writes ``1/t`` of the output;
        ``row`` (weight columns cut): ``k / t`` reduction, ``1/t`` of input and weight, the
        whole (partial-sum) output; ``sharded``: ``1/t`` of everything (attention by heads,
        elementwise work on cut values, experts), the batch (heads) of its matmuls cut when
        ``t`` divides it, else their columns; ``gather``: its own work is cut (a linear's by
        columns: the LM head cut by vocabulary), then its value is gathered whole;
        ``replicated``: the whole node.
    collective: after a ``row`` node an all-reduce of its output, at a ``gather`` node an
        all-gather of its output (bytes per chunk token × c; priced by
        :func:`.collective_costs.collective_cost` on the group's devices).
    in place: an all-gather of a bias-free linear that is a model output (the LM head): on
        the last stage each worker writes its slice straight into the call's output, so a
        thread group's meeting copies nothing
        (:func:`tppc.passes.stages.direct_output.write_piece_in_place`).

The matmul dims are cut, not the time: the roofline then prices the smaller GEMM at its own
tile, wave and skinny-row efficiency (a GEMM of ``n / t`` columns may fill fewer waves).

Example:
    >>> shard_node_cost(cost, ShardRole("column", axis=2), 4, in_bytes, out_bytes)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sympy
from torch import fx

from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.node_shapes import C, L, P, Shapes, tensor_vals, value_bytes
from tppc.ir.records import SHARD, ShardRole
from tppc.passes.stages.direct_output import in_place_linear

__all__ = ["CUT_KINDS", "LayerShards", "effective_roles", "layer_shards", "shard_node_cost"]

CUT_KINDS = ("sharded", "column", "row")
"""Roles whose work is cut ``t`` ways."""

_CUT_VALUES = ("sharded", "column")  # roles whose output value is cut
_REPLICATED = ShardRole("replicated")
_SHARDED = ShardRole("sharded")


def effective_roles(gm: fx.GraphModule) -> dict[str, ShardRole]:
    """Every node's effective role (the module docstring), by node name."""
    roles: dict[str, ShardRole] = {}
    annotated = any(isinstance(n.meta.get(SHARD), ShardRole) for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        role = node.meta.get(SHARD)
        if isinstance(role, ShardRole):
            roles[node.name] = role
        elif annotated and any(roles.get(a.name, _REPLICATED).kind in _CUT_VALUES
                               for a in node.all_input_nodes):
            roles[node.name] = _SHARDED
        else:
            roles[node.name] = _REPLICATED
    return roles


def _cut(x: sympy.Expr, t: int) -> sympy.Expr:
    return x / t


def _cut_matmul(dims: tuple, kind: str, t: int) -> tuple:
    b, m, n, k = dims
    if kind == "column":
        return (b, m, _cut(n, t), k)
    if kind == "row":
        return (b, m, n, _cut(k, t))
    if b.is_Integer and int(b) % t == 0:  # heads (or experts) in the batch
        return (b / t, m, n, k)
    return (b, m, _cut(n, t), k)


def _work_kind(role: ShardRole, matmul: bool) -> str:
    """How a node's own work is cut: a ``gather`` node computes its cut part first."""
    if role.kind == "gather":
        return "column" if matmul else "sharded"
    return role.kind


def shard_node_cost(cost: NodeCost, role: ShardRole, t: int, in_bytes: sympy.Expr,
                    out_bytes: sympy.Expr) -> NodeCost:
    """One worker's share of ``cost`` under ``role`` at degree ``t`` (module docstring).

    ``in_bytes``/``out_bytes``: bytes of the node's first input and of its output (what a
    ``column`` node reads whole and a ``row`` node writes whole). A sharded attention whose
    K/V heads stay whole (fewer K/V heads than ``t``) is priced as reading ``1/t`` of them
    (its memory is not: :attr:`LayerShards.kv_sharded`).
    """
    kind = _work_kind(role, bool(cost.matmuls))
    if t == 1 or kind not in CUT_KINDS:
        return cost
    share = sympy.Rational(1, t)
    nbytes = cost.bytes * share
    if kind == "column":
        nbytes += in_bytes * (1 - share)
    elif kind == "row":
        nbytes += out_bytes * (1 - share)
    return dataclasses.replace(
        cost,
        matrix_flops=cost.matrix_flops * share,
        matmuls=tuple(_cut_matmul(tuple(map(sympy.sympify, mm)), kind, t)
                      for mm in cost.matmuls),
        vector_flops=cost.vector_flops * share,
        bytes=nbytes,
        serial_bytes=cost.serial_bytes * share)


@dataclass(frozen=True)
class LayerShards:
    """What tensor parallelism changes in one layer, at any degree.

    Attributes:
        roles: the effective role of each of the layer's nodes, in the layer's order.
        in_bytes: bytes of each node's first input (sympy in c, p).
        out_bytes: bytes of each node's output (sympy in c, p).
        collectives: ``(kind, bytes per chunk token)`` of each collective, in graph order.
        sharded_weight_bytes: weight bytes cut ``t`` ways (weights of ``column``/``row``/
            ``sharded``/``gather`` nodes; a ``row`` bias stays whole).
        kv_sharded: True when the K/V written into the layer's buffers is cut (by heads).
        in_place: per collective, whether it gathers a model output written in place.
    """

    roles: tuple[ShardRole, ...]
    in_bytes: tuple[sympy.Expr, ...]
    out_bytes: tuple[sympy.Expr, ...]
    collectives: tuple[tuple[str, int], ...]
    sharded_weight_bytes: int
    kv_sharded: bool
    in_place: tuple[bool, ...] = ()


def _per_token(expr: sympy.Expr, seq_len: int) -> int:
    at = {P: 0, L: seq_len}
    return int(sympy.ceiling(expr.subs({C: 1, **at}) - expr.subs({C: 0, **at})))


def _weight_bytes(node: fx.Node, role: ShardRole, shapes: Shapes) -> dict[str, int]:
    """The weights (token-independent tensor inputs) ``node`` cuts, by name."""
    out: dict[str, int] = {}
    inputs = [a for a in node.args if isinstance(a, fx.Node)]
    for index, arg in enumerate(inputs):
        if index == 0 or (role.kind == "row" and index >= 2):
            continue  # the activation; a row bias is added whole after the sum
        if not tensor_vals(arg.meta.get("val")) or arg.op not in ("get_attr", "placeholder"):
            continue
        size = value_bytes(shapes, [arg])
        if not size.free_symbols:
            out[arg.name] = int(size)
    return out


def layer_shards(nodes: Mapping[str, fx.Node], names: Iterable[str],
                 roles: Mapping[str, ShardRole], shapes: Shapes, seq_len: int) -> LayerShards:
    """The :class:`LayerShards` of the layer made of the nodes ``names``."""
    names = list(names)
    layer_roles, ins, outs, collectives, in_place = [], [], [], [], []
    weights: dict[str, int] = {}
    kv_writes: list[bool] = []
    for name in names:
        node = nodes[name]
        role = roles.get(name, _REPLICATED)
        layer_roles.append(role)
        first = next((a for a in node.args if isinstance(a, fx.Node)), None)
        ins.append(value_bytes(shapes, [first]) if first is not None else sympy.Integer(0))
        outs.append(value_bytes(shapes, [node]))
        if role.kind == "row" or role.collective == "all_reduce":
            collectives.append(("all_reduce", _per_token(outs[-1], seq_len)))
            in_place.append(False)
        elif role.kind == "gather" or role.collective == "all_gather":
            collectives.append(("all_gather", _per_token(outs[-1], seq_len)))
            in_place.append(in_place_linear(node) and all(u.op == "output" for u in node.users))
        if role.kind in (*CUT_KINDS, "gather"):
            weights.update(_weight_bytes(node, role, shapes))
        if _writes_buffer(node):
            source = node.args[1] if len(node.args) > 1 else None
            kv_writes.append(isinstance(source, fx.Node) and roles.get(
                source.name, _REPLICATED).kind in _CUT_VALUES)
    return LayerShards(roles=tuple(layer_roles), in_bytes=tuple(ins), out_bytes=tuple(outs),
                       collectives=tuple(collectives),
                       sharded_weight_bytes=sum(weights.values()),
                       kv_sharded=bool(kv_writes) and all(kv_writes), in_place=tuple(in_place))


def _writes_buffer(node: fx.Node) -> bool:
    """A K/V buffer write: ``copy_(narrow(buffer, ...), kv)``."""
    if node.op != "call_function" or "copy_" not in str(node.target):
        return False
    dest = node.args[0] if node.args else None
    return isinstance(dest, fx.Node) and "narrow" in str(dest.target)
