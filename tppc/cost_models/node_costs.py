"""Symbolic work of one graph node: matrix FLOPs, vector FLOPs and bytes in (c, p, L).

Terms:
    c: tokens in the chunk; p: tokens before it (prefix); L: full sequence length.
    token substitution: the graph's sequence symbol ``s`` is replaced so that the
        canonical token count ``T(s)`` equals ``c`` (on token axes) or the attention key
        length (on key axes): ``p + c`` for causal attention, ``L`` for bidirectional.
    matmul dims: each matmul is ``batch × (m × k) @ (k × n)``; ``m`` is usually tokens.

What is counted (eager execution, the torch backend's default):
    * every op that is not a view reads all its tensor inputs and writes its outputs once;
      views, reshapes, expands, dtype-preserving ``to`` and shape queries are free;
    * a matmul's bias add and an attention's softmax are fused into it (SDPA is one
      flash-style kernel: scores never reach memory; the K/V buffer of the key length is
      read, the chunk's K/V are written into the buffer; a causal kernel computes only the
      visited keys ``p·c + c(c+1)/2``; grouped-query attention reads each K/V head once, as
      SDPA with ``enable_gqa`` does in the emitted program: see :mod:`.attention`);
    * ``embedding`` reads only the gathered rows;
    * a re-rolled loop (:class:`tppc.ir.loop_scan.LoopScan`) costs its step, each op of it
      priced by these rules at the step's shapes, once per row of the chunk: its work is
      linear in ``c`` (no prefix term) and it launches every op of the step per row;
    * copies, gathers, concatenations and creation ops move memory and do no arithmetic.
An op that none of these rules knows is priced as memory traffic only (its inputs and
outputs), marked ``unpriced`` on its :class:`NodeCost`, and an :class:`UnpricedOpWarning`
is raised once per op name (the cost table and report list such ops).
``fuse_elementwise=True`` (XLA / torch.compile) additionally drops the memory traffic and
launch overhead of vector ops (norms, activations, elementwise): they ride on a matmul.

Example:
    >>> costs = graph_node_costs(gm)                     # doctest: +SKIP
    >>> costs["linear"].matrix_flops                      # doctest: +SKIP
    2*c*64*64
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

import sympy
import torch
from torch import fx

from tppc.cost_models.attention import AttentionWork, attention_work
from tppc.cost_models.node_shapes import (
    C,
    L,
    P,
    Shapes,
    TokenSubstitution,
    arg_nodes,
    find_seq_symbol,
    itemsize,
    numel,
    tensor_vals,
    value_bytes,
)
from tppc.cost_models.unpriced import UnpricedOpWarning, warn_unpriced
from tppc.errors import CostModelError
from tppc.ir.loop_scan import LoopScan
from tppc.ir.op_rules import op_rule
from tppc.ir.records import TOKEN, TokenInfo
from tppc.passes.chunking.chunk_parts import cache_source, is_head_repeat

__all__ = [
    "C",
    "L",
    "NodeCost",
    "P",
    "TokenSubstitution",
    "UnpricedOpWarning",
    "find_seq_symbol",
    "graph_node_costs",
    "node_cost",
]

_DTYPE_NAMES = {torch.float32: "fp32", torch.float64: "fp32", torch.bfloat16: "bf16",
                torch.float16: "fp16", torch.int8: "int8", torch.uint8: "int8"}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_NAMES[getattr(torch, _name)] = "fp8"
Kind = Literal["matrix", "attention", "vector", "memory", "view", "const"]


@dataclass(frozen=True)
class NodeCost:
    """Work of one node for a chunk of c tokens after p tokens (sympy expressions).

    Attributes:
        name: the fx node's name.
        op: the op's short name (``"linear"``).
        kind: matrix, attention, vector, memory (copies, gathers), view (free) or const
            (no token dependence; runs once per call, not per chunk).
        matrix_flops: matmul FLOPs, before tile padding.
        matmuls: ``(batch, m, n, k)`` of each matmul, for tile padding.
        vector_flops: non-matmul FLOPs.
        bytes: bytes read and written.
        dtype: the compute dtype name (``"bf16"``) used to pick the matrix rate.
        kv_bytes_per_key: for attention, K/V buffer bytes per key token (0 otherwise).
        unpriced: True when no rule knows the op and it was priced as memory traffic only.
        serial_bytes: the part of ``bytes`` moved by separate copy kernels the op implies in
            eager execution; they cannot overlap the op's compute, so the roofline adds their
            time instead of taking the max (0 for attention: grouped-query attention runs
            with ``enable_gqa``, no repeat copy).
        causal_keys: attention whose key dimension counts visited keys of a causal kernel
            (see :mod:`.attention`); the roofline pads it tile by tile.
        launches: ops the node runs per chunk, each paying the device's op overhead (a
            Python loop over experts: one per expert touched; 1 for a plain op).
    """

    name: str
    op: str
    kind: Kind
    matrix_flops: sympy.Expr
    matmuls: tuple[tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr], ...]
    vector_flops: sympy.Expr
    bytes: sympy.Expr
    dtype: str
    kv_bytes_per_key: int = 0
    unpriced: bool = False
    serial_bytes: sympy.Expr = sympy.S.Zero
    causal_keys: bool = False
    launches: sympy.Expr = sympy.S.One


def _op_name(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_module":
        return str(target)
    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return name.rstrip("_") if name.endswith("_") and not name.startswith("__") else name


def _depends(shapes: Shapes, nodes: Iterable[fx.Node]) -> bool:
    return any(numel(shapes.shape(n) or ()).free_symbols & {C, P, L} for n in nodes)


def _matmul_dims(op: str, node: fx.Node, shapes: Shapes, args: list[fx.Node]
                 ) -> list[tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]]:
    out = shapes.shape(node) or ()
    if op == "linear":
        x, w = shapes.shape(args[0]), shapes.shape(node.args[1])
        k = x[-1]
        return [(sympy.Integer(1), sympy.cancel(numel(x) / k), w[0], k)]
    if op in ("mm", "addmm", "bmm", "baddbmm", "matmul"):
        a_node, b_node = (node.args[1], node.args[2]) if op in ("addmm", "baddbmm") \
            else (node.args[0], node.args[1])
        a, b = shapes.shape(a_node), shapes.shape(b_node)
        k = a[-1]
        m = a[-2] if len(a) >= 2 else sympy.Integer(1)
        n = b[-1] if len(b) >= 2 else sympy.Integer(1)
        batch = sympy.cancel(numel(out) / (m * n)) if out else sympy.Integer(1)
        return [(batch, m, n, k)]
    if op in ("conv1d", "conv2d", "conv3d", "convolution", "_convolution"):
        w = shapes.shape(node.args[1])
        groups = node.args[8] if op in ("convolution", "_convolution") and len(node.args) > 8 \
            else (node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1))
        groups = int(groups)
        spatial = numel(out[2:])
        cout, k = w[0], numel(w[1:])  # w[1] is already Cin / groups
        return [(sympy.Integer(groups), out[0] * spatial, cout / groups, k)]
    if op == "einsum":
        equation = str(node.args[0]).replace(" ", "")
        ins, _, outs = equation.partition("->")
        sizes: dict[str, sympy.Expr] = {}
        for spec, operand in zip(ins.split(","), node.args[1], strict=False):
            for letter, size in zip(spec, shapes.shape(operand) or (), strict=False):
                sizes[letter] = size
        total = numel(list(sizes.values()))
        out_n = numel([sizes[ch] for ch in outs if ch in sizes])
        return [(sympy.Integer(1), out_n, sympy.Integer(1), sympy.cancel(total / out_n))]
    raise CostModelError(f"node {node.name}: no matmul rule for op {op!r}")


def _attention(node: fx.Node, shapes: Shapes, args: list[fx.Node], attention: str
               ) -> tuple[AttentionWork, int]:
    """Read ``(c, p, causal, heads, head_dims, kv_heads)`` off an SDPA node and price it."""
    q_node, k_node, v_node = node.args[0], node.args[1], node.args[2]
    q = shapes.shape(q_node)
    key_len = shapes.subs.key(attention)
    captured = shapes.shape(k_node)[-2]
    if shapes.subs.seq_symbol is None:  # static graph: keys as captured
        key_len = captured
    elif _fixed_context(k_node, captured):
        # keys without a token axis (cross-attention to text states): a fixed context that
        # every query sees whole, whatever the chunk
        key_len, attention = captured, "bidirectional"
    item = itemsize(tensor_vals(q_node.meta["val"])[0])
    batch_heads = numel(q[:-2])
    k_src, v_src = _kv_source(k_node, shapes), _kv_source(v_node, shapes)
    k_per, v_per = _per_token(shapes, k_src), _per_token(shapes, v_src)
    kv_heads = sympy.cancel(k_per / q[-1]) if k_per else batch_heads
    value_dim = sympy.cancel(v_per / kv_heads) if v_per else shapes.shape(v_node)[-1]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    mask_bytes = sympy.Integer(0)
    if isinstance(mask, fx.Node):
        mt = tensor_vals(mask.meta.get("val"))[0]
        mask_bytes = numel(shapes.shape(mask)[:-1]) * key_len * itemsize(mt)
    work = attention_work(q[-2], P, causal=attention != "bidirectional", heads=batch_heads,
                          head_dim=q[-1], kv_heads=kv_heads, value_dim=value_dim,
                          itemsize=item, keys=key_len)
    return replace(work, bytes=work.bytes + mask_bytes), int(work.kv_bytes_per_key)


def _fixed_context(k_node: fx.Node, length: object) -> bool:
    """Keys of a fixed length computed from no token (``const`` role): cross-attention."""
    info = k_node.meta.get(TOKEN)
    return (isinstance(info, TokenInfo) and info.role == "const"
            and not sympy.sympify(length).free_symbols)


def _kv_source(node: fx.Node, shapes: Shapes) -> fx.Node:
    """The value a K/V buffer stores (the emitter's rule: before HF's head repeat)."""
    sym = shapes.subs.seq_symbol
    if sym is not None:
        source, chain = cache_source(node, sym)
        if chain and is_head_repeat(source, chain):
            return source
    return node


def _per_token(shapes: Shapes, node: fx.Node) -> sympy.Expr:
    """Elements of ``node``'s value per token (0 when it has no token axis)."""
    count = numel(shapes.shape(node) or ())
    per = sympy.cancel(count / C)
    return per if not per.free_symbols else sympy.Integer(0)


