"""How a value cut over a tensor-parallel group flows through one op (the sharding rules).

The terms (cut, origin, refine, part) are :mod:`tppc.passes.sharding.cut`'s; the ops that only
rearrange elements are :mod:`tppc.passes.sharding.moves`'; this module holds the ops that
compute: element-wise ops (broadcast, with the modulation rule), reductions and norms,
attention and batched matmuls, and :func:`flow`, which every pass reads.

Every rule gets the node and its inputs' cuts (None: replicated) and returns the output's
cut (a list for multi-output ops such as ``split``), or raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

import tppc.ir.ops  # noqa: F401  (registers torch.ops.tppc)
from tppc.passes.sharding.cut import (
    Conflict,
    Cut,
    Refine,
    axis_at,
    conflict,
    ndim_of,
    origins_of,
    sizes_of,
)
from tppc.passes.sharding.moves import MOVES

__all__ = ["ELEMENTWISE", "Conflict", "Cut", "Refine", "flow", "sizes_of"]

aten = torch.ops.aten


ELEMENTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.add.Scalar,
    aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.neg.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.tanh.default, aten.sigmoid.default,
    aten.exp.default, aten.pow.Tensor_Scalar, aten.to.dtype, aten._to_copy.default,
    aten.to.dtype_layout, aten.type_as.default, aten.clone.default, aten.contiguous.default,
    aten.dropout.default, aten.alias.default, aten.detach.default, aten.where.self,
    aten.maximum.default, aten.minimum.default, aten.erf.default, aten.sin.default,
    aten.cos.default, aten.abs.default, aten.softplus.default, aten.masked_fill.Scalar,
    aten.clamp.default, aten.rsqrt.default, aten.sqrt.default, aten.square.default,
    aten.log.default, aten.reciprocal.default, aten.relu_.default, aten.gelu_.default,
    aten.silu_.default, aten.mul_.Tensor, aten.add_.Tensor, aten.div_.Tensor,
    aten.sub_.Tensor, aten.tanh_.default, aten.pow.Tensor_Tensor, aten.rsub.Scalar,
    aten.hardtanh.default, aten.leaky_relu.default, aten.elu.default, aten.mish.default,
}
"""Ops that compute each element from the elements at the same index (after broadcasting)."""


def _elementwise(node: fx.Node, cuts: dict[fx.Node, Any], parts: list) -> Cut | None:
    """Broadcast the inputs (right-aligned): every cut input on the same output axis with the
    same segments; a replicated input of size 1 there broadcasts, one of the full size is
    narrowed to the part (``parts``)."""
    out = ndim_of(node)
    found: Cut | None = None
    tensors = [a for a in node.all_input_nodes if sizes_of(a) is not None]
    for arg in tensors:
        cut = cuts.get(arg)
        if cut is None:
            continue
        at = cut.axis + out - ndim_of(arg)
        if found is not None and (found.axis, found.segments) != (at, cut.segments):
            raise conflict(node, [found, cut], "operands cut differently")
        found = cut.moved(at) if found is None else Cut(at, cut.segments,
                                                        found.origins | cut.origins, cut.unit)
    if found is None:
        raise conflict(node, [cuts.get(a) for a in node.all_input_nodes], "a cut operand of unknown shape")
    for arg in tensors:
        if cuts.get(arg) is None:
            shape = sizes_of(arg)
            at = found.axis - (out - len(shape))
            if at >= 0 and shape[at] != 1:
                _no_modulation(node, arg, cuts, out)
                parts.append((arg, at, found.segments))
    return found


def _no_modulation(node: fx.Node, whole: fx.Node, cuts: dict[fx.Node, Any], out: int) -> None:
    """Refuse to narrow whole operand ``whole`` to a cut operand that broadcasts over one of
    its axes (an adaLN modulation ``norm(x) * (1 + scale) + shift``: a per-call vector cut
    beside the activations): the cut would spread into the whole activations. The smaller
    value stays whole instead (:class:`Conflict` names its origins)."""
    big = (1,) * (out - ndim_of(whole)) + tuple(sizes_of(whole))
    for arg in node.all_input_nodes:
        cut = cuts.get(arg)
        if cut is None:
            continue
        small = (1,) * (out - ndim_of(arg)) + tuple(sizes_of(arg))
        for axis, (a, b) in enumerate(zip(small, big, strict=True)):
            if a == 1 and b != 1:
                raise conflict(node, [cut], f"a cut value broadcast over axis {axis} of "
                                f"whole {whole.name} (a modulation: narrowing {whole.name} "
                                "would spread the cut into the activations)")


def flow(node: fx.Node, cuts: dict[fx.Node, Any]) -> Any:
    """The output cut of ``node`` given its inputs' (see the module docstring).

    Returns ``(cut, parts)``: the output's cut (a list for multi-output ops) and the
    replicated operands to narrow to the worker's part, ``[(arg, axis, segments)]``.
    """
    ins = [cuts.get(a) for a in node.all_input_nodes]
    cut = next(c for c in ins if c is not None)
    target, args = node.target, node.args
    parts: list = []
    rule = _RULES.get(target)
    if target in ELEMENTWISE:
        return _elementwise(node, cuts, parts), parts
    if rule is None:
        raise conflict(node, ins, f"no sharding rule for {target} on a value cut on axis "
                        f"{cut.axis}")
    return rule(node, cuts, cut, args, parts), parts


def _reduce(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dims = args[1] if len(args) > 1 else None
    dims = [dims] if isinstance(dims, int) else dims
    if dims is None or cut.axis in {axis_at(d, nd) for d in dims}:
        raise conflict(node, [cut], "reduces over the cut axis")
    keep = (args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)) or \
        node.target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                        aten.log_softmax.int)
    if keep:
        return cut
    return cut.moved(cut.axis - sum(axis_at(d, nd) < cut.axis for d in dims))


def _norm(node, cuts, cut, args, parts):
    shape = args[1]
    nd = ndim_of(args[0])
    if cut.axis >= nd - len(shape) or any(cuts.get(a) for a in args[2:4]
                                          if isinstance(a, fx.Node)):
        raise conflict(node, [cut], "normalises over the cut axis")
    return cut


def _attention(node, cuts, cut, args, parts):
    """Attention over cut heads: the queries cut on the heads axis; each of the keys and
    values cut there too, or whole with one head (MQA, broadcast) or with the queries' heads
    (narrowed to the part: the ``expand`` of a repeated K/V head)."""
    q, k, v = (cuts.get(a) for a in args[:3])
    nd = ndim_of(args[0])
    heads = nd - 3
    off = [c for c in (k, v) if c is not None and c.axis != heads]
    if q is None or q.axis != heads or off:
        bad = off or [c for c in (q, k, v) if c is not None]
        raise conflict(node, bad, "attention whose queries, keys or values are cut off "
                        "the heads axis, or keys and values cut without the queries")
    for arg, got in zip(args[1:3], (k, v), strict=True):
        if got is None:
            size = sizes_of(arg)[heads]
            if size == sum(q.segments):
                parts.append((arg, heads, q.segments))
            elif size != 1:
                raise conflict(node, [q], f"whole keys or values with {size} heads beside "
                                f"{sum(q.segments)} cut query heads")
    for arg in args[3:]:
        if isinstance(arg, fx.Node) and cuts.get(arg) is None and sizes_of(arg) is not None:
            shape = sizes_of(arg)
            at = heads - (nd - len(shape))
            if at >= 0 and shape[at] != 1:
                parts.append((arg, at, q.segments))
    return Cut(heads, q.segments, origins_of([q, k, v]), q.unit)


def _matmul(node, cuts, cut, args, parts):
    a, b = cuts.get(args[0]), cuts.get(args[1])
    na, nb, nd = ndim_of(args[0]), ndim_of(args[1]), ndim_of(node)
    if a is None or b is None or na < 3 or nb < 3:
        raise conflict(node, [a, b], "a matmul of a cut and a whole value")
    at_a, at_b = a.axis + nd - na, b.axis + nd - nb
    if at_a != at_b or at_a >= nd - 2:
        raise conflict(node, [a, b], "a matmul contracting or mixing the cut axis")
    return Cut(at_a, a.segments, a.origins | b.origins, a.unit)


_Rule = Callable[..., Any]
_RULES: dict[Any, _Rule] = {
    **MOVES, aten.mean.dim: _reduce, aten.sum.dim_IntList: _reduce,
    aten.amax.default: _reduce, aten._softmax.default: _reduce, aten.softmax.int: _reduce,
    aten._log_softmax.default: _reduce, aten.log_softmax.int: _reduce,
    aten.layer_norm.default: _norm, aten.rms_norm.default: _norm,
    aten.scaled_dot_product_attention.default: _attention, aten.matmul.default: _matmul,
    aten.bmm.default: _matmul, torch.ops.tppc.chunk_attention.default: _attention,
    torch.ops.tppc.softmax_attention.default: _attention,
}
