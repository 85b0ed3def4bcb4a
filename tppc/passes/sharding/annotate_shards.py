"""Tensor parallelism on the captured graph: which linears are cut by columns or by rows.

Terms:
    linear: ``aten.linear(x, W, b)`` or ``aten.addmm(b, x, W)`` / ``aten.mm(x, W)`` /
        ``aten.matmul(x, W)`` with ``W`` a parameter (``get_attr``) of rank 2.
    column-parallel: a linear whose input is whole and whose weight rows (output features)
        are cut: each worker computes its part of the output (its heads, its MLP columns).
    row-parallel: a linear whose input is cut on its last axis (the features the weight's
        columns read): each worker computes a partial sum; an ``all_reduce`` right after it
        makes the whole value (a bias is added once, after the sum). Megatron-LM's pairing
        (Shoeybi et al., 2019, §3): attention's QKV then its output projection, an MLP's
        up (and gate) then its down projection.
    analysis: every linear with a whole input starts as column-parallel; the cuts flow
        through the ops (:mod:`tppc.passes.sharding.cuts`); an op that cannot take a cut
        value (a norm over the features, a softmax over the experts, a gather of token ids)
        sends its origins back whole, with the reason, and the analysis runs again until no
        op objects. A cut value the graph returns is gathered (``all_gather``; the LM head
        cut by vocabulary). What stays whole is computed whole on every worker: exact,
        never refused; :data:`SHARD_NOTES` says what and why.

The analysis does not depend on the degree ``t``: ``gm.meta[SHARD_SIZES]`` lists the sizes
``t`` must divide (head counts, features), :func:`degree_problem` names the first that does
not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.context import CompileContext
from tppc.ir.op_rules import op_rule
from tppc.ir.records import CHUNK_INPUT, SHARD, SHARD_SIZES, ShardRole
from tppc.passes.sharding.cuts import Conflict, Cut, Refine, flow, sizes_of

__all__ = ["SHARD_NOTES", "Linear", "Sharding", "analyse", "annotate_shards", "degree_problem",
           "linear_of"]

aten = torch.ops.aten

SHARD_NOTES = "tppc.shard_notes"
"""``GraphModule.meta`` key: ``(node, reason)`` of every linear left whole, and why."""


@dataclass(frozen=True)
class Linear:
    """A linear op's operands (see the module docstring).

    Attributes:
        x: the input node.
        weight: the weight's ``get_attr`` node.
        bias: the bias node (or None).
        out_axis: the weight's output-feature axis (0 for ``linear``, 1 for ``mm``).
    """

    x: fx.Node
    weight: fx.Node
    bias: Any
    out_axis: int
    via: fx.Node | None = None
    """The transpose that reads the weight (``x @ W.T``), or None: the op reads it."""
    in_axis: int = -1
    """The weight's input-feature axis (-1: the other axis of a 2-D weight)."""

    def __post_init__(self) -> None:
        if self.in_axis == -1:
            object.__setattr__(self, "in_axis", 1 - self.out_axis)


def linear_of(node: fx.Node) -> Linear | None:
    """The node's :class:`Linear`, or None when it is not one."""
    if node.op != "call_function":
        return None
    args = node.args
    if node.target == aten.linear.default:
        x, w, b = args[0], args[1], args[2] if len(args) > 2 else None
        out = 0
    elif node.target == aten.addmm.default and len(args) == 3 and not node.kwargs:
        b, x, w = args
        out = 1
    elif node.target in (aten.mm.default, aten.matmul.default):
        x, w, b = args[0], args[1], None
        out = 1
    elif op_rule(node.target).price == "grouped_matmul" and len(args) >= 2:
        return _grouped(node)
    else:
        return None
    via = None
    if isinstance(w, fx.Node) and w.op == "call_function" and len(w.users) == 1 and (
            w.target == aten.t.default or (w.target == aten.permute.default
            and list(w.args[1]) == [1, 0])):
        via, w, out = w, w.args[0], 1 - out  # x @ W.T
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and len(sizes_of(w) or ()) == 2):
        return None
    if isinstance(b, fx.Node) and b.op != "get_attr":
        return None
    return Linear(x, w, b, out, via)


