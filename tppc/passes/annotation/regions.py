"""Row-wise regions: modules that regroup tokens internally but are row-wise as a whole.

Terms:
    region: the nodes of one module (``model.layers.0.mlp.experts``), contiguous in the
        graph, whose ops sort, gather and scatter along the token axis (a mixture-of-experts
        dispatch: tokens sorted by expert, one grouped matmul per expert, scattered back).
        Its token inputs and outputs have a token axis of ``k · s`` rows.
    exactness check: the region runs on its example inputs, on a random permutation of their
        tokens and on two halves; it is row-wise when every output row matches (up to
        float rounding). Routing per token makes an MoE block row-wise, so chunking it is
        exact; a construct that truly mixes tokens (a cumsum, a mean) fails the check.

No model-specific code: the region is found from the module path of the first node that
annotation cannot take, grown to enclosing modules (never one holding attention) until the
check passes.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch import fx

from tppc.ir.context import CompileContext
from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.annotation.positional import call_target, concrete_value, on_cpu
from tppc.passes.shapes import (
    ancestors,
    module_path,
    seq_axes,
    size_expr,
    source_line,
    tensor_val,
)
from tppc.passes.subgraph import copy_subgraph

__all__ = ["annotate_region", "row_wise_region", "split_region_reason"]

_RTOL, _ATOL = 1e-4, 1e-5
_TOKEN_AXIS = ("token", "mixing", "global")
"""Roles of a region input with rows per token (a block scan's output is ``global`` until
:mod:`tppc.passes.annotation.block_scan` annotates it: GraniteMoeHybrid's MoE reads one)."""


def row_wise_region(node: fx.Node, gm: fx.GraphModule, ctx: CompileContext
                    ) -> list[fx.Node] | None:
    """The nodes of the smallest module around ``node`` proved row-wise, or None."""
    path = module_path(node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    while path:
        region = [n for n in gm.graph.nodes if n.op == "call_function"
                  and _inside(module_path(n), path)]
        if any(op_rule(n.target).role == "attention" or _mixing(n) for n in region):
            return None  # a region that mixes tokens by construction (attention, a scan)
        between = list(gm.graph.nodes)[order[region[0]]: order[region[-1]] + 1] if region else []
        contiguous = all(n.op != "call_function" or n in region for n in between)
        if region and contiguous and _row_wise(region, gm, ctx):
            return region
        path = path.rpartition(".")[0]
    return None


def split_region_reason(node: fx.Node, gm: fx.GraphModule) -> str:
    """Why no region around ``node`` can be row-wise when an enclosing module runs on both
    sides of an attention (JetMoE's mixture of attention: the tokens sorted by expert in
    ``map`` before the attention, that order read again by ``reduce`` after it), else ``""``."""
    nodes = list(gm.graph.nodes)
    path = module_path(node)
    while path:
        inside = [i for i, n in enumerate(nodes) if n.op == "call_function"
                  and _inside(module_path(n), path)]
        between = nodes[inside[0]: inside[-1] + 1] if inside else []
        attention = next((n for n in between if n.op == "call_function"
                          and op_rule(n.target).role == "attention"
                          and not _inside(module_path(n), path)), None)
        if attention is not None:
            after = next(n for n in between[between.index(attention):]
                         if n.op == "call_function" and _inside(module_path(n), path))
            return (f"; the module {path!r} runs on both sides of the attention "
                    f"{attention.name!r} (before it at {source_line(node)}, after it from "
                    f"{source_line(after)}): a token order it computes before the attention is "
                    "read after it, so neither half is row-wise alone. fix: route each token "
                    "row by row, without sorting the tokens (gather each token's experts' "
                    "weights, `weight[top_k_indices]`, and contract them with its row: "
                    "`einsum('th,tkoh->tko', x, weight[top_k_indices])`), or run the model "
                    "unsplit")
        path = path.rpartition(".")[0]
    return ""


def annotate_region(region: list[fx.Node], sym: sympy.Symbol) -> None:
    """Every region node that depends on the tokens is ``token`` (run per chunk)."""
    inside = set(region)
    for n in region:
        axes, sizes = seq_axes(n, sym)
        dependent = axes or any(
            (a in inside and a.meta[TOKEN].role == "token")
            or (a not in inside and a.meta[TOKEN].role in (*_TOKEN_AXIS, "positional"))
            for a in n.all_input_nodes) or sym in _free(n)
        where = module_path(n)
        if isinstance(n.meta.get("val"), torch.SymInt):  # a size: recomputed where needed
            n.meta[TOKEN] = TokenInfo("positional" if dependent else "const", module=where)
        elif not dependent:
            n.meta[TOKEN] = TokenInfo("const", module=where)
        elif axes:
            n.meta[TOKEN] = TokenInfo("token", axes[0], sizes[0], tuple(axes[1:]), module=where)
        else:
            n.meta[TOKEN] = TokenInfo("token", module=where)


def _mixing(node: fx.Node) -> bool:
    """Whether annotation already marked ``node`` as mixing tokens (a scan or a causal
    convolution): its region is not row-wise, whatever the exactness check's example says
    (a tiny model's small outputs can pass its absolute tolerance)."""
    info = node.meta.get(TOKEN)
    return isinstance(info, TokenInfo) and info.role == "mixing"


def _inside(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + ".")


def _free(node: fx.Node) -> set[Any]:
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        return set(size_expr(val).free_symbols)
    return set()


def _row_wise(region: list[fx.Node], gm: fx.GraphModule, ctx: CompileContext) -> bool:
    inside = set(region)
    inputs = [a for n in region for a in n.all_input_nodes if a not in inside]
    inputs = list(dict.fromkeys(inputs))
    outputs = [n for n in region if any(u not in inside for u in n.users)
               and not isinstance(n.meta.get("val"), torch.SymInt)]
    sym = ctx.seq_symbol
    tokens = {a: a.meta[TOKEN] for a in inputs  # "global" too: a block scan's output is
              if a.meta.get(TOKEN) is not None  # global until block_scan annotates it
              and a.meta[TOKEN].role in _TOKEN_AXIS and a.meta[TOKEN].axis is not None}
    if not tokens or not outputs or any(_rows(tensor_val(o), o, sym) is None for o in outputs):
        return False
    try:
        values = _example_inputs(inputs, gm, ctx)
    except Exception:  # meta weights, inputs tppc cannot evaluate
        return False
    sub = copy_subgraph(gm, region, tuple(outputs), inputs=inputs,
                        rename={a: f"in_{i}" for i, a in enumerate(inputs)})
    n = ctx.example_seq
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    half = n // 2
    try:
        with torch.no_grad():
            full = sub(*values)
            permuted = sub(*_take(inputs, values, tokens, perm, sym, n))
            first = sub(*_take(inputs, values, tokens, torch.arange(half), sym, n))
            second = sub(*_take(inputs, values, tokens, torch.arange(half, n), sym, n))
    except Exception:  # a region that cannot run on other token counts
        return False
    for o, f, p, a, b in zip(outputs, full, permuted, first, second):
        axis, k = _rows(f, o, sym)  # type: ignore[misc]
        if not _close(_rows_of(f, axis, k, perm), p) or not _close(
                f, torch.cat([_group(a, axis, k), _group(b, axis, k)], dim=axis + 1)
                .flatten(axis, axis + 1)):
            return False
    return True


def _rows(val: Any, node: fx.Node, sym: sympy.Symbol) -> tuple[int, int] | None:
    """(token axis, rows per token) of a region output, or None when it has no token axis."""
    axes, sizes = seq_axes(node, sym)
    if len(axes) != 1 or val is None:
        return None
    ratio = sympy.simplify(sizes[0] / sym)
    return (axes[0], int(ratio)) if ratio.is_Integer and ratio > 0 else None


def _group(t: torch.Tensor, axis: int, k: int) -> torch.Tensor:
    return t.unflatten(axis, (k, t.shape[axis] // k))


def _rows_of(t: torch.Tensor, axis: int, k: int, index: torch.Tensor) -> torch.Tensor:
    return _group(t, axis, k).index_select(axis + 1, index).flatten(axis, axis + 1)


def _take(inputs: list[fx.Node], values: list[Any], tokens: dict[fx.Node, TokenInfo],
          index: torch.Tensor, sym: sympy.Symbol, n: int) -> list[Any]:
    out = []
    for a, v in zip(inputs, values):
        if a in tokens:
            k = int(sympy.simplify(tokens[a].axis_size / sym))
            out.append(_rows_of(v, tokens[a].axis, k, index))
        elif isinstance(a.meta.get("val"), torch.SymInt):
            out.append(int(size_expr(a.meta["val"]).subs(sym, len(index))))
        else:
            out.append(v)
    return out


def _close(a: Any, b: Any) -> bool:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return bool(torch.equal(a, b))
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=_RTOL, atol=_ATOL * max(1.0, scale)))


def _example_inputs(inputs: list[fx.Node], gm: fx.GraphModule, ctx: CompileContext
                    ) -> list[Any]:
    """The region inputs' values on the example (token ids as given, floats random)."""
    needed = ancestors(inputs)
    env: dict[fx.Node, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if n.op == "placeholder":
            value = concrete_value(n, ctx, ctx.example_seq)
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                value = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            env[n] = value
        elif n.op == "get_attr":
            env[n] = _attr(gm, str(n.target))
        else:
            env[n] = call_target(n, on_cpu(fx.node.map_arg(n.args, lambda a: env[a])),
                           on_cpu(fx.node.map_arg(n.kwargs, lambda a: env[a])))
    return [env[a] for a in inputs]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    if isinstance(value, torch.Tensor) and value.device.type == "meta":
        raise ValueError(f"{target} is on the meta device")
    return value
