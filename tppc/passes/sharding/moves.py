"""How a cut moves through the ops that only rearrange elements: transposes, views and
reshapes, slices and splits, joins (``cat``, ``stack``) and their inverses (``unbind``).

Each rule gets the node, every value's cut, the cut of its first cut input, its arguments and
the list of operands to narrow (``parts``), and returns the output's cut (a list for
multi-output ops) or raises :class:`~tppc.passes.sharding.cut.Conflict` /
:class:`~tppc.passes.sharding.cut.Refine` (terms: :mod:`tppc.passes.sharding.cut`).
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from tppc.passes.sharding.cut import (
    Cut,
    Refine,
    axis_at,
    conflict,
    ndim_of,
    origins_of,
    sizes_of,
)
from tppc.passes.sharding.reshapes import reshape_groups

__all__ = ["MOVES"]

aten = torch.ops.aten


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
        raise conflict(node, [cut], f"a reshape {src} -> {dst} moves the cut axis "
                        f"{cut.axis} where its parts are not contiguous")
    raise conflict(node, [cut], f"a reshape {src} -> {dst} loses the cut axis")


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
        raise conflict(node, [cut], "a split cuts a segment of values of several origins")
    out = []
    for a, b in itertools.pairwise(bounds):
        out.append(cut.moved(axis, tuple(s for s, lo in zip(cut.segments, seg_bounds,
                                                             strict=False) if a <= lo < b)))
    return out


def _transpose(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    a, b = axis_at(args[1], nd), axis_at(args[2], nd)
    return cut.moved(b if cut.axis == a else a if cut.axis == b else cut.axis)


def _permute(node, cuts, cut, args, parts):
    dims = [axis_at(d, ndim_of(args[0])) for d in args[1]]
    return cut.moved(dims.index(cut.axis))


def _unsqueeze(node, cuts, cut, args, parts):
    d = axis_at(args[1], ndim_of(node))
    return cut.moved(cut.axis + (d <= cut.axis))


def _squeeze(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dims = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
    dims = {axis_at(d, nd) for d in dims if sizes_of(args[0])[axis_at(d, nd)] == 1}
    if cut.axis in dims:
        raise conflict(node, [cut], "squeezes the cut axis")
    return cut.moved(cut.axis - sum(d < cut.axis for d in dims))


def _slice(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dim = axis_at(args[1] if len(args) > 1 else 0, nd)
    if dim != cut.axis:
        return cut
    size = sum(cut.segments)
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    end = min(args[3], size) if len(args) > 3 and args[3] is not None else size
    start, end = (x + size if x < 0 else x for x in (start, end))
    if len(args) > 4 and args[4] != 1:
        raise conflict(node, [cut], "a strided slice of the cut axis")
    return _split(node, cut, dim, [p for p in (start, end - start, size - end) if p])[
        1 if start else 0]


def _narrow(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dim = axis_at(args[1], nd)
    if dim == cut.axis:
        raise conflict(node, [cut], "narrows the cut axis")
    return cut


def _split_op(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dim = axis_at(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), nd)
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
    nd = ndim_of(node)
    dim = axis_at(args[1] if len(args) > 1 else 0, nd)
    got = [cuts.get(t) for t in tensors]
    if any(g is None for g in got):
        raise conflict(node, got, "concatenates cut and whole values")
    if dim == cut.axis and all(g.axis == dim for g in got):
        units = {g.unit for g in got}
        return Cut(dim, tuple(s for g in got for s in g.segments), origins_of(got),
                   units.pop() if len(units) == 1 else 0)
    if dim == cut.axis or any((g.axis, g.segments) != (cut.axis, cut.segments) for g in got):
        raise conflict(node, got, "concatenates values cut on different axes or into "
                        "different segments")
    return Cut(cut.axis, cut.segments, origins_of(got), cut.unit)


def _stack(node, cuts, cut, args, parts):
    """Every piece cut alike; the new axis shifts the cut one on when it comes first."""
    got = [cuts.get(t) for t in args[0]]
    if any(g is None or (g.axis, g.segments) != (cut.axis, cut.segments) for g in got):
        raise conflict(node, got, "stacks whole values, or values cut differently")
    dim = axis_at(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), ndim_of(node))
    return Cut(cut.axis + (dim <= cut.axis), cut.segments, origins_of(got), cut.unit)


def _unbind(node, cuts, cut, args, parts):
    nd = ndim_of(args[0])
    dim = axis_at(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), nd)
    if dim == cut.axis:
        raise conflict(node, [cut], "unbinds the cut axis")
    return [cut.moved(cut.axis - (dim < cut.axis))] * sizes_of(args[0])[dim]


def _unflatten(node, cuts, cut, args, parts):
    return _view(node, cut)


def _pad(node, cuts, cut, args, parts):
    """Padding of the last ``len(pad) / 2`` axes: the cut passes unless its axis is padded."""
    pad, nd = list(args[1]), ndim_of(args[0])
    padded = {nd - 1 - k // 2 for k, p in enumerate(pad) if p}
    if cut.axis in padded:
        raise conflict(node, [cut], "pads the cut axis")
    return cut


def _sym_size(node, cuts, cut, args, parts):
    """The size of an axis: a whole number, unless it is the cut axis (a part's size)."""
    if axis_at(args[1], ndim_of(args[0])) == cut.axis:
        raise conflict(node, [cut], "reads the size of the cut axis")
    return None


def _expand(node, cuts, cut, args, parts):
    shift = ndim_of(node) - ndim_of(args[0])
    return cut.moved(cut.axis + shift)


def _view_rule(node, cuts, cut, args, parts):
    return _view(node, cut)


MOVES: dict[Any, Callable[..., Any]] = {
    aten.transpose.int: _transpose, aten.permute.default: _permute,
    aten.unsqueeze.default: _unsqueeze, aten.squeeze.dim: _squeeze, aten.squeeze.dims: _squeeze,
    aten.slice.Tensor: _slice, aten.narrow.default: _narrow, aten.split.Tensor: _split_op,
    aten.split_with_sizes.default: _split_op, aten.chunk.default: _split_op,
    aten.cat.default: _cat, aten.stack.default: _stack, aten.unbind.int: _unbind,
    aten.expand.default: _expand, aten.view.default: _view_rule,
    aten.reshape.default: _view_rule, aten._unsafe_view.default: _view_rule,
    aten.unflatten.int: _unflatten, aten.flatten.using_ints: _unflatten,
    operator.getitem: _getitem, aten.sym_size.int: _sym_size, aten.pad.default: _pad,
    aten.constant_pad_nd.default: _pad,
}
"""The rule of every rearranging op."""