def _grouped(node: fx.Node) -> Linear | None:
    """A grouped expert matmul ``x (rows, in) @ W[e] (in, out)`` with ``W`` an ``(experts,
    in, out)`` parameter, or its ``transpose(-2, -1)`` of ``(experts, out, in)``: each expert
    is cut like a linear (tensor-parallel experts)."""
    x, w = node.args[0], node.args[1]
    via, out, inn = None, 2, 1
    if isinstance(w, fx.Node) and w.op == "call_function" and len(w.users) == 1 and \
            w.target == aten.transpose.int and {a % 3 for a in w.args[1:3]} == {1, 2}:
        via, w, out, inn = w, w.args[0], 1, 2
    if not (isinstance(w, fx.Node) and w.op == "get_attr" and len(sizes_of(w) or ()) == 3):
        return None
    return Linear(x, w, None, out, via, inn)


@dataclass
class Sharding:
    """The analysis of one graph (see the module docstring).

    Attributes:
        cuts: every cut value (node -> :class:`Cut`, or a list for multi-output ops).
        roles: every node's :class:`ShardRole`.
        parts: replicated operands to narrow to the worker's part,
            ``{node: [(arg, axis, segments)]}``.
        gathered: cut values the graph returns (gathered whole before the output).
        sizes: the sizes a degree must divide, with the node that needs it.
        notes: ``(origin, reason)`` of every linear left whole.
    """

    cuts: dict[fx.Node, Any] = field(default_factory=dict)
    roles: dict[fx.Node, ShardRole] = field(default_factory=dict)
    parts: dict[fx.Node, list] = field(default_factory=dict)
    gathered: list[fx.Node] = field(default_factory=list)
    sizes: dict[int, str] = field(default_factory=dict)
    notes: list[tuple[str, str]] = field(default_factory=list)


def analyse(gm: fx.GraphModule, limit: int = 10_000) -> Sharding:
    """The fixpoint of the cut flow (see the module docstring)."""
    whole: set[str] = set()
    refined: dict[str, tuple[int, tuple[int, ...]]] = {}
    notes: list[tuple[str, str]] = []
    asked: dict[str, set[tuple[int, ...]]] = {}
    for _ in range(limit):
        try:
            result = _propagate(gm, whole, refined)
        except Conflict as c:
            if not c.origins or c.origins <= whole:
                raise AssertionError(f"a conflict without new origins: {c.reason}") from None
            notes.extend((o, c.reason) for o in sorted(c.origins - whole))
            whole |= c.origins
            continue
        except Refine as r:
            axis, _ = refined.get(r.origin, (-1, ()))
            seen = asked.setdefault(r.origin, set())
            if r.segments in seen:  # asked again (a cycle, Flux2's fused projection): whole
                notes.append((r.origin, f"its cut into {r.segments} does not settle"))
                whole.add(r.origin)
            seen.add(r.segments)
            refined[r.origin] = (axis, r.segments)
            continue
        cut = {n.name for n, role in result.roles.items() if role.kind in ("column", "row")}
        result.notes = [(o, why) for o, why in notes if o not in cut]  # e.g. row-parallel now
        return result
    raise AssertionError("the sharding analysis did not settle")


def _propagate(gm: fx.GraphModule, whole: set[str],
               refined: dict[str, tuple[int, tuple[int, ...]]]) -> Sharding:
    out = Sharding()
    cuts = out.cuts
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in refined and node.name not in whole:
                axis, segs = refined[node.name]
                cuts[node] = Cut(axis, segs, frozenset({node.name}))
        elif node.op == "output":
            _output(node, cuts, out)
        elif node.op == "call_function":
            _node(node, cuts, out, whole, refined)
    for node in gm.graph.nodes:
        cut = cuts.get(node)
        if isinstance(cut, Cut):
            for s in cut.segments:
                if s > 1 or len(cut.segments) > 1:
                    out.sizes.setdefault(s, node.name)
        out.roles.setdefault(node, _role(node, cut))
    return out


def _node(node: fx.Node, cuts: dict, out: Sharding, whole: set[str],
          refined: dict[str, tuple[int, tuple[int, ...]]]) -> None:
    lin = linear_of(node)
    if lin is not None and cuts.get(lin.x) is None:
        features = sizes_of(lin.weight)[lin.out_axis]
        if node.name in whole or features < 2:  # one output feature: nothing to cut
            return
        segs = refined.get(node.name, (0, (features,)))[1]
        cuts[node] = Cut(len(sizes_of(node)) - 1, segs, frozenset({node.name}))
        out.roles[node] = ShardRole("column", len(sizes_of(node)) - 1, segs)
        return
    if lin is not None:
        cut = cuts[lin.x]
        if cut.axis != len(sizes_of(lin.x)) - 1:
            raise Conflict(cut.origins, f"{node.name}: a linear over a value cut on axis "
                           f"{cut.axis}, not its features")
        out.roles[node] = ShardRole("row", None, cut.segments, "all_reduce")
        return
    if not any(cuts.get(a) is not None for a in node.all_input_nodes) or \
            node.target in _CHECKS:
        return
    if node.target == aten.copy_.default:
        _copy(node, cuts, refined)
        return
    cut, parts = flow(node, cuts)
    cuts[node] = cut
    if parts:
        for arg, _axis, _segs in parts:
            if arg.op == "placeholder" and _is_buffer(arg):
                raise Conflict(_all_origins(cut), f"{node.name} reads K/V buffer {arg.name} "
                               "whole beside a cut value")
        out.parts[node] = parts


