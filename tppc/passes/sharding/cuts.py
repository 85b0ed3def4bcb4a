"""How a value cut over a tensor-parallel group flows through one op (the sharding rules).

Terms:
    cut: a value every worker of the group holds a part of (:class:`Cut`): along ``axis``,
        whose ``segments`` (sizes) are each cut into ``t`` equal parts; worker ``r`` holds
        part ``r`` of every segment, in segment order. A column-parallel linear's output is
        cut on its last axis; the heads axis of attention is cut after the view that splits
        the features into heads.
    origin: what made a value cut: a column-parallel linear, or a K/V buffer placeholder
        that takes the cut of what is written into it. A rule that cannot take a cut value
        raises :class:`Conflict` naming the origins (the analysis then leaves them whole).
    refine: a split of a cut axis whose pieces are unions of segments is exact; one whose
        pieces cut a segment asks the origin for finer segments (:class:`Refine`) and the
        analysis starts again.
    part: a replicated operand with the full size on the cut axis (an ALiBi bias, a mask
        over heads, a bias parameter) is narrowed to the worker's part before the op.

Every rule gets the node and its inputs' cuts (None: replicated) and returns the output's
cut (a list for multi-output ops such as ``split``), or raises.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

import tppc.ir.ops  # noqa: F401  (registers torch.ops.tppc)
from tppc.ir.records import CHUNK_INPUT
from tppc.passes.shapes import tensor_val
from tppc.passes.sharding.reshapes import reshape_groups

__all__ = ["ELEMENTWISE", "Conflict", "Cut", "Refine", "flow", "sizes_of"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Cut:
    """A value cut over the group (see the module docstring)."""

    axis: int
    segments: tuple[int, ...]
    origins: frozenset[str]
    unit: int = 1
    """Elements of the origin's cut axis per element of this one (a head: its head dim;
    0: a fraction of one, after a merge with inner axes)."""

    def moved(self, axis: int, segments: tuple[int, ...] | None = None, unit: int = 1
              ) -> Cut:
        """The same cut on another axis (with other segments: ``unit`` times coarser)."""
        return Cut(axis, self.segments if segments is None else segments, self.origins,
                   self.unit * unit)


class Conflict(Exception):
    """An op cannot take a cut value: leave ``origins`` whole (``reason`` says why)."""

    def __init__(self, origins: frozenset[str], reason: str) -> None:
        super().__init__(reason)
        self.origins, self.reason = origins, reason


class Refine(Exception):
    """Origin ``origin`` must cut its axis into ``segments`` (then start again)."""

    def __init__(self, origin: str, segments: tuple[int, ...]) -> None:
        super().__init__(origin)
        self.origin, self.segments = origin, segments


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


def sizes_of(node: Any) -> tuple[Any, ...] | None:
    """The node's shape (ints, or sympy expressions for symbolic sizes), or None."""
    val = tensor_val(node)
    if val is not None and hasattr(val, "shape"):
        return tuple(int(s) if not isinstance(s, torch.SymInt) else s.node.expr
                     for s in val.shape)
    if not isinstance(node, fx.Node):
        return None
    spec = node.meta.get(CHUNK_INPUT)
    if spec is not None and spec.kind in ("key", "value"):  # a K/V buffer: rows unknown
        return tuple(sympy.Symbol("rows") if s is None else int(s) for s in spec.shape)
    if node.op != "call_function" or not node.args:
        return None
    if node.target in _SIZED and isinstance(node.args[1], (list, tuple)):
        return _sized(node.args[0], node.args[1])
    if node.target == aten.unsqueeze.default:
        shape = sizes_of(node.args[0])
        if shape is None:
            return None
        at = _axis(node.args[1], len(shape) + 1)
        return (*shape[:at], 1, *shape[at:])
    if node.target in _SAME_RANK:
        shape = sizes_of(node.args[0])  # a view of a buffer: its rows on the token axis
        if shape is not None and node.target in (aten.narrow.default, aten.slice.Tensor):
            axis = _axis(node.args[1], len(shape))
            shape = (*shape[:axis], sympy.Symbol("rows"), *shape[axis + 1:])
        return shape
    return None


_SIZED = {aten.expand.default, aten.view.default, aten.reshape.default,
          aten._unsafe_view.default}
_SAME_RANK = {aten.narrow.default, aten.slice.Tensor, aten.clone.default, aten.alias.default,
              aten.detach.default, aten.contiguous.default}


