"""Read a hand-written attention region off the captured graph (what it computes).

Terms:
    score matrix: a value whose last two axes both grow with the sequence (queries × keys).
    eager region: ``q @ kᵀ`` → scale → soft-cap → masks and biases → sinks → ``softmax`` over
        the keys → casts, dropout at p = 0, the slice dropping the sinks → ``@ v`` (see
        :mod:`tppc.passes.annotation.eager_attention`, which rewrites it).

:func:`read_eager_region` walks from a softmax back to ``q @ kᵀ`` and forward to ``@ v`` and
returns an :class:`EagerRegion`, or raises an ``AnnotationError`` naming the op that does not
fit, its module and the model's source line.

Example:
    >>> region = read_eager_region(softmax_node, ctx.seq_symbol)         # doctest: +SKIP
    >>> region.scale, region.softcap, region.sinks
    (0.25, 50.0, None)
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.passes.shapes import module_path, op_name, size_expr, source_line, tensor_val

__all__ = ["EagerRegion", "read_eager_region", "visible_keys"]

_aten = torch.ops.aten
_SOFTMAX = (_aten.softmax.int, _aten._softmax.default, _aten._safe_softmax.default)
_CASTS = {_aten.to.dtype, _aten.to.dtype_layout, _aten._to_copy.default, _aten.clone.default,
          _aten.contiguous.default, _aten.alias.default, _aten.detach.default}
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default}
_MATMULS = {_aten.matmul.default, _aten.bmm.default}
_VERY_NEGATIVE = -1e30
"""A fill value at or below this hides a key (transformers fills with the dtype's minimum)."""
_FLOORS = {_aten.max.other, _aten.maximum.default, _aten.clamp_min.default, _aten.clamp.default}
"""Ops that clamp the logits from below (XGLM: ``torch.max(scores, finfo.min)``)."""


@dataclass
class EagerRegion:
    """What one eager region computes, read off the graph.

    Attributes:
        softmax: the softmax node; nodes: every node of the region (erased by the rewrite).
        scale, softcap: the scores' factor and tanh cap; terms: ``(kind, node, factor,
            site)`` of the additive terms (``"add"``, or ``"hide"`` for a ``masked_fill``'s
            mask, ``"show"`` for a ``where``'s condition), ``site`` the op that applies it (its
            output is the layout it is added in).
        sinks: the per-head sink logits, ``(..., heads, 1, 1)``.
        query, key, value: q, k (or ``("transpose", kᵀ)`` where none can be stripped), v.
        scores: ``q @ kᵀ``; output: ``@ v``.
    """

    softmax: fx.Node
    nodes: set[fx.Node] = field(default_factory=set)
    scale: float = 1.0
    softcap: float | None = None
    terms: list[tuple[str, fx.Node, Any, fx.Node]] = field(default_factory=list)
    sinks: fx.Node | None = None
    query: fx.Node | None = None
    key: fx.Node | None = None
    value: fx.Node | None = None
    scores: fx.Node | None = None
    output: fx.Node | None = None


def read_eager_region(softmax: fx.Node, sym: sympy.Symbol) -> EagerRegion | None:
    """The region of ``softmax`` when it is a softmax over the keys of a score matrix with a
    ``q @ kᵀ`` among its near ancestors, else None.

    Raises:
        AnnotationError: such a softmax whose region has another form (names the op).
    """
    if softmax.op != "call_function" or softmax.target not in _SOFTMAX \
            or not _over_keys(softmax, sym) or not _after_scores(softmax.args[0]):
        return None
    region = EagerRegion(softmax)
    _logits(region, softmax.args[0])
    _probabilities(region, softmax)
    _check_closed(region)
    return region


def _over_keys(softmax: fx.Node, sym: sympy.Symbol) -> bool:
    """A softmax along the last axis of a score matrix."""
    val = tensor_val(softmax.args[0])
    if val is None or val.dim() < 2:
        return False
    dim = softmax.args[1] if len(softmax.args) > 1 else softmax.kwargs.get("dim", -1)
    if dim % val.dim() != val.dim() - 1:
        return False
    return all(sym in size_expr(s).free_symbols for s in val.shape[-2:])


def _after_scores(node: fx.Node, depth: int = 16) -> bool:
    """Whether a ``q @ kᵀ``-like product (a matmul whose last two axes both grow with the
    sequence) is among the near ancestors of ``node``: a softmax of a position table alone
    is no attention (and stays a ``positional`` value)."""
    seen, todo = set(), [(node, 0)]
    while todo:
        cur, d = todo.pop()
        if cur in seen or d > depth:
            continue
        seen.add(cur)
        if _is_scores(cur):
            return True
        todo.extend((a, d + 1) for a in cur.all_input_nodes)
    return False


def _is_scores(node: fx.Node) -> bool:
    if node.op != "call_function" or not (
            node.target in _MATMULS or node.target is _aten.baddbmm.default):
        return False
    val = tensor_val(node)
    return val is not None and val.dim() >= 2 and all(
        size_expr(s).free_symbols for s in val.shape[-2:])


# -- the logits, walked back from the softmax -------------------------------------------------
_ORDER = ("shift", "sinks", "mask", "softcap", "scale")


def _logits(region: EagerRegion, node: fx.Node) -> None:
    """Read scale, soft-cap, additive terms and sinks from the softmax's input back to
    ``q @ kᵀ``; each step may only come before (in the graph) the ones already read."""
    stage, later = 0, node
    while True:
        target = node.target if node.op == "call_function" else None
        step, nxt = _logit_step(region, node, target)
        if step == "matmul":
            return
        if step in _ORDER:
            at = _ORDER.index(step)
            if at < stage:
                raise _refuse(later, f"{op_name(later)} ({_ORDER[stage]}) follows "
                              f"{op_name(node)} ({step}), out of the recognised order")
            if at > stage:
                stage, later = at, node
        region.nodes.add(node)
        node = nxt


def _logit_step(region: EagerRegion, node: fx.Node, target: Any) -> tuple[str, fx.Node | None]:
    """One op of the logits: its kind and the node on the score path before it."""
    args = node.args
    if target in _CASTS or (target in _VIEWS and _regroups_batch(args[0], node)):
        return "cast", args[0]
    if target in _MATMULS or target is _aten.baddbmm.default:
        _qk(region, node)
        return "matmul", None
    if target in (_aten.mul.Tensor, _aten.div.Tensor) and _number(args[1]) is not None:
        if isinstance(args[0], fx.Node) and args[0].target is _aten.tanh.default:
            return "softcap", _softcap(region, node)
        factor = _number(args[1])
        region.scale *= factor if target is _aten.mul.Tensor else 1.0 / factor
        return "scale", args[0]
    if target is _aten.add.Tensor and all(isinstance(a, fx.Node) for a in args[:2]):
        score, term = (args[0], args[1]) if _on_score_path(args[0]) else (args[1], args[0])
        if not _on_score_path(score) or _on_score_path(term):
            raise _refuse(node, "an add whose operands are both scores, or neither")
        alpha = node.kwargs.get("alpha", 1)
        region.terms.append(("add", term, alpha, node))
        return "mask", score
    if target is _aten.masked_fill.Scalar and _number(args[2]) is not None \
            and _number(args[2]) <= _VERY_NEGATIVE:
        region.terms.append(("hide", args[1], _number(args[2]), node))
        return "mask", args[0]
    if target is _aten.sub.Tensor and _is_max_of(args[1], args[0]):
        region.nodes.update((args[1], args[1].args[0]))
        return "shift", args[0]
    if target in _FLOORS and (score := _floored(node)) is not None:  # max(s, finfo.min)
        return "mask", score
    if target is _aten.where.self and _on_score_path(args[1]) and \
            (_constant(args[2]) or 0.0) <= _VERY_NEGATIVE:  # GPT-Neo: where(shown, s, min)
        region.terms.append(("show", args[0], 1, node))
        return "mask", args[1]
    if target is _aten.cat.default and _cat_dim(node) == -1 and len(args[0]) == 2:
        region.sinks = _sinks(node, args[0][1])
        return "sinks", args[0][0]
    raise _refuse(node, f"op {op_name(node)} between q·kᵀ and the softmax is none of scale, "
                  "tanh soft-capping, an additive mask or bias, sinks, a cast")


def _qk(region: EagerRegion, node: fx.Node) -> None:
    """``q @ kᵀ`` (or ``baddbmm(bias, q, kᵀ)``): the query, the key and the scores' layout."""
    if node.target is _aten.baddbmm.default:
        bias, query, key_t = node.args[:3]
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if beta != 0:  # beta = 0 ignores the input (diffusers adds an empty tensor so)
            region.terms.append(("add", bias, beta, node))
        region.scale *= float(alpha)
    else:
        query, key_t = node.args[:2]
    region.nodes.add(node)
    region.query, region.scores = query, node
    region.key = _untransposed(key_t, region)


def _untransposed(key_t: fx.Node, region: EagerRegion) -> fx.Node | tuple[str, fx.Node]:
    """``k`` from ``kᵀ`` (a transpose of the last two axes), else a transpose to insert."""
    rank = tensor_val(key_t).dim()
    if key_t.target is _aten.transpose.int and len(key_t.users) == 1 and \
            {key_t.args[1] % rank, key_t.args[2] % rank} == {rank - 2, rank - 1}:
        region.nodes.add(key_t)
        return key_t.args[0]
    return ("transpose", key_t)


def _softcap(region: EagerRegion, node: fx.Node) -> fx.Node:
    """``cap · tanh(s / cap)`` (or ``tanh(s · (1/cap)) · cap``): the cap; returns ``s``."""
    tanh = node.args[0]
    inner = tanh.args[0]
    outer = _number(node.args[1])
    if node.target is not _aten.mul.Tensor or not isinstance(inner, fx.Node) \
            or inner.target not in (_aten.div.Tensor, _aten.mul.Tensor) \
            or _number(inner.args[1]) is None:
        raise _refuse(node, "a tanh on the scores that is not cap · tanh(scores / cap)")
    cap = _number(inner.args[1]) if inner.target is _aten.div.Tensor \
        else 1.0 / _number(inner.args[1])
    if not math.isclose(cap, outer, rel_tol=1e-6):
        raise _refuse(node, f"tanh soft-capping divides by {cap} but multiplies by {outer}")
    region.softcap = outer
    region.nodes.update((tanh, inner))
    return inner.args[0]


def _sinks(cat: fx.Node, sink: fx.Node) -> fx.Node:
    """The per-head logit a ``cat`` appends to every row, before its ``expand`` to the rows."""
    while sink.op == "call_function" and sink.target is _aten.expand.default:
        sink = sink.args[0]
    val = tensor_val(sink)
    if val is None or val.dim() < 2 or any(size_expr(s).free_symbols for s in val.shape) \
            or int(val.shape[-1]) != 1 or int(val.shape[-2]) != 1:
        raise _refuse(cat, "a cat along the keys of something other than one logit per head "
                      "(attention sinks)")
    return sink


# -- the probabilities, walked forward to ``@ v`` ----------------------------------------------
def _probabilities(region: EagerRegion, softmax: fx.Node) -> None:
    node = softmax
    sinks_dropped = region.sinks is None
    while True:
        region.nodes.add(node)
        users = [u for u in node.users if u.target is not _aten._assert_tensor_metadata.default]
        if len(users) != 1:
            raise _refuse(node, f"the attention probabilities are read by {len(users)} ops "
                          f"({[u.name for u in users]}): returned (output_attentions=True?) "
                          "or reused; only the attention's output may leave it")
        node = users[0]
        target = node.target
        if target in _CASTS or (target in _VIEWS and _regroups_batch(node.args[0], node)):
            continue
        if target is _aten.dropout.default and (node.args[1] == 0 or not node.args[2]):
            continue
        if target is _aten.dropout.default:
            raise _refuse(node, f"dropout with p={node.args[1]} in training mode. fix: put "
                          "the model in eval mode")
        if target is _aten.slice.Tensor and not sinks_dropped and _drops_last(node):
            sinks_dropped = True
            continue
        if target in _MATMULS and node.args[0] in region.nodes and sinks_dropped:
            region.value, region.output = node.args[1], node
            region.nodes.add(node)
            return
        raise _refuse(node, f"op {op_name(node)} between the softmax and @ v is none of a cast, "
                      "dropout at p = 0, the slice dropping the sinks")


def _check_closed(region: EagerRegion) -> None:
    """Only the region reads its own intermediate values (else they would be lost)."""
    for node in region.nodes - {region.output}:
        for user in node.users:
            if user not in region.nodes and \
                    user.target is not _aten._assert_tensor_metadata.default:
                raise _refuse(node, f"its value is also read by {user.name} ({op_name(user)}) "
                              "outside the attention")


def visible_keys(term: fx.Node) -> fx.Node | None:
    """``cond`` of ``where(cond, 0, very negative)``: a mask that only hides keys."""
    if term.op != "call_function" or term.target not in (
            _aten.where.ScalarOther, _aten.where.Scalar, _aten.where.self):
        return None
    cond, shown, hidden = term.args[:3]
    if _number(hidden) is None or _number(hidden) > _VERY_NEGATIVE:
        return None
    if isinstance(shown, fx.Node):
        if shown.target not in (_aten.zeros.default, _aten.zeros_like.default) \
                or tensor_val(shown).dim() != 0:
            return None
    elif _number(shown) != 0:
        return None
    return cond


# -- helpers -------------------------------------------------------------------------------------
def _on_score_path(node: fx.Node, depth: int = 0) -> bool:
    """Whether ``node`` leads back to ``q @ kᵀ`` through ops of the logits (not a mask)."""
    if depth > 32 or node.op != "call_function":
        return False
    if _is_scores(node):
        return True
    if node.target in _CASTS | _VIEWS | _FLOORS | {
            _aten.mul.Tensor, _aten.div.Tensor, _aten.tanh.default, _aten.add.Tensor,
            _aten.masked_fill.Scalar, _aten.where.self}:
        return any(_on_score_path(a, depth + 1) for a in node.args[:2] if isinstance(a, fx.Node))
    return False


def _regroups_batch(src: Any, node: fx.Node) -> bool:
    """A view that keeps the last two axes and regroups only the ones before them."""
    a, b = tensor_val(src), tensor_val(node)
    return a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2 and all(
        sympy.simplify(size_expr(x) - size_expr(y)) == 0
        for x, y in zip(a.shape[-2:], b.shape[-2:]))


def _is_max_of(node: Any, source: fx.Node) -> bool:
    """``x.max(-1, keepdim=True).values`` (or ``amax``) of ``source``: softmax's own shift."""
    if not isinstance(node, fx.Node):
        return False
    if node.target is operator.getitem and node.args[1] == 0:
        node = node.args[0]
    return node.target in (_aten.max.dim, _aten.amax.default) and node.args[0] is source


def _cat_dim(node: fx.Node) -> int:
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return dim - tensor_val(node).dim() if dim >= 0 else dim


def _floored(node: fx.Node) -> fx.Node | None:
    """The scores of ``max(scores, c)`` / ``clamp(scores, min=c)`` with ``c`` at or below
    :data:`_VERY_NEGATIVE`, else None. Such a floor only turns hidden keys' ``-inf`` into
    the dtype's minimum, which the softmax weighs 0 as well (a row with a visible key) or
    spreads evenly, as a float mask of that minimum does (a row with none)."""
    args = node.args
    if node.target in (_aten.clamp_min.default, _aten.clamp.default):
        high = args[2] if len(args) > 2 else node.kwargs.get("max")
        low = args[1] if len(args) > 1 else node.kwargs.get("min")
        pairs = [(args[0], low)] if high is None else []
    else:
        pairs = [(args[0], args[1]), (args[1], args[0])]
    for score, floor in pairs:
        value = _constant(floor)
        if isinstance(score, fx.Node) and _on_score_path(score) and value is not None \
                and value <= _VERY_NEGATIVE:
            return score
    return None


def _constant(node: Any) -> float | None:
    """The value of a 0-d constant (a number, ``full([], c)``, ``scalar_tensor(c)``, a
    lifted ``torch.tensor(c)``, through copies and casts), else None."""
    if not isinstance(node, fx.Node):
        return _number(node)
    if node.target in _CASTS | {_aten.lift_fresh_copy.default}:
        return _constant(node.args[0])
    if node.target in (_aten.full.default, _aten.scalar_tensor.default) and \
            (node.target is _aten.scalar_tensor.default or list(node.args[0]) == []):
        return _number(node.args[1] if node.target is _aten.full.default else node.args[0])
    if node.op == "get_attr":
        value: Any = node.graph.owning_module
        for part in str(node.target).split("."):
            value = getattr(value, part, None)
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device.type != "meta":
            return float(value)
    return None


def _drops_last(node: fx.Node) -> bool:
    """``x[..., :-1]``: a slice of the last axis without its last entry."""
    rank = tensor_val(node).dim()
    dim, start, end = (list(node.args[1:4]) + [None] * 3)[:3]
    return dim % rank == rank - 1 and start in (0, None) and end == -1


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else None


def _refuse(node: fx.Node, why: str) -> AnnotationError:
    return AnnotationError(
        f"hand-written attention at node {node.name!r} (op {op_name(node)}, module "
        f"{module_path(node) or '<top level>'}, {source_line(node)}): {why}. tppc recognises "
        "q·kᵀ → scale → tanh soft-cap → additive masks and biases → sinks → softmax → @ v. "
        "fix: write the attention in that form or call F.scaled_dot_product_attention")