_CHECKS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
"""Ops that check a value and return nothing: a cut value passes them as it is."""


def _copy(node: fx.Node, cuts: dict, refined: dict) -> None:
    """``copy_(view of a K/V buffer, cut value)``: the buffer takes the value's cut."""
    dst, src = node.args[0], node.args[1]
    have, want = cuts.get(dst), cuts.get(src)
    if want is None or (have is not None and (have.axis, have.segments) == (
            want.axis, want.segments)):
        if want is None and have is not None:
            raise Conflict(have.origins, f"{node.name}: a whole value written into a cut "
                           "buffer")
        return
    root = dst
    while root.op == "call_function" and root.target in (aten.narrow.default,
                                                          aten.slice.Tensor):
        root = root.args[0]
    if root.op != "placeholder" or not _is_buffer(root) or have is not None \
            or (root.name in refined and refined[root.name][1] == want.segments):
        raise Conflict(want.origins, f"{node.name}: a cut value written into {root.name}, "
                       "which is not a K/V buffer of this graph")
    refined[root.name] = (want.axis, want.segments)
    raise Refine(root.name, want.segments)


def _is_buffer(node: fx.Node) -> bool:
    spec = node.meta.get(CHUNK_INPUT)
    return spec is not None and spec.kind in ("key", "value")


def _all_origins(cut: Any) -> frozenset[str]:
    cuts = cut if isinstance(cut, list) else [cut]
    return frozenset().union(*(c.origins for c in cuts if c is not None))


def _output(node: fx.Node, cuts: dict, out: Sharding) -> None:
    for arg in node.all_input_nodes:
        cut = cuts.get(arg)
        if cut is None:
            continue
        if not isinstance(cut, Cut) or len(cut.segments) > 1:
            raise Conflict(_all_origins(cut), f"{arg.name} is returned cut into several "
                           "segments (a gather would reorder them)")
        out.gathered.append(arg)


def _role(node: fx.Node, cut: Any) -> ShardRole:
    if isinstance(cut, list):
        cut = next((c for c in cut if c is not None), None)
    if cut is None:
        return ShardRole("replicated")
    return ShardRole("sharded", cut.axis, cut.segments)


def annotate_shards(gm: fx.GraphModule, ctx: CompileContext | None = None) -> fx.GraphModule:
    """Write every node's :class:`ShardRole` (``meta[SHARD]``), the sizes a degree must
    divide (``gm.meta[SHARD_SIZES]``) and the linears left whole (``gm.meta[SHARD_NOTES]``)."""
    result = analyse(gm)
    for node, role in result.roles.items():
        if node in result.gathered:
            role = ShardRole("gather", role.axis, role.segments, "all_gather")
        node.meta[SHARD] = role
    gm.meta[SHARD_SIZES] = tuple(sorted(result.sizes))
    gm.meta[SHARD_NOTES] = tuple(result.notes)
    return gm


def degree_problem(sizes: dict[int, str] | tuple[int, ...], degree: int) -> str | None:
    """Why ``degree`` workers cannot share the graph's cut values (None: they can)."""
    if degree < 1:
        return f"tensor_parallel={degree} must be at least 1"
    for size in sizes:
        if size % degree:
            where = f" (at {sizes[size]})" if isinstance(sizes, dict) else ""
            return (f"a cut axis of size {size}{where} does not divide into "
                    f"tensor_parallel={degree} parts")
    return None


def check_degree(sizes: dict[int, str], degree: int, what: str) -> None:
    """Refuse ``degree`` on ``what`` when a cut size does not divide (SpecError)."""
    problem = degree_problem(sizes, degree)
    if problem:
        raise SpecError(f"{what}: {problem}. fix: a tensor_parallel degree that divides "
                        f"{sorted(sizes)}")
