"""Pass: find the token axis and the role of every node (writes ``meta[TOKEN]``).

Roles (see :data:`tppc.ir.records.Role`) flow forward through the graph: a node that reads a token
value is ``token`` (row-wise), ``mixing`` (recognised attention), ``global`` (a reduction
over tokens, or a reshape that breaks their order) — or an error when it mixes along the
token axis in a way tppc cannot pipeline. Nodes without token inputs are ``positional``
when their shape or value depends on the sequence length, else ``const``. A value's token
axis is the axis whose size depends on the sequence symbol, so transposes, views and
merges of the token axis are followed by the symbolic shapes themselves.

Graphs come from torch.export and hold aten ops.

Example:
    >>> gm, ctx = tppc.capture(tppc.examples.models.GPT(), (ids,))          # doctest: +SKIP
    >>> annotate_seq_dims_pass(gm, ctx)
    >>> [n.meta[TOKEN].role for n in gm.graph.nodes][-3:]
    ['token', 'token', 'token']
"""

from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.context import CompileContext
from tppc.ir.loop_scan import is_loop_scan
from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.annotation.attention import classify_attention
from tppc.passes.annotation.block_scan import mark_block_scans
from tppc.passes.annotation.buffered_mixing import (
    conv_geometry,
    neighbourhood_conv,
    token_contraction_info,
)
from tppc.passes.annotation.recurrent import (
    causal_conv,
    causal_crop,
    causal_shift,
    check_loop_scan,
    pads_tokens,
    recurrent_scan,
)
from tppc.passes.annotation.regions import annotate_region, row_wise_region, split_region_reason
from tppc.passes.annotation.segments import segment_info, split_tokens, with_prefix
from tppc.passes.annotation.token_order import (
    binary_elementwise,
    full_slice,
    getitem_keeps_tokens,
    pinned_shape,
    resizes_tokens,
    token_runs,
)
from tppc.passes.shapes import (
    module_path,
    op_dims,
    op_name,
    seq_axes,
    size_expr,
    tensor_val,
)

__all__ = ["annotate_seq_dims_pass"]

_aten = torch.ops.aten

_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "layout"}


