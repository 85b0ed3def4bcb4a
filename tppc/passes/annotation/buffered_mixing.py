"""Buffered mixing: non-causal ops whose rows read every row of the sequence.

Terms:
    token contraction: ``a @ b`` where ``a``'s last axis and ``b``'s second-to-last axis are
        both the token axis (the same split tokens), or a two-operand ``einsum`` that sums
        both operands' token axes against each other (``"bhnd,bhne->bhde"``): ``phi(K)^T V`` of linear attention,
        ``out_i = phi(q_i) Σ_j phi(k_j)^T v_j / (phi(q_i) · Σ_j phi(k_j))``. Its value has
        no token axis: a state summed over the whole sequence (Sana folds the normaliser
        ``Σ_j phi(k_j)`` into the same matmul by padding ``V`` with a row of ones).
    neighbourhood convolution: a stride-1 convolution over the token axis that keeps its
        extent ("same" padding, kernel > 1): each output row reads its neighbours, the next
        chunk's rows included (Sana's depthwise 3×3 in the feed-forward).

Both are non-causal, like bidirectional attention, and annotation marks them ``mixing``
with ``attention="bidirectional"``: a model holding one is planned like a bidirectional DiT
(a plain call runs as one chunk: exact; several chunks need ``cp.denoise``).
``chunk_attention`` gives each operand a full-length buffer, as it does SDPA's K and V
(:func:`buffered_operands` names them ``key`` and ``value``): a chunk writes its rows, the op
runs over the whole buffer, and a convolution's output is cut back to the chunk's rows
(:class:`tppc.passes.chunking.chunk_buffers.BufferReads`). Under PipeFusion a linear attention's sum
is then the fresh contribution of the patches already run in this step plus the previous
step's contribution of the others (*stale sums*), and a convolution reads the next patch's
rows from the previous step (a stale halo). The state is kept as rows (``L × d`` per
operand, like a K/V buffer) and every patch re-sums them: the contraction costs ``L``, not
the patch's ``c``, per patch.

A sum over the token axis that is not a matmul (``phi(k).sum(dim=tokens)``) stays a
``global`` reduction (refused inside the blocks by ``group_layers``).
"""

from __future__ import annotations

import sympy
import torch
from torch import fx

from tppc.ir.context import CompileContext
from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.annotation.segments import split_tokens
from tppc.passes.shapes import size_expr, tensor_val

__all__ = ["buffered_operands", "conv_geometry", "neighbourhood_conv",
           "token_contraction_info"]

_aten = torch.ops.aten
_MATMULS = (_aten.matmul.default, _aten.bmm.default, _aten.mm.default)


def token_contraction_info(node: fx.Node, ctx: CompileContext, where: str
                           ) -> TokenInfo | None:
    """The ``mixing`` record of a token contraction (see the module docstring), else None;
    sets ``ctx.token_count`` as attention does."""
    operands = _operands(node)
    if operands is None:
        return None
    a, b = operands["key"], operands["value"]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    infos: list[TokenInfo] = [a.meta[TOKEN], b.meta[TOKEN]]
    if any(i.role not in ("token", "mixing") or i.axis is None or i.other_axes
           or not split_tokens(i) for i in infos):
        return None
    va, vb, out = tensor_val(a), tensor_val(b), tensor_val(node)
    if va is None or vb is None or out is None or vb.dim() < 2:
        return None
    if not _contracts_token_axes(node, infos[0].axis, infos[1].axis, va.dim(), vb.dim()):
        return None
    if infos[0].prefix != infos[1].prefix \
            or sympy.simplify(infos[0].axis_size - infos[1].axis_size) != 0:
        return None
    if any(size_expr(s).free_symbols for s in out.shape):
        return None  # the output keeps a token axis: not a reduction over the tokens
    if ctx.token_count is None:
        ctx.token_count = infos[0].axis_size - infos[0].prefix
    return TokenInfo("mixing", module=where, attention="bidirectional")


def neighbourhood_conv(node: fx.Node, src: TokenInfo) -> bool:
    """Whether a convolution over the token axis is a neighbourhood convolution."""
    spatial = (src.axis or 0) - 2
    if spatial < 0 or tensor_val(node.args[1]) is None:
        return False
    kernel, stride, padding, dilation = conv_geometry(node, spatial)
    same = (node.args[4] if len(node.args) > 4 else node.kwargs.get("padding")) == "same"
    return kernel > 1 and stride == 1 and (same or 2 * padding == dilation * (kernel - 1))


def buffered_operands(node: fx.Node) -> dict[str, fx.Node] | None:
    """The operands a buffered-mixing node reads whole, by buffer kind; None for others."""
    info = node.meta.get(TOKEN)
    if node.op != "call_function" or info is None or info.role != "mixing" \
            or info.attention == "recurrent":  # a causal convolution carries a state instead
        return None
    if node.target in (*_MATMULS, _aten.einsum.default):
        return _operands(node)
    if op_rule(node.target).role == "conv":
        return {"value": node.args[0]}
    return None


def _operands(node: fx.Node) -> dict[str, fx.Node] | None:
    """The two operands of a matmul or a two-operand einsum, named like SDPA's K and V."""
    if node.target in _MATMULS and len(node.args) >= 2:
        return {"key": node.args[0], "value": node.args[1]}
    if node.target is _aten.einsum.default and len(node.args) >= 2 \
            and isinstance(node.args[1], list | tuple) and len(node.args[1]) == 2:
        return {"key": node.args[1][0], "value": node.args[1][1]}
    return None


def _contracts_token_axes(node: fx.Node, axis_a: int, axis_b: int, rank_a: int,
                          rank_b: int) -> bool:
    """Whether the op sums over both operands' token axes, paired with each other."""
    if node.target in _MATMULS:
        return axis_a == rank_a - 1 and axis_b == rank_b - 2
    equation = str(node.args[0]).replace(" ", "")
    if "..." in equation or "->" not in equation:
        return False
    ins, out = equation.split("->")
    terms = ins.split(",")
    if len(terms) != 2 or (len(terms[0]), len(terms[1])) != (rank_a, rank_b):
        return False
    letter = terms[0][axis_a]
    return terms[1][axis_b] == letter and letter not in out


def conv_geometry(node: fx.Node, spatial: int) -> tuple[int, int, int, int]:
    """Kernel, stride, padding and dilation of a convolution along one spatial axis."""
    kernel = int(size_expr(tensor_val(node.args[1]).shape[spatial + 2]))
    values = [node.args[i] if len(node.args) > i else node.kwargs.get(key)
              for i, key in ((3, "stride"), (4, "padding"), (5, "dilation"))]
    if isinstance(values[1], str):  # "valid" or "same"
        values[1] = 0 if values[1] == "valid" else kernel - 1
    stride, padding, dilation = (_conv_param(v, spatial, 0 if i == 1 else 1)
                                 for i, v in enumerate(values))
    return kernel, stride, padding, dilation


def _conv_param(value: object, spatial: int, default: int) -> int:
    if isinstance(value, list | tuple):
        value = value[spatial] if len(value) > spatial else value[0]
    return int(value) if isinstance(value, int) else default