def _sized(src: Any, size: Any) -> tuple[Any, ...]:
    """The shape a size list names (a node in it: a symbol; ``-1``: what is left)."""
    out = [sympy.Symbol(a.name) if isinstance(a, fx.Node) else a for a in size]
    if -1 in out:
        total = math.prod(sizes_of(src) or (sympy.Symbol("n"),))
        known = math.prod(x for x in out if not (isinstance(x, int) and x == -1))
        out[out.index(-1)] = sympy.simplify(total / known)
    return tuple(out)


def _ndim(node: Any) -> int:
    shape = sizes_of(node)
    return 0 if shape is None else len(shape)


def _axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


def _origins(cuts: list[Cut | None]) -> frozenset[str]:
    return frozenset().union(*(c.origins for c in cuts if c is not None))


def _conflict(node: fx.Node, cuts: list[Cut | None], why: str) -> Conflict:
    return Conflict(_origins(cuts), f"{node.name} ({node.target}): {why}")


def _elementwise(node: fx.Node, cuts: dict[fx.Node, Any], parts: list) -> Cut | None:
    """Broadcast the inputs (right-aligned): every cut input on the same output axis with the
    same segments; a replicated input of size 1 there broadcasts, one of the full size is
    narrowed to the part (``parts``)."""
    out = _ndim(node)
    found: Cut | None = None
    tensors = [a for a in node.all_input_nodes if sizes_of(a) is not None]
    for arg in tensors:
        cut = cuts.get(arg)
        if cut is None:
            continue
        at = cut.axis + out - _ndim(arg)
        if found is not None and (found.axis, found.segments) != (at, cut.segments):
            raise _conflict(node, [found, cut], "operands cut differently")
        found = cut.moved(at) if found is None else Cut(at, cut.segments,
                                                        found.origins | cut.origins, cut.unit)
    if found is None:
        raise _conflict(node, [cuts.get(a) for a in node.all_input_nodes], "a cut operand of unknown shape")
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
    big = (1,) * (out - _ndim(whole)) + tuple(sizes_of(whole))
    for arg in node.all_input_nodes:
        cut = cuts.get(arg)
        if cut is None:
            continue
        small = (1,) * (out - _ndim(arg)) + tuple(sizes_of(arg))
        for axis, (a, b) in enumerate(zip(small, big, strict=True)):
            if a == 1 and b != 1:
                raise _conflict(node, [cut], f"a cut value broadcast over axis {axis} of "
                                f"whole {whole.name} (a modulation: narrowing {whole.name} "
                                "would spread the cut into the activations)")


