"""Recurrent mixing: ops whose row ``t`` depends on the rows before it through a carried state.

Terms:
    scan: a cumulative op along the token axis (``cumsum``, ``logcumsumexp``, ``cumprod``).
        Row ``t`` is the state after ``t`` folds; the state a chunk leaves is its last row.
        A linear recurrence ``h_t = a_t · h_{t−1} + b_t`` written in log space (Heinsen's
        scan: ``a* = cumsum(log a)``, ``h = exp(a* + logcumsumexp(log b − a*))``, minGRU's
        parallel form) is two scans and row-wise ops.
    causal shift: a constant pad of the token axis by ``s`` rows before and ``−s`` after
        (``ZeroPad2d((0, 0, 1, -1))``: RWKV's token shift), row ``t`` the input's row
        ``t − s``; the state a chunk leaves is its last ``s`` input rows.
    causal convolution: a stride-1 convolution over the token axis padded by
        ``dilation · (kernel − 1)`` on both sides and cropped back to its first ``L`` rows
        (``conv1d(x, padding=k − 1)[..., :L]``: Mamba's short convolution). Row ``t`` reads
        the inputs ``t − (k − 1)·d … t``; the state a chunk leaves is its last
        ``(k − 1)·d`` input rows.
    carried state: what a chunk of a recurrent node reads from the chunk before it on the
        same stage and writes for the next one: a buffer sized by the value's other axes
        (batch, heads, channels), not by the sequence length
        (:mod:`tppc.passes.chunking.carried_state`).

    re-rolled loop: a :class:`tppc.ir.loop_scan.LoopScan` node, a Python loop over positions
        re-rolled by the capture (:mod:`tppc.frontend.reroll`); its carries are its state.

Annotation marks all four ``mixing`` with ``attention="recurrent"``; the crop after a causal
convolution is ``token``. Everything else about them is row-wise: a model of such layers
is causal, chunked like a causal LLM, and each chunk costs its own rows only.
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.loop_scan import LoopScan
from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.annotation.buffered_mixing import conv_geometry
from tppc.passes.shapes import constant_pad_fill, op_dims, size_expr, tensor_val

__all__ = ["SCAN_INIT", "causal_conv", "causal_crop", "causal_shift", "check_loop_scan",
           "conv_state_rows", "pads_tokens", "recurrent_scan"]

_aten = torch.ops.aten

SCAN_INIT: dict[object, float] = {
    _aten.cumsum.default: 0.0,
    _aten.logcumsumexp.default: float("-inf"),
    _aten.cumprod.default: 1.0,
}
"""The scans tppc carries, by op, and the state before the first row (the fold's identity)."""


def recurrent_scan(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a scan along ``src``'s token axis over split tokens only."""
    info: TokenInfo = src.meta[TOKEN]
    if node.target not in SCAN_INIT or info.axis is None:
        return False
    return op_dims(node, src) == {info.axis} and _plain_tokens(info)


def causal_conv(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a causal convolution over ``src``'s token axis (see the module
    docstring): padded by ``(k − 1)·d`` and read only through crops to the first ``L`` rows."""
    info: TokenInfo = src.meta[TOKEN]
    if op_rule(node.target).role != "conv" or info.axis is None or not _plain_tokens(info):
        return False
    weight, out = tensor_val(node.args[1]), tensor_val(node)
    if weight is None or out is None or weight.dim() != 3 or info.axis != 2:
        return False  # one spatial axis: the tokens
    if node.target is not _aten.conv1d.default and _transposed(node):
        return False
    kernel, stride, padding, dilation = conv_geometry(node, 0)
    if kernel < 2 or stride != 1 or padding != dilation * (kernel - 1):
        return False
    return bool(node.users) and all(causal_crop(user, node, info.axis_size)
                                    for user in node.users)


def causal_shift(node: fx.Node, src: fx.Node) -> int:
    """The rows ``s`` a causal shift of ``src``'s token axis moves (see the module
    docstring), or 0 when ``node`` is none."""
    info: TokenInfo = src.meta[TOKEN]
    pads = _token_pads(node, src)
    if pads is None or info.axis is None or not _plain_tokens(info):
        return 0
    (before, after), others = pads
    return before if before >= 1 and after == -before and not any(others) else 0


def pads_tokens(node: fx.Node, src: fx.Node) -> bool:
    """Whether ``node`` is a pad with a non-zero pad of ``src``'s token axis."""
    pads = _token_pads(node, src)
    return pads is not None and pads[0] != (0, 0)


def _token_pads(node: fx.Node, src: fx.Node
                ) -> tuple[tuple[int, int], list[int]] | None:
    """``((before, after), other pads)`` of a constant pad along ``src``'s token axis."""
    if constant_pad_fill(node) is None or node.args[0] is not src:
        return None
    pad, val, axis = node.args[1], tensor_val(src), src.meta[TOKEN].axis
    if val is None or axis is None or not all(isinstance(p, int) for p in pad):
        return None
    at = 2 * (val.dim() - 1 - axis)  # pads run from the last axis
    if at + 1 >= len(pad):
        return (0, 0), list(pad)
    return (pad[at], pad[at + 1]), [*pad[:at], *pad[at + 2:]]


def causal_crop(node: fx.Node, conv: fx.Node, length: sympy.Expr | None = None) -> bool:
    """Whether ``node`` keeps the first ``length`` rows (the input's) of causal ``conv``."""
    if node.target is not _aten.slice.Tensor or node.args[0] is not conv:
        return False
    rank = tensor_val(conv).dim()
    dim = node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    out = tensor_val(node)
    if dim % rank != 2 or start not in (0, None) or step != 1 or out is None:
        return False
    if length is None:
        length = conv.args[0].meta[TOKEN].axis_size
    return sympy.simplify(size_expr(out.shape[2]) - length) == 0


def check_loop_scan(node: fx.Node, axes: list[int]) -> None:
    """Check that a re-rolled loop steps along the tokens only: its sliced inputs are split
    tokens sliced along their token axis, its value's token axis is the stacked one, and its
    initial carries and invariants hold no token (nor position) axis.

    Raises:
        AnnotationError: naming the loop's line and the input that breaks it.
    """
    loop: LoopScan = node.target
    inits, xs, invariants = loop.split(node.args)
    where = f"the re-rolled loop {node.name} ({loop.source})"
    for x, d in zip(xs, loop.xs_dims, strict=True):
        info: TokenInfo = x.meta[TOKEN]
        if info.role not in ("token", "mixing") or info.axis != d or not _plain_tokens(info):
            raise AnnotationError(
                f"{where} steps along axis {d} of {x.name}, whose token axis is {info.axis} "
                f"(role {info.role}); tppc carries a loop's state only along the tokens. fix: "
                "loop over the sequence positions of a token value")
    for value in (*inits, *invariants):
        if not isinstance(value, fx.Node):
            continue
        info = value.meta[TOKEN]
        if info.role != "const" and info.axis is not None:
            raise AnnotationError(
                f"{where} reads {value.name} (role {info.role}, token axis {info.axis}) whole "
                "at every step: each step sees every position, which no chunk holds. fix: "
                "read it one position per step (x[:, t])")
    if axes != [loop.out_dim]:
        raise AnnotationError(f"{where} stacks its outputs along axis {loop.out_dim}, but its "
                              f"token axes are {axes}")


def conv_state_rows(node: fx.Node) -> int:
    """Input rows a causal convolution's chunk reads before its own: ``(k − 1)·d``."""
    kernel, _, _, dilation = conv_geometry(node, 0)
    return dilation * (kernel - 1)


def _plain_tokens(info: TokenInfo) -> bool:
    """Split tokens only, one row per position: no text segment, no second token axis."""
    return not (info.prefix or info.suffix or info.other_axes)


def _transposed(node: fx.Node) -> bool:
    """A ``convolution``/``_convolution`` call with ``transposed=True``."""
    return len(node.args) > 6 and bool(node.args[6])
