"""A value cut over a tensor-parallel group, and what the sharding rules raise.

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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from torch import fx

from tppc.ir.records import CHUNK_INPUT
from tppc.passes.shapes import tensor_val

__all__ = ["Conflict", "Cut", "Refine", "axis_at", "conflict", "ndim_of", "origins_of",
           "sizes_of"]

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
        at = axis_at(node.args[1], len(shape) + 1)
        return (*shape[:at], 1, *shape[at:])
    if node.target in _SAME_RANK:
        shape = sizes_of(node.args[0])  # a view of a buffer: its rows on the token axis
        if shape is not None and node.target in (aten.narrow.default, aten.slice.Tensor):
            axis = axis_at(node.args[1], len(shape))
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


def ndim_of(node: Any) -> int:
    """The node's rank (0 when its shape is unknown)."""
    shape = sizes_of(node)
    return 0 if shape is None else len(shape)


def axis_at(axis: int, ndim: int) -> int:
    """``axis`` of a rank-``ndim`` value, counted from 0."""
    return axis + ndim if axis < 0 else axis


def origins_of(cuts: list[Cut | None]) -> frozenset[str]:
    """The origins of every cut in ``cuts``."""
    return frozenset().union(*(c.origins for c in cuts if c is not None))


def conflict(node: fx.Node, cuts: list[Cut | None], why: str) -> Conflict:
    """The :class:`Conflict` of ``node`` that cannot take ``cuts``, saying ``why``."""
    return Conflict(origins_of(cuts), f"{node.name} ({node.target}): {why}")