def dtype_name(node: fx.Node, args: list[fx.Node], compute_dtype: str | None) -> str:
    if compute_dtype is not None:
        return compute_dtype
    for n in [*args, node]:
        ts = tensor_vals(n.meta.get("val"))
        if ts and ts[0].dtype in _DTYPE_NAMES and ts[0].is_floating_point():
            return _DTYPE_NAMES[ts[0].dtype]
    return "fp32"


def node_cost(node: fx.Node, subs: TokenSubstitution, *, default_attention: str = "causal",
              compute_dtype: str | None = None, _shapes: Shapes | None = None,
              live: bool | None = None) -> NodeCost:
    """Price one node (see the module docstring for what is counted); ``live`` overrides
    whether it runs per call (default: when its shapes depend on the sequence).

    Raises:
        CostModelError: a tensor-producing node has no ``meta["val"]`` or odd shapes.
    """
    shapes = _shapes or Shapes(subs, default_attention)
    if isinstance(node.target, LoopScan):
        return _loop_cost(node, node.target, shapes, compute_dtype)
    op = _op_name(node)
    rule = op_rule(node.target)
    zero = sympy.Integer(0)
    args = arg_nodes(node)
    outs = tensor_vals(node.meta.get("val"))
    dtype = dtype_name(node, args, compute_dtype)
    if node.op in ("placeholder", "output", "get_attr") or not outs or rule.price == "free":
        return NodeCost(node.name, op, "view", zero, (), zero, zero, dtype)
    if rule.price == "convert" and args \
            and outs[0].dtype == tensor_vals(args[0].meta["val"])[0].dtype:
        return NodeCost(node.name, op, "view", zero, (), zero, zero, dtype)
    info = node.meta.get(TOKEN)
    role = info.role if isinstance(info, TokenInfo) else None
    const = (not live) if live is not None else (
        role == "const" or (role is None and not _depends(shapes, [node, *args])))
    out_bytes = value_bytes(shapes, [node])
    kv = 0
    serial = zero
    unpriced = False
    causal_keys = False
    try:
        if rule.price == "attention":
            attention = (info.attention if isinstance(info, TokenInfo) and info.attention
                         else ("causal" if node.kwargs.get("is_causal") else default_attention))
            work, kv = _attention(node, shapes, args, attention)
            matmuls, vector, nbytes = list(work.matmuls), work.vector_flops, work.bytes
            causal_keys = work.causal
            kind: Kind = "attention"
        elif rule.price == "matrix":
            matmuls = _matmul_dims(op, node, shapes, args)
            vector, nbytes, kind = zero, value_bytes(shapes, args) + out_bytes, "matrix"
        elif rule.price == "lookup":  # an embedding reads only the gathered rows
            idx = node.args[1]
            matmuls, vector, kind = [], zero, "memory"
            nbytes = 2 * out_bytes + value_bytes(shapes, [idx])
        else:
            matmuls, kind = [], "vector"
            nbytes = (zero if rule.price == "create" else value_bytes(shapes, args)) + out_bytes
            out_n = numel(shapes.shape(node) or ())
            if rule.flops_per_in and args:
                vector = rule.flops_per_in * numel(shapes.shape(args[0]) or ())
            elif rule.flops_per_out:
                vector = rule.flops_per_out * out_n
            else:  # copies, gathers, concatenations, creation and unknown ops: memory only
                vector, kind = zero, "memory"
                unpriced = rule.price not in ("memory", "create", "convert")
    except (IndexError, TypeError, AttributeError, ValueError) as exc:
        raise CostModelError(
            f"node {node.name} ({op}): cannot read its shapes ({exc}); check that "
            "meta['val'] holds tensors for the node and its inputs"
        ) from exc
    if unpriced and not const:  # const nodes cost nothing per chunk: nothing is mis-priced
        warn_unpriced(op, node.name)
    unpriced = unpriced and not const
    matrix = sum((2 * b * m * n * k for b, m, n, k in matmuls), zero)
    return NodeCost(node.name, op, "const" if const else kind, sympy.expand(matrix),
                    tuple(tuple(sympy.expand(d) for d in mm) for mm in matmuls),
                    sympy.expand(vector), sympy.expand(nbytes), dtype, kv, unpriced,
                    sympy.expand(serial), causal_keys)