def _view(node: fx.Node, cut: Cut) -> Cut:
    """A reshape: the cut axis maps to one output axis, splits (its outer factor is cut; a
    fused ``(3, heads, hd)`` split cuts the heads) or merges (the cut axis outermost)."""
    src, dst = sizes_of(node.args[0]), sizes_of(node)
    for ins, outs in reshape_groups(src, dst):
        if cut.axis not in ins:
            continue
        if ins == [cut.axis]:
            k, segs = len(cut.segments), cut.segments
            if len(outs) > 1 and k > 1 and dst[outs[0]] == k and len(set(segs)) == 1:
                rest = math.prod(dst[o] for o in outs[2:])
                if isinstance(rest, int) and segs[0] == dst[outs[1]] * rest:
                    return cut.moved(outs[1], (dst[outs[1]],), rest)
            inner = math.prod(dst[o] for o in outs[1:])
            if isinstance(inner, int) and all(s % inner == 0 for s in segs):
                return cut.moved(outs[0], tuple(s // inner for s in segs), inner)
        elif ins[0] == cut.axis and len(outs) == 1:
            inner = math.prod(src[i] for i in ins[1:])
            if isinstance(inner, int):  # unit 0: finer than the origin's (no refining)
                return Cut(outs[0], tuple(s * inner for s in cut.segments), cut.origins,
                           cut.unit // inner if cut.unit % inner == 0 else 0)
        raise _conflict(node, [cut], f"a reshape {src} -> {dst} moves the cut axis "
                        f"{cut.axis} where its parts are not contiguous")
    raise _conflict(node, [cut], f"a reshape {src} -> {dst} loses the cut axis")


def _split(node: fx.Node, cut: Cut, axis: int, pieces: list[int]) -> list[Cut | None]:
    """A split on the cut axis: each piece a union of whole segments, else refine."""
    if axis != cut.axis:
        return [cut] * len(pieces)
    bounds = [0]
    for p in pieces:
        bounds.append(bounds[-1] + p)
    seg_bounds = [0]
    for s in cut.segments:
        seg_bounds.append(seg_bounds[-1] + s)
    if not set(bounds) <= set(seg_bounds):
        if len(cut.origins) == 1 and cut.unit:
            fine = sorted(set(bounds) | set(seg_bounds))
            raise Refine(next(iter(cut.origins)),
                         tuple((b - a) * cut.unit for a, b in itertools.pairwise(fine)))
        raise _conflict(node, [cut], "a split cuts a segment of values of several origins")
    out = []
    for a, b in itertools.pairwise(bounds):
        out.append(cut.moved(axis, tuple(s for s, lo in zip(cut.segments, seg_bounds,
                                                             strict=False) if a <= lo < b)))
    return out


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
        raise _conflict(node, ins, f"no sharding rule for {target} on a value cut on axis "
                        f"{cut.axis}")
    return rule(node, cuts, cut, args, parts), parts


def _transpose(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    a, b = _axis(args[1], nd), _axis(args[2], nd)
    return cut.moved(b if cut.axis == a else a if cut.axis == b else cut.axis)


def _permute(node, cuts, cut, args, parts):
    dims = [_axis(d, _ndim(args[0])) for d in args[1]]
    return cut.moved(dims.index(cut.axis))


def _unsqueeze(node, cuts, cut, args, parts):
    d = _axis(args[1], _ndim(node))
    return cut.moved(cut.axis + (d <= cut.axis))


def _squeeze(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    dims = {_axis(d, nd) for d in dims if sizes_of(args[0])[_axis(d, nd)] == 1}
    if cut.axis in dims:
        raise _conflict(node, [cut], "squeezes the cut axis")
    return cut.moved(cut.axis - sum(d < cut.axis for d in dims))


def _slice(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dim = _axis(args[1] if len(args) > 1 else 0, nd)
    if dim != cut.axis:
        return cut
    size = sum(cut.segments)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = min(args[3], size) if len(args) > 3 and args[3] is not None else size
    start, end = (x + size if x < 0 else x for x in (start, end))
    if len(args) > 4 and args[4] != 1:
        raise _conflict(node, [cut], "a strided slice of the cut axis")
    return _split(node, cut, dim, [p for p in (start, end - start, size - end) if p])[
        1 if start else 0]


def _narrow(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dim = _axis(args[1], nd)
    if dim == cut.axis:
        raise _conflict(node, [cut], "narrows the cut axis")
    return cut


def _split_op(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dim = _axis(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), nd)
    size = sizes_of(args[0])[dim]
    if node.target == aten.split.Tensor:
        pieces = [min(args[1], size - k) for k in range(0, size, args[1])]
    elif node.target == aten.chunk.default:
        step = -(-size // args[1])
        pieces = [min(step, size - k) for k in range(0, size, step)]
    else:
        pieces = list(args[1])
    return _split(node, cut, dim, pieces)


def _getitem(node, cuts, cut, args, parts):
    got = cuts.get(args[0])
    return got[args[1]] if isinstance(got, list) else got


def _cat(node, cuts, cut, args, parts):
    """Along another axis: every piece cut alike. Along the cut axis: every piece cut there,
    the pieces' segments one after the other (a Flux single block's attention beside its MLP
    columns, read by one row-parallel projection)."""
    tensors = args[0]
    nd = _ndim(node)
    dim = _axis(args[1] if len(args) > 1 else 0, nd)
    got = [cuts.get(t) for t in tensors]
    if any(g is None for g in got):
        raise _conflict(node, got, "concatenates cut and whole values")
    if dim == cut.axis and all(g.axis == dim for g in got):
        units = {g.unit for g in got}
        return Cut(dim, tuple(s for g in got for s in g.segments), _origins(got),
                   units.pop() if len(units) == 1 else 0)
    if dim == cut.axis or any((g.axis, g.segments) != (cut.axis, cut.segments) for g in got):
        raise _conflict(node, got, "concatenates values cut on different axes or into "
                        "different segments")
    return Cut(cut.axis, cut.segments, _origins(got), cut.unit)


def _stack(node, cuts, cut, args, parts):
    """Every piece cut alike; the new axis shifts the cut one on when it comes first."""
    got = [cuts.get(t) for t in args[0]]
    if any(g is None or (g.axis, g.segments) != (cut.axis, cut.segments) for g in got):
        raise _conflict(node, got, "stacks whole values, or values cut differently")
    dim = _axis(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), _ndim(node))
    return Cut(cut.axis + (dim <= cut.axis), cut.segments, _origins(got), cut.unit)


def _unbind(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dim = _axis(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), nd)
    if dim == cut.axis:
        raise _conflict(node, [cut], "unbinds the cut axis")
    return [cut.moved(cut.axis - (dim < cut.axis))] * sizes_of(args[0])[dim]


def _unflatten(node, cuts, cut, args, parts):
    return _view(node, cut)


def _sym_size(node, cuts, cut, args, parts):
    """The size of an axis: a whole number, unless it is the cut axis (a part's size)."""
    if _axis(args[1], _ndim(args[0])) == cut.axis:
        raise _conflict(node, [cut], "reads the size of the cut axis")
    return None


def _reduce(node, cuts, cut, args, parts):
    nd = _ndim(args[0])
    dims = args[1] if len(args) > 1 else None
    dims = [dims] if isinstance(dims, int) else dims
    if dims is None or cut.axis in {_axis(d, nd) for d in dims}:
        raise _conflict(node, [cut], "reduces over the cut axis")
    keep = (args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)) or \
        node.target in (aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                        aten.log_softmax.int)
    if keep:
        return cut
    return cut.moved(cut.axis - sum(_axis(d, nd) < cut.axis for d in dims))


def _norm(node, cuts, cut, args, parts):
    shape = args[1]
    nd = _ndim(args[0])
    if cut.axis >= nd - len(shape) or any(cuts.get(a) for a in args[2:4]
                                          if isinstance(a, fx.Node)):
        raise _conflict(node, [cut], "normalises over the cut axis")
    return cut


def _attention(node, cuts, cut, args, parts):
    """Attention over cut heads: the queries cut on the heads axis; each of the keys and
    values cut there too, or whole with one head (MQA, broadcast) or with the queries' heads
    (narrowed to the part: the ``expand`` of a repeated K/V head)."""
    q, k, v = (cuts.get(a) for a in args[:3])
    nd = _ndim(args[0])
    heads = nd - 3
    off = [c for c in (k, v) if c is not None and c.axis != heads]
    if q is None or q.axis != heads or off:
        bad = off or [c for c in (q, k, v) if c is not None]
        raise _conflict(node, bad, "attention whose queries, keys or values are cut off "
                        "the heads axis, or keys and values cut without the queries")
    for arg, got in zip(args[1:3], (k, v), strict=True):
        if got is None:
            size = sizes_of(arg)[heads]
            if size == sum(q.segments):
                parts.append((arg, heads, q.segments))
            elif size != 1:
                raise _conflict(node, [q], f"whole keys or values with {size} heads beside "
                                f"{sum(q.segments)} cut query heads")
    for arg in args[3:]:
        if isinstance(arg, fx.Node) and cuts.get(arg) is None and sizes_of(arg) is not None:
            shape = sizes_of(arg)
            at = heads - (nd - len(shape))
            if at >= 0 and shape[at] != 1:
                parts.append((arg, at, q.segments))
    return Cut(heads, q.segments, _origins([q, k, v]), q.unit)


def _matmul(node, cuts, cut, args, parts):
    a, b = cuts.get(args[0]), cuts.get(args[1])
    na, nb, nd = _ndim(args[0]), _ndim(args[1]), _ndim(node)
    if a is None or b is None or na < 3 or nb < 3:
        raise _conflict(node, [a, b], "a matmul of a cut and a whole value")
    at_a, at_b = a.axis + nd - na, b.axis + nd - nb
    if at_a != at_b or at_a >= nd - 2:
        raise _conflict(node, [a, b], "a matmul contracting or mixing the cut axis")
    return Cut(at_a, a.segments, a.origins | b.origins, a.unit)


def _expand(node, cuts, cut, args, parts):
    shift = _ndim(node) - _ndim(args[0])
    return cut.moved(cut.axis + shift)


def _view_rule(node, cuts, cut, args, parts):
    return _view(node, cut)


_Rule = Callable[..., Any]
_RULES: dict[Any, _Rule] = {
    aten.transpose.int: _transpose, aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.slice.Tensor: _slice, aten.narrow.default: _narrow, aten.split.Tensor: _split_op,
    aten.split_with_sizes.default: _split_op, aten.chunk.default: _split_op,
    aten.cat.default: _cat, aten.mean.dim: _reduce, aten.sum.dim_IntList: _reduce,
    aten.amax.default: _reduce, aten._softmax.default: _reduce, aten.softmax.int: _reduce,
    aten._log_softmax.default: _reduce, aten.log_softmax.int: _reduce,
    aten.layer_norm.default: _norm, aten.rms_norm.default: _norm,
    aten.scaled_dot_product_attention.default: _attention, aten.matmul.default: _matmul,
    aten.bmm.default: _matmul, aten.expand.default: _expand, aten.view.default: _view_rule,
    aten.reshape.default: _view_rule, aten._unsafe_view.default: _view_rule,
    torch.ops.tppc.chunk_attention.default: _attention, operator.getitem: _getitem,
    torch.ops.tppc.softmax_attention.default: _attention, aten.unbind.int: _unbind,
    aten.unflatten.int: _unflatten, aten.stack.default: _stack,
    aten.flatten.using_ints: _unflatten, aten.sym_size.int: _sym_size,
}
