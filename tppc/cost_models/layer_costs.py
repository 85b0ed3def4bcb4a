"""Per-layer prices: sum the node costs of each layer into time(c, p) and memory needs.

Terms:
    layer: a :class:`tppc.ir.records.LayerInfo` of ``group_layers`` (prologue, repeated block,
        epilogue) whose nodes are the chunk-step graph's nodes of that layer
        (:func:`.program_costs.program_layers`).
    layer time: ``Σ_nodes max(matrix_s, vector_s, memory_s) + serial_s + overhead`` on one
        device (see :mod:`.roofline`), a sympy expression in c, p and L, lambdified to
        numpy over ``(c, p, L)`` once per distinct expression (:mod:`.compiled_times`,
        :data:`COMPILED_TIMES` kept) and bound to the table's ``seq_len``: the planner
        evaluates a whole (c, p) grid at once, and a re-plan at a new length compiles
        nothing. ``LayerExpr.time`` is the expression at ``L = seq_len``.

Identical blocks (same ops, shapes and dtypes, node by node) share one expression and one
compiled function (:class:`.layer_pricer.LayerPricer`), so an 80-block model costs about as
much to price as one block. This module builds the :class:`CostTable` from them.

Example:
    >>> table = build_cost_table(front.chunk, ctx.layers, "4xh100-sxm", 4096)  # doctest: +SKIP
    >>> table.layers[0][1].time(np.array([512.]), np.array([0.]))                  # doctest: +SKIP
    array([0.00012...])
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
from torch import fx

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.compiled_times import COMPILED_TIMES, vectorise
from tppc.cost_models.layer_pricer import LayerExpr, LayerPricer, layer_cost
from tppc.cost_models.node_shapes import TokenSubstitution, find_seq_symbol
from tppc.cost_models.program_costs import program_layers
from tppc.cost_models.specs import DeviceSpec
from tppc.cost_models.table import CostTable, LayerCost, LinkCost
from tppc.errors import CostModelError
from tppc.ir.records import LayerInfo

__all__ = ["COMPILED_TIMES", "LayerExpr", "build_cost_table", "layer_expressions", "vectorise"]


def _refuse_fx_graphs(gm: fx.GraphModule) -> None:
    """The cost model prices ATen graphs (torch.export); fx fallback graphs hold module calls."""
    for node in gm.graph.nodes:
        if node.op == "call_module" or type(node.meta.get("val")).__name__ == "ShapeVal":
            raise CostModelError(
                f"node {node.name!r} ({node.op} {node.target}) comes from a graph captured with "
                "the torch.fx.symbolic_trace fallback; the cost model prices the ATen graphs "
                "torch.export produces. fix: make the model exportable with torch.export (move "
                "the code export rejects out of forward, or register it as a custom op)"
            )


def _setup(gm: fx.GraphModule, layers: Sequence[LayerInfo], seq_len: int,
           seq_symbol: sympy.Symbol | None, token_count: sympy.Expr | None,
           default_attention: str, compute_dtype: str | None
           ) -> tuple[LayerPricer, list[LayerInfo]]:
    if not isinstance(seq_len, int) or seq_len < 1:
        raise CostModelError(f"seq_len must be a positive int, got {seq_len!r}")
    _refuse_fx_graphs(gm)
    sym = seq_symbol if seq_symbol is not None else find_seq_symbol(gm)
    subs = TokenSubstitution.build(sym, token_count)
    layer_list = program_layers(gm, layers)
    return LayerPricer(gm, subs, seq_len, default_attention, compute_dtype), layer_list


def layer_expressions(gm: fx.GraphModule, layers: Sequence[LayerInfo],
                      device: DeviceSpec, seq_len: int, *,
                      seq_symbol: sympy.Symbol | None = None,
                      token_count: sympy.Expr | None = None,
                      default_attention: str = "causal", compute_dtype: str | None = None,
                      fuse_elementwise: bool | None = None) -> list[LayerExpr]:
    """Symbolic price of every layer on one device (see :func:`build_cost_table`)."""
    pricer, layer_list = _setup(gm, layers, seq_len, seq_symbol, token_count,
                                default_attention, compute_dtype)
    fuse = device.name.startswith("tpu") if fuse_elementwise is None else fuse_elementwise
    return [pricer.layer(info, device, fuse) for info in layer_list]


def build_cost_table(gm: fx.GraphModule, layers: Sequence[LayerInfo],
                     cluster: Cluster | str, seq_len: int, *,
                     seq_symbol: sympy.Symbol | None = None,
                     token_count: sympy.Expr | None = None,
                     default_attention: str = "causal", compute_dtype: str | None = None,
                     fuse_elementwise: bool | None = None, queue_depth: int = 2) -> CostTable:
    """Price every layer of the chunk-step graph on every device of a cluster.

    Args:
        gm: the chunk-step graph (``FrontEnd.chunk``, or
            :func:`tppc.frontend.annotate.annotate_program`): the program that runs for one chunk.
        layers: ``ctx.layers`` (``group_layers``); each layer's nodes are read off ``gm``'s
            ``tppc.layer`` meta (see :func:`.program_costs.program_layers`).
        cluster: a :class:`Cluster` or a cluster string.
        seq_len: the full sequence length L.
        seq_symbol: ``ctx.seq_symbol``; None finds the graph's only dynamic symbol.
        token_count: ``ctx.token_count`` (T as a function of the symbol); None means T = s.
        default_attention: kind of attention nodes without a ``TokenInfo.attention``.
        compute_dtype: matmul rate to use (``"tf32"``, ``"fp8"``); None uses the dtype of
            each node's inputs.
        fuse_elementwise: vector ops fused into matmuls (no memory traffic, no launch);
            None means True on TPUs (XLA) and False elsewhere (eager torch).
        queue_depth: chunks that may wait between two stages at run time (the memory rule
            holds ``queue_depth + 1`` chunks of a stage's input activations).

    Ops without a pricing rule are priced as memory traffic only, listed in the table's
    ``unpriced_ops`` and warned about once per op name (:class:`UnpricedOpWarning`).

    Raises:
        CostModelError: a node cannot be priced, or a layer depends on extra symbols.
    """
    cluster = Cluster.parse(cluster)
    pricer, layer_list = _setup(gm, layers, seq_len, seq_symbol, token_count,
                                default_attention, compute_dtype)
    per_device: list[tuple[LayerCost, ...]] = []
    unpriced: set[str] = set()
    priced: dict[tuple[DeviceSpec, bool], tuple[LayerCost, ...]] = {}  # identical devices
    for device in cluster.devices:
        fuse = device.name.startswith("tpu") if fuse_elementwise is None else fuse_elementwise
        if (device, fuse) not in priced:
            exprs = [pricer.layer(info, device, fuse) for info in layer_list]
            unpriced.update(op for e in exprs for op in e.unpriced)
            priced[(device, fuse)] = tuple(layer_cost(e, pricer.parts(e, device, fuse))
                                           for e in exprs)
        per_device.append(priced[(device, fuse)])
    causal = pricer.is_causal()
    return CostTable(
        device_names=cluster.device_names,
        capacities=tuple(int(d.memory.capacity) for d in cluster.devices),
        layers=tuple(per_device),
        links=tuple(LinkCost(latency=link.latency, bandwidth=link.bandwidth)
                    for link in cluster.links),
        seq_len=seq_len,
        causal=causal,
        unpriced_ops=tuple(sorted(unpriced)),
        queue_depth=queue_depth,
        pools=cluster.memory_pools(),
    )