def annotate_seq_dims_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Annotate every node with a :class:`TokenInfo`; set ``ctx.token_count``.

    A node that mixes tokens or needs the whole sequence inside a module (an MoE dispatch
    sorting tokens by expert) is retried as part of a row-wise region (:mod:`.regions`).
    """
    sym = ctx.seq_symbol
    done: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if node in done:
            continue
        try:
            info: TokenInfo | None = _annotate(node, gm, ctx, sym)
        except AnnotationError as exc:
            info, error = None, exc
        if info is None or (info.role == "global" and node.op == "call_function"):
            region = row_wise_region(node, gm, ctx) if module_path(node) else None
            if region is not None:  # a mixture-of-experts dispatch: row-wise as a whole
                annotate_region(region, sym)
                done.update(region)
                continue
            if info is None:
                reason = split_region_reason(node, gm) if module_path(node) else ""
                if reason:
                    raise AnnotationError(f"{str(error).rstrip('.')}{reason}") from error
                raise error
        node.meta[TOKEN] = info
    if ctx.block_size is not None:  # a recurrence over blocks: carried, not global
        mark_block_scans(gm, sym, lambda n: _annotate(n, gm, ctx, sym))
    return gm


def _annotate(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext,
              sym: sympy.Symbol) -> TokenInfo:
    axes, sizes = seq_axes(node, sym)
    where = module_path(node)
    if node.op == "get_attr":
        return TokenInfo("const", module=where)
    if node.op == "placeholder":
        if (node.name in ctx.seq_inputs or node.target in ctx.seq_inputs) and axes:
            return _info("token", axes, sizes, where)
        return TokenInfo("const", module=where)
    if node.op == "output":
        roles = {_role(a) for a in node.all_input_nodes}
        return TokenInfo("global" if "global" in roles else "token", module=where)
    if _from_inputs(node, ctx):
        return _input_value(node, axes, sizes, where)
    ins = [a.meta[TOKEN] for a in node.all_input_nodes]
    roles = {i.role for i in ins}
    if "global" in roles:
        return _info("global", axes, sizes, where)
    if op_rule(node.target).role == "attention" and roles & {"token", "mixing"}:
        return _attention(node, gm, ctx, axes, sizes, where)
    if op_rule(node.target).role == "contracts" and roles & {"token", "mixing"}:
        contraction = token_contraction_info(node, ctx, where)  # linear attention
        if contraction is not None:
            return contraction
    segment = None if _shape_only(node) else segment_info(node, where)
    if segment is not None:
        return segment
    if not roles & {"token", "mixing"} or _shape_only(node):
        dependent = bool(axes) or "positional" in roles or _symbolic_scalar(node, sym)
        role = "positional" if dependent else "const"
        info = _info(role, axes, sizes, where)
        for src in (i for i in ins if i.prefix and i.role == "positional"):
            info = with_prefix(info, src)  # a position table with a text segment first
        return dataclasses.replace(info, inputs=True) if any(i.inputs for i in ins) else info
    return _token_op(node, axes, sizes, where)


def _token_op(node: fx.Node, axes: list[int], sizes: list[sympy.Expr], where: str
              ) -> TokenInfo:
    """Classify a node that reads token values: token, global, or an AnnotationError.

    A reshape may merge constant axes before the token axis into it (a batch flattened
    with the tokens by GPT-2's ``Conv1D``, a video's frames): its rows are still one per
    (batch, token), so row-wise ops on it stay ``token``.
    """
    name, role = op_name(node), op_rule(node.target).role
    src = _token_input(node)
    src_info: TokenInfo = src.meta[TOKEN]
    dims = op_dims(node, src)
    if is_loop_scan(node):  # a re-rolled loop over positions (:mod:`tppc.frontend.reroll`)
        check_loop_scan(node, axes)
        return dataclasses.replace(_info("mixing", axes, sizes, where), attention="recurrent")
    if recurrent_scan(node, src) or (role == "conv" and causal_conv(node, src)) \
            or causal_shift(node, src):
        return dataclasses.replace(_info("mixing", axes, sizes, where), attention="recurrent")
    if role == "selects" and src_info.attention == "recurrent" and causal_crop(node, src):
        return _info("token", axes, sizes, where)  # the first L rows of a causal convolution
    if role == "mixes_along_dim" and src_info.axis in dims:
        hint = " (a softmax over the keys of q·kᵀ, followed by @ v, is recognised as " \
            "attention; this one is not)." if "softmax" in name else ""
        raise _mix_error(node, name, where, f"{name} along the token axis {src_info.axis}.{hint}")
    if role == "conv":
        if neighbourhood_conv(node, src_info):  # a "same" convolution: buffered mixing
            info = _info("mixing", axes, sizes, where)
            return dataclasses.replace(with_prefix(info, src_info), attention="bidirectional")
        _check_conv(node, src_info, name, where)
    if role == "reduction" and (src_info.axis in dims or not dims) \
            and not binary_elementwise(node):
        return _info("global", axes, sizes, where)
    if role == "selects" and src_info.axis in dims and not full_slice(node, src_info):
        return _info("global", axes, sizes, where)
    if node.target is operator.getitem and not getitem_keeps_tokens(node):
        return _info("global", axes, sizes, where)
    runs = token_runs(node, src, axes) if role == "reshape" else src_info.runs
    if role == "reshape" and (pinned_shape(node) or runs is None):
        return _info("global", axes, sizes, where)
    if len(axes) > 1 and role == "contracts":
        raise _mix_error(node, name, where, f"its value has {len(axes)} token axes {axes}: a "
                         "score matrix q·kᵀ not followed by a softmax over the keys and @ v "
                         "(hand-written attention is recognised in that form). fix: write it "
                         "so, or call F.scaled_dot_product_attention")
    if role == "contracts" and not axes:
        raise _mix_error(node, name, where, "a matmul contracts over the token axis")
    if not axes and _has_tensor(node):
        return _info("global", axes, sizes, where)
    if resizes_tokens(node, src_info, sizes) or pads_tokens(node, src):
        return _info("global", axes, sizes, where)  # a pad that moves rows: no row-wise op
    info = with_prefix(_info("token", axes, sizes, where), src_info)
    return dataclasses.replace(info, runs=runs) if info.role == "token" else info


def _attention(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext, axes: list[int],
               sizes: list[sympy.Expr], where: str) -> TokenInfo:
    """Self- or joint attention over the token axis is ``mixing``.

    Cross-attention to the context stream (keys without split tokens: text states) is
    row-wise over the queries, hence ``token``; its keys and values are ``const``. So is
    attention along another axis, with the tokens on a batch axis of queries and keys alike
    (a video's temporal attention over the frames of each patch, ``(b·tokens, frames, d)``):
    each token's rows attend among themselves.
    """
    query: TokenInfo = node.args[0].meta[TOKEN]
    key: TokenInfo = node.args[1].meta[TOKEN]
    q_val = tensor_val(node.args[0])
    if query.axis is not None and q_val is not None and query.axis < q_val.dim() - 2 \
            and (key.axis, key.axis_size) == (query.axis, query.axis_size):
        return with_prefix(_info("token", axes, sizes, where), query)
    if not (key.role in ("token", "mixing") and split_tokens(key)):
        if query.prefix_only:
            return TokenInfo("token", query.axis, query.axis_size, module=where,
                             prefix=query.prefix)
        return with_prefix(_info("token", axes, sizes, where), query)
    kind, mask = classify_attention(node, gm, ctx)
    if ctx.token_count is None and sizes:
        ctx.token_count = sizes[0] - query.prefix - query.suffix
    info = with_prefix(_info("mixing", axes, sizes, where), query)
    return dataclasses.replace(info, attention=kind, mask=mask) if info.role == "mixing" \
        else info


def _input_value(node: fx.Node, axes: list[int], sizes: list[sympy.Expr], where: str
                 ) -> TokenInfo:
    """A value computed from integer inputs: ``token`` where it is row-wise (token ids
    reshaped before the embedding), else ``positional`` (a mask over query and key
    positions, with ``inputs`` set: evaluated per call, never from the length alone)."""
    if any(a.meta[TOKEN].role == "token" for a in node.all_input_nodes):
        try:
            info = _token_op(node, axes, sizes, where)
        except AnnotationError:
            info = None
        if info is not None and info.role == "token" and not info.other_axes:
            return dataclasses.replace(info, inputs=True)
    return dataclasses.replace(_info("positional", axes, sizes, where), inputs=True)


def _from_inputs(node: fx.Node, ctx: CompileContext) -> bool:
    """Whether ``node`` computes a value from integer sequence inputs (``attention_mask``)
    and positions only, reading no weight: a padding mask, ``positional`` with ``inputs``.

    Such values are rebuilt per chunk when they are attention masks (see :mod:`.masks`);
    anything else reading them is refused by ``chunk_attention``.
    """
    if node.op != "call_function" or _shape_only(node) \
            or op_rule(node.target).role == "attention":
        return False
    found = False
    for arg in node.all_input_nodes:
        info: TokenInfo = arg.meta[TOKEN]
        if arg.op == "placeholder" and info.role == "token":
            val = tensor_val(arg)
            if val is None or val.is_floating_point() or arg.name not in ctx.seq_inputs:
                return False
            found = True
        elif info.inputs and info.role in ("token", "positional"):
            found = True
        elif info.role not in ("positional", "const") or (
                arg.op == "get_attr" and tensor_val(arg) is not None
                and tensor_val(arg).is_floating_point()):
            return False
    return found


def _check_conv(node: fx.Node, src: TokenInfo, name: str, where: str) -> None:
    spatial = (src.axis or 0) - 2
    if spatial < 0:
        raise _mix_error(node, name, where, "the token axis is the batch or channel axis")
    kernel, stride, padding, dilation = conv_geometry(node, spatial)
    if not (kernel == stride and padding == 0 and (dilation == 1 or kernel == 1)):
        raise _mix_error(
            node, name, where,
            f"a convolution over the token axis (kernel {kernel}, stride {stride}, padding "
            f"{padding}) mixes neighbouring tokens; only patchify convolutions (kernel == "
            "stride, no padding) are row-wise, and only stride-1 convolutions that keep the "
            "axis' extent ('same' padding) are pipelined as buffered mixing",
        )


def _mix_error(node: fx.Node, name: str, where: str, why: str) -> AnnotationError:
    return AnnotationError(
        f"node {node.name!r} (op {name}, module {where or '<top level>'}) mixes values along "
        f"the token axis: {why} tppc can pipeline only row-wise ops and recognised attention "
        "(scaled_dot_product_attention, or softmax(q·kᵀ)·v written out) inside the blocks."
    )


def _info(role: str, axes: list[int], sizes: list[sympy.Expr], where: str) -> TokenInfo:
    if not axes:
        return TokenInfo(role, module=where)  # type: ignore[arg-type]
    return TokenInfo(role, axes[0], sizes[0], tuple(axes[1:]), module=where)  # type: ignore[arg-type]


def _role(node: fx.Node) -> str:
    info = node.meta.get(TOKEN)
    return info.role if info else "const"


def _token_input(node: fx.Node) -> fx.Node:
    """The input whose token axis the op follows: one with split tokens when there is one."""
    for arg in node.all_input_nodes:
        if arg.meta[TOKEN].role in ("token", "mixing") and split_tokens(arg.meta[TOKEN]):
            return arg
    for arg in node.all_input_nodes:
        if arg.meta[TOKEN].role in ("token", "mixing") and arg.meta[TOKEN].axis is not None:
            return arg
    return next(a for a in node.all_input_nodes if a.meta[TOKEN].role in ("token", "mixing"))


def _has_tensor(node: fx.Node) -> bool:
    return tensor_val(node) is not None


def _shape_only(node: fx.Node) -> bool:
    """Ops that read only the shape, dtype or device of their token input."""
    if node.target is getattr:
        return node.args[1] in _SHAPE_ATTRS
    return node.op == "call_function" and op_rule(node.target).role == "shape_only"


def _symbolic_scalar(node: fx.Node, sym: sympy.Symbol) -> bool:
    val = node.meta.get("val")
    items = val if isinstance(val, list | tuple) else (val,)
    return any(isinstance(v, torch.SymInt | sympy.Basic) and sym in size_expr(v).free_symbols
               for v in items)