def _loop_cost(node: fx.Node, loop: LoopScan, shapes: Shapes, compute_dtype: str | None
               ) -> NodeCost:
    """A re-rolled loop: its step's ops, each priced at the step's shapes, once per row."""
    xs = loop.split(node.args)[1]
    rows = (shapes.shape(xs[0]) or ())[loop.xs_dims[0]] if xs else sympy.S.One
    subs = TokenSubstitution.build(None)
    steps = [node_cost(n, subs, compute_dtype=compute_dtype, live=True)
             for n in loop.step.graph.nodes if n.op == "call_function"]
    matmuls = tuple((rows * b, m, n, k) for cost in steps for b, m, n, k in cost.matmuls)
    matrix = rows * sum((c.matrix_flops for c in steps), sympy.S.Zero)
    launches = rows * sum(1 for c in steps if c.kind not in ("view", "const"))
    return NodeCost(node.name, "loop_scan", "matrix" if matmuls else "vector",
                    sympy.expand(matrix), tuple(tuple(sympy.expand(d) for d in mm)
                                                for mm in matmuls),
                    sympy.expand(rows * sum((c.vector_flops for c in steps), sympy.S.Zero)),
                    sympy.expand(rows * sum((c.bytes for c in steps), sympy.S.Zero)),
                    dtype_name(node, arg_nodes(node), compute_dtype),
                    launches=sympy.expand(launches))


def graph_node_costs(gm: fx.GraphModule, *, seq_symbol: sympy.Symbol | None = None,
                     token_count: sympy.Expr | None = None, default_attention: str = "causal",
                     compute_dtype: str | None = None) -> dict[str, NodeCost]:
    """Price every node of ``gm``; the sequence symbol is found when not given."""
    if seq_symbol is None:
        seq_symbol = find_seq_symbol(gm)
    subs = TokenSubstitution.build(seq_symbol, token_count)
    shapes = Shapes(subs, default_attention)
    return {n.name: node_cost(n, subs, default_attention=default_attention,
                              compute_dtype=compute_dtype, _shapes=shapes)
            for n in gm.graph.nodes}
