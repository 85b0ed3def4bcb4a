"""Segments of the token axis: constant-length context (text tokens) beside the split tokens.

Joint-attention MM-DiTs concatenate the text tokens of the context stream with the image
tokens along the token axis, attend over both, and cut them apart again: before the image
tokens (Flux, CogVideoX, QwenImage: ``cat([text, image])``) or after them (SD3:
``cat([image, text])``). Such a value's token axis is ``[prefix | split tokens | suffix]``:
:class:`~tppc.ir.records.TokenInfo` records the two lengths (``prefix``, ``suffix``). The rules:

- ``cat`` along the token axis of constant-length segments (text, or a context-only value)
  and at most one value with split tokens (a segment of data-dependent length, text tokens
  gathered by ``torch.nonzero``, is ``global``): a token value whose prefix (suffix) is the
  constant segments' length before (after) it plus that value's own prefix (suffix). Two
  split segments (context between two bands of image tokens) are ``global``, unless every
  segment is a position table (QwenImage's rope rows centred on the image, ``cat([neg[-(h -
  h // 2):], pos[:h // 2]])``): a position table evaluated whole per call and sliced.
- ``slice`` / ``split`` of such a value along its token axis: a part within the prefix or
  within the suffix is a *context-only* value (``axis_size == prefix``: the text tokens after
  they have seen the image tokens, carried with the first patch of a step; its whole length
  is recorded as ``prefix``, whichever side it came from); a part that keeps every split
  token is a token value with what it keeps of the prefix and the suffix; any other cut is
  ``global``.
- ops on context-only values (and constants) stay context-only: their token axis is followed
  through transposes, permutes, views and broadcasting by the axis' size.
- row-wise ops and reshapes scale the prefix and the suffix with the token axis' extent (head
  splits keep them; merging the token axis with a following axis of size k multiplies them
  by k).
"""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import sympy
import torch
from torch import fx
from torch.utils._sympy.symbol import SymT, symbol_is_type

from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["segment_info", "split_tokens", "with_prefix"]

_aten = torch.ops.aten
_BIG = 2**62
_SPLITS = {_aten.split_with_sizes.default, _aten.split.Tensor}
_VIEWS = {"view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "flatten", "unflatten",
          "select", "expand", "alias"}
_TOKENISH = ("token", "mixing")
_TWO_SPLIT = ("a cat of two segments with split tokens along the token axis (context between "
              "two bands of image tokens, or two image streams): a chunk's rows of it are not "
              "one band")


def split_tokens(info: TokenInfo) -> bool:
    """Whether a value has split tokens: a token axis whose size depends on the sequence."""
    return info.axis is not None and info.axis_size is not None and \
        bool(info.axis_size.free_symbols)


def with_prefix(info: TokenInfo, src: TokenInfo) -> TokenInfo:
    """``info`` (of an op reading ``src``) with ``src``'s prefix scaled to its token axis."""
    if not (src.prefix or src.suffix) or info.role not in (*_TOKENISH, "positional") \
            or info.axis_size is None \
            or src.axis_size is None:
        return info
    ratio = sympy.simplify(info.axis_size / src.axis_size)
    prefix, suffix = src.prefix * ratio, src.suffix * ratio
    if ratio.is_Rational and prefix.is_integer and suffix.is_integer:
        return dataclasses.replace(info, prefix=int(prefix), suffix=int(suffix))
    return TokenInfo("global", module=info.module)


def segment_info(node: fx.Node, where: str) -> TokenInfo | None:
    """The TokenInfo of a node that builds, cuts or carries a prefix segment, else None."""
    if node.op != "call_function":
        return None
    if node.target is _aten.cat.default:
        return _cat(node, where)
    base = node.args[0] if node.args else None
    if node.target is operator.getitem and isinstance(base, fx.Node) and base.target in _SPLITS:
        return _split_piece(node, base, where)
    if node.target in _SPLITS:
        src: TokenInfo = base.meta[TOKEN]
        if (src.prefix or src.suffix) and _dim(node, 2, tensor_val(base).dim()) == src.axis:
            return dataclasses.replace(src, module=where)
        return None
    if node.target is _aten.slice.Tensor and (sliced := _slice(node, where)) is not None:
        return sliced  # along the token axis; along another, a text-only value is carried
    ins = [a for a in node.all_input_nodes if a.meta[TOKEN].role in _TOKENISH]
    if ins and all(a.meta[TOKEN].prefix_only for a in ins):
        return _carry(node, ins[0], where)
    return None


