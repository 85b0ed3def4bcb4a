"""Helpers of ``chunk_attention``: the K/V value behind SDPA, the positional program, the tail.

Terms as in :mod:`tppc.passes.chunking.chunk_attention`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from tppc.errors import PassError
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.annotation.attention import chunked_kernel
from tppc.passes.shapes import ancestors, size_expr, tensor_val
from tppc.passes.subgraph import copy_subgraph

__all__ = ["cache_source", "input_value_error", "inputs_read", "is_head_repeat", "leaves",
           "positional_program", "sdpa_kwargs", "tail_program"]

_aten = torch.ops.aten
REPEAT_OPS = {_aten.unsqueeze.default, _aten.expand.default, _aten.reshape.default,
              _aten.view.default, _aten._unsafe_view.default, _aten.clone.default}
"""Layout-only ops between a K/V value and SDPA that are re-applied after the buffer read."""
SIZE_ARG_OPS = {_aten.expand.default, _aten.reshape.default, _aten.view.default,
                _aten._unsafe_view.default}
"""Layout ops whose second argument is a list of sizes (one of them the token axis')."""


def leaves(output: fx.Node) -> list[Any]:
    leaves = output.args[0]
    return list(leaves) if isinstance(leaves, list | tuple) else [leaves]


def tail_program(gm: fx.GraphModule, output: fx.Node, sym: Any,
                 per_chunk: Callable[[TokenInfo], bool] | None = None
                 ) -> tuple[fx.GraphModule | None, list[fx.Node]]:
    """The ``global`` epilogue, run once on the full sequence, and the token values it reads.

    Returns ``(None, [])`` when no output needs the whole sequence. Otherwise the tail takes
    the flat user inputs, then the full-length token values (concatenated chunk outputs),
    and returns the model's flat outputs. ``per_chunk``: whether a token value is computed
    chunk by chunk (default: its token axis is the sequence symbol).
    """
    needed: set[fx.Node] = set()
    reads: set[fx.Node] = set()
    todo = [a for a in leaves(output) if isinstance(a, fx.Node)]
    while todo:
        n = todo.pop()
        if n in needed or n in reads:
            continue
        info: TokenInfo = n.meta[TOKEN]
        chunked = per_chunk(info) if per_chunk is not None else info.axis_size == sym
        if n.op != "placeholder" and info.role in ("token", "mixing") and chunked:
            reads.add(n)
            continue
        needed.add(n)
        todo.extend(n.all_input_nodes)
    if not any(n.op != "placeholder" for n in needed):
        return None, []
    inputs = [n for n in gm.graph.nodes if n in reads]
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    tail = copy_subgraph(gm, needed, tuple(leaves(output)), inputs=[*placeholders, *inputs],
                         rename={n: f"full_{n.name}" for n in inputs}, class_name="GlobalTail")
    return tail, inputs


def cache_source(arg: fx.Node, sym: Any) -> tuple[fx.Node, list[fx.Node]]:
    """The value a K/V buffer stores, and the layout ops that lead from it to SDPA."""
    chain: list[fx.Node] = []
    best: tuple[fx.Node, list[fx.Node]] = (arg, [])
    cur = arg
    while True:
        info = cur.meta.get(TOKEN)
        if info is not None and info.axis is not None and info.axis_size == sym \
                and not info.other_axes:
            best = (cur, list(reversed(chain)))
        if cur.op != "call_function" or cur.target not in REPEAT_OPS:
            break
        chain.append(cur)
        cur = cur.args[0]
    return best


def is_head_repeat(source: fx.Node, chain: list[fx.Node]) -> bool:
    """True for HF's ``repeat_kv``: (b, h, s, d) → unsqueeze(2) → expand → (b, h·n, s, d).

    SDPA's ``enable_gqa=True`` computes the same attention without materialising the
    repeated K/V of the whole prefix for every chunk.
    """
    if len(chain) != 3 or source.meta[TOKEN].axis != 2:
        return False
    unsqueeze, expand, reshape = chain
    src, out = tensor_val(source), tensor_val(reshape)
    if src is None or out is None or src.dim() != 4 or out.dim() != 4:
        return False
    return (unsqueeze.target is _aten.unsqueeze.default and unsqueeze.args[1] in (2, -3)
            and expand.target is _aten.expand.default and reshape.target in SIZE_ARG_OPS
            and reshape.target is not _aten.expand.default
            and size_expr(out.shape[1]) != size_expr(src.shape[1]))


def positional_program(gm: fx.GraphModule, frontier: list[fx.Node]) -> fx.GraphModule:
    """Flat user inputs (zero-valued at the full length) → the frontier values."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return copy_subgraph(gm, ancestors(frontier), tuple(frontier), inputs=placeholders,
                         class_name="PositionalProgram")


def input_value_error(node: fx.Node, info: TokenInfo) -> PassError:
    """The refusal of a value computed from an integer input's values that is not an
    attention mask; positions counted by ``cumsum`` (OPT's padded positions) named so."""
    where = f"node {node.name!r} (module {info.module or '<top level>'})"
    inputs = sorted(p.name for p in ancestors([node]) if p.op == "placeholder"
                    and isinstance(p.meta.get("val"), torch.Tensor)
                    and not p.meta["val"].is_floating_point())
    if any(n.target is _aten.cumsum.default for n in ancestors([node])):
        return PassError(
            f"{where} counts positions from the values of input(s) {inputs} with a cumulative "
            "sum over the tokens (positions that skip padding, as OPT computes them), and is "
            "read by something other than an attention mask; tppc rebuilds values of an "
            "input's values per chunk only as attention masks. fix: pass the positions as an "
            "input, computed as the model computes them (OPT: position_ids=(attention_mask."
            "cumsum(-1) * attention_mask - 1)); the result is the same")
    return PassError(
        f"{where} is computed from the values of integer input(s) {inputs} over query and "
        "key positions, and is read by something other than an attention mask; tppc rebuilds "
        "such values per chunk only as attention masks. fix: compute the value outside the "
        "model and pass it as an input (position_ids for positions), or pass the mask to "
        "SDPA as attn_mask"
    )


def inputs_read(node: fx.Node) -> list[fx.Node]:
    """The nodes the chunk step reads for ``node``: SDPA's mask is not read (its node becomes
    ``tppc::chunk_attention``, causal or unmasked by annotation's proof)."""
    if not chunked_kernel(node) or node.meta[TOKEN].role != "mixing":
        return node.all_input_nodes  # cross-attention keeps its mask over the text keys
    mask = sdpa_kwargs(node).get("attn_mask")
    return [a for a in node.all_input_nodes if a is not mask]


def sdpa_kwargs(node: fx.Node) -> dict[str, Any]:
    """The attention node's arguments by name (``query``, ``key``, ``attn_mask``...)."""
    norm = normalize_function(node.target, tuple(node.args), dict(node.kwargs),
                              normalize_to_only_use_kwargs=True)
    if norm is None:
        raise PassError(f"cannot read the arguments of attention node {node.name!r} "
                        f"({node.target}); tppc supports aten.scaled_dot_product_attention")
    return dict(norm.kwargs)