def _dim(node: fx.Node, index: int, rank: int) -> int:
    dim = node.args[index] if len(node.args) > index else node.kwargs.get("dim", 0)
    return int(dim) % rank


def _cat(node: fx.Node, where: str) -> TokenInfo | None:
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out = tensor_val(node)
    dim = _dim(node, 1, out.dim())
    infos = [t.meta[TOKEN] for t in tensors]
    if not any(i.axis == dim and (split_tokens(i) or i.prefix_only) for i in infos):
        return None
    prefix, suffix, split = 0, 0, None
    for t, info in zip(tensors, infos, strict=True):
        size = size_expr(tensor_val(t).shape[dim])
        if any(symbol_is_type(s, SymT.UNBACKED_INT) for s in size.free_symbols):
            return TokenInfo("global", module=where, why=_data_dependent(t, size))
        if size.free_symbols:
            if (info.axis != dim or split is not None) and not _positional(infos):
                return TokenInfo("global", module=where, why=_TWO_SPLIT)
            if split is not None:  # a position table of segments (QwenImage's centred rope
                return TokenInfo("positional", dim, size_expr(out.shape[dim]),  # rows)
                                 module=where)
            split, prefix, suffix = info, prefix + info.prefix, info.suffix
        elif split is not None:
            suffix += int(size)  # a constant segment after the split tokens
        else:
            prefix += int(size)
    total = size_expr(out.shape[dim])
    roles = {i.role for i in infos}
    role = "token" if roles & set(_TOKENISH) else "positional"
    if split is None:
        return TokenInfo("token", dim, total, module=where, prefix=int(total))
    return TokenInfo(role, dim, total, module=where, prefix=prefix,  # type: ignore[arg-type]
                     suffix=suffix)


def _positional(infos: list[TokenInfo]) -> bool:
    """Whether the segments of a cat are all position tables (no token value, no text):
    evaluated whole per call and sliced per chunk, so they may be cut anywhere."""
    return all(i.role in ("positional", "const") and not (i.prefix or i.suffix or i.inputs)
               for i in infos)


def _data_dependent(segment: fx.Node, size: sympy.Expr) -> str:
    """Why a segment of data-dependent length cannot sit beside the split tokens."""
    return (f"a segment {segment.name!r} of data-dependent length {size} along the token axis "
            "(a count of input values, e.g. the text tokens kept by torch.nonzero of a prompt "
            "mask): the context segments beside the split tokens must have constant lengths "
            "(a K/V buffer lays them out once per compile). fix: keep every text token and "
            "hide the padded ones with an attention mask over the keys")


def _slice(node: fx.Node, where: str) -> TokenInfo | None:
    src: TokenInfo = node.args[0].meta[TOKEN]
    rank = tensor_val(node.args[0]).dim()
    if not (src.prefix or src.suffix) or _dim(node, 1, rank) != src.axis \
            or src.axis_size is None:
        return None
    args = list(node.args) + [None] * 5
    start, end, step = args[2] or 0, args[3], args[4] or 1
    if step != 1:
        return TokenInfo("global", module=where)
    start_e = _from_end(src, start)  # x[:, :-text] counts from the end of the axis
    end_e = src.axis_size if end is None or (isinstance(end, int) and end >= _BIG) \
        else _from_end(src, end)
    return _window(src, start_e, end_e - start_e, where)


def _from_end(src: TokenInfo, index: object) -> sympy.Expr:
    """A slice index as a position: a negative int counts back from the axis' end."""
    if isinstance(index, int) and not isinstance(index, bool) and index < 0:
        return sympy.expand(src.axis_size + index)
    return _scalar(index)


def _split_piece(node: fx.Node, split: fx.Node, where: str) -> TokenInfo | None:
    src: TokenInfo = split.args[0].meta[TOKEN]
    vals = split.meta.get("val")
    if not (src.prefix or src.suffix) or not isinstance(vals, list | tuple):
        return None
    dim = _dim(split, 2, vals[0].dim())
    if dim != src.axis:
        return None
    sizes = [size_expr(v.shape[dim]) for v in vals]
    index = int(node.args[1])
    return _window(src, sympy.Add(*sizes[:index]), sizes[index], where)


def _window(src: TokenInfo, start: sympy.Expr, size: sympy.Expr, where: str) -> TokenInfo:
    """The part ``[start, start + size)`` of a value ``[prefix | split | suffix]`` along its
    token axis: context-only within the prefix or the suffix, a token value when it keeps
    every split token, else ``global``."""
    if src.axis_size is None:
        return TokenInfo("global", module=where)
    before = sympy.expand(src.axis_size - start)  # rows from the window's start to the end
    after = sympy.expand(src.axis_size - start - size)  # rows after the window
    in_prefix = not start.free_symbols and not size.free_symbols \
        and int(start) + int(size) <= src.prefix
    in_suffix = not before.free_symbols and not size.free_symbols and int(before) <= src.suffix
    if in_prefix or in_suffix:
        if src.role == "positional":
            return TokenInfo("const", module=where)  # positions of the text tokens
        return TokenInfo(src.role, src.axis, sympy.Integer(int(size)), module=where,
                         prefix=int(size))
    if not (start.free_symbols or after.free_symbols) and int(start) <= src.prefix \
            and 0 <= int(after) <= src.suffix:
        return TokenInfo(src.role, src.axis, size, module=where, prefix=src.prefix - int(start),
                         suffix=src.suffix - int(after))
    return TokenInfo("global", module=where)


def _carry(node: fx.Node, src_node: fx.Node, where: str) -> TokenInfo:
    """An op on prefix-only values: prefix-only again, or global when the axis is lost."""
    src: TokenInfo = src_node.meta[TOKEN]
    axis = _follow_axis(node, src_node, src.axis)
    if axis is None:
        return TokenInfo("global", module=where)
    size = int(size_expr(tensor_val(node).shape[axis]))
    return TokenInfo("token", axis, sympy.Integer(size), module=where, prefix=size)


def _follow_axis(node: fx.Node, src_node: fx.Node, axis: int | None) -> int | None:
    """Where the token axis of ``src_node`` (a constant size) went in ``node``'s value."""
    src_val, out = tensor_val(src_node), tensor_val(node)
    if axis is None or src_val is None or out is None:
        return None
    ins = [size_expr(s) for s in src_val.shape]
    outs = [size_expr(s) for s in out.shape]
    size, before = ins[axis], math.prod(ins[:axis])
    name = getattr(node.target, "overloadpacket", node.target)
    name = getattr(name, "__name__", str(name))
    if name == "transpose":
        pair = [int(d) % len(ins) for d in node.args[1:3]]
        j = pair[1] if axis == pair[0] else pair[0] if axis == pair[1] else axis
    elif name == "permute":
        j = [int(d) % len(ins) for d in node.args[1]].index(axis)
    else:
        j = axis + len(outs) - len(ins)
        by_product = [i for i, s in enumerate(outs)
                      if s == size and math.prod(outs[:i]) == before]
        if name in _VIEWS or not (0 <= j < len(outs) and outs[j] == size):
            j = by_product[0] if by_product else -1
    return j if 0 <= j < len(outs) and outs[j] == size else None


def _scalar(value: Any) -> sympy.Expr:
    if isinstance(value, fx.Node):
        return size_expr(value.meta.get("val"))
    return size_expr(value)
