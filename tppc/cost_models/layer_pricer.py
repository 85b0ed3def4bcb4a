"""Layer expressions: node costs summed per layer, memoised across identical blocks.

Terms:
    node signature: ops, shapes, dtypes, token axes and constants of a node and its inputs;
        equal signatures give equal costs, so each distinct node is priced once.
    layer expression (:class:`LayerExpr`): the symbolic price of one layer on one device,
        ``Σ_nodes max(matrix_s, vector_s, memory_s) + serial_s + overhead`` (see
        :mod:`.roofline`), with its compiled time function (:mod:`.compiled_times`) and
        memory needs (:mod:`.layer_memory`).

:class:`LayerPricer` holds one graph's caches; :mod:`.layer_costs` builds the cost table
from its expressions, :mod:`.group_costs` the tensor-parallel one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import sympy
import torch
from torch import fx

from tppc.cost_models.compiled_times import difference, vectorise
from tppc.cost_models.layer_memory import (
    attention_workspace,
    peak_live_bytes,
    positional_bytes,
    state_bytes,
)
from tppc.cost_models.node_costs import NodeCost, dtype_name, node_cost
from tppc.cost_models.node_shapes import (
    C,
    L,
    P,
    Shapes,
    TokenSubstitution,
    arg_nodes,
    numel,
    tensor_vals,
)
from tppc.cost_models.program_costs import program_node_cost, program_signature
from tppc.cost_models.roofline import node_time_terms
from tppc.cost_models.specs import DeviceSpec
from tppc.cost_models.table import MEMORY_FIELDS, LayerCost, TimeFn
from tppc.errors import CostModelError
from tppc.ir.records import TOKEN, LayerInfo, TokenInfo

__all__ = ["LayerExpr", "LayerPricer", "layer_cost"]


_INDICES_OF_TRUE = (torch.ops.aten.nonzero.default, torch.ops.aten.where.default)
"""Ops whose output rows are the true elements of their input: a data-dependent count."""


@dataclass(frozen=True, kw_only=True)
class LayerExpr:
    """Symbolic price of one layer on one device.

    Attributes:
        info: the layer.
        nodes: the cost of each node of the layer, in graph order.
        time: seconds as a sympy expression of c and p (L already substituted).
        matrix_flops: unpadded matmul FLOPs (sympy, in c, p).
        vector_flops: non-matmul FLOPs.
        bytes: bytes moved.
        fn: ``time`` lambdified and numpy-vectorised.
        weight_bytes: parameter and buffer bytes the layer holds, and the carried states of
            its recurrent nodes (:func:`.layer_memory.state_bytes`).
        kv_bytes_per_token: K/V buffer bytes per sequence token.
        act_bytes_per_token: bytes per token of the values leaving the layer.
        peak_bytes_per_token: bytes per chunk token of the values live at once inside the
            layer (:func:`.layer_memory.peak_live_bytes`).
        positional_bytes_per_token: bytes per sequence token of the positional values it reads.
        workspace_bytes_per_key: bytes per (query row, key) of its attention kernel's mask.
        unpriced: names of the layer's ops that have no pricing rule (priced as memory
            traffic only), sorted; empty when every op was priced.
    """

    info: LayerInfo
    nodes: tuple[NodeCost, ...]
    time: sympy.Expr
    matrix_flops: sympy.Expr
    vector_flops: sympy.Expr
    bytes: sympy.Expr
    fn: TimeFn
    weight_bytes: int
    kv_bytes_per_token: int
    act_bytes_per_token: int
    peak_bytes_per_token: int = 0
    positional_bytes_per_token: int = 0
    workspace_bytes_per_key: int = 0
    unpriced: tuple[str, ...] = ()


def _raw_dim(size: object) -> object:
    """A hashable size, cheaper than ``SymNode.expr`` (which applies the shape env)."""
    node = getattr(size, "node", None)
    return getattr(node, "_expr", None) if node is not None else size


def _describe(n: fx.Node) -> tuple:
    info = n.meta.get(TOKEN)
    axes = (info.role, info.axis, info.other_axes, info.attention) \
        if isinstance(info, TokenInfo) else None
    shapes = tuple((tuple(map(_raw_dim, t.shape)), t.dtype) for t in tensor_vals(n.meta.get("val")))
    return (n.op, shapes, axes)


def _node_signature(node: fx.Node, describe) -> tuple:
    """Ops, shapes, dtypes and token axes: equal signatures give equal costs."""
    consts = tuple(repr(a) for a in node.args if not isinstance(a, fx.Node | list | tuple))
    return (str(node.target), describe(node), consts, node.kwargs.get("is_causal"),
            tuple(describe(a) for a in node.all_input_nodes), program_signature(node))


class LayerPricer:
    """Node costs and layer expressions, memoised across identical nodes and blocks."""

    def __init__(self, gm: fx.GraphModule, subs: TokenSubstitution, seq_len: int,
                 default_attention: str, compute_dtype: str | None) -> None:
        self.gm = gm
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.subs = subs
        self.seq_len = seq_len
        self.default_attention = default_attention
        self.compute_dtype = compute_dtype
        self.shapes = Shapes(subs, default_attention)
        self._node_cache: dict[tuple, NodeCost] = {}
        self._bounds: dict[sympy.Symbol, sympy.Expr] | None = None
        self._layer_cache: dict[tuple, tuple] = {}
        self._priced: dict[str, list[tuple[tuple, NodeCost]]] = {}
        self._descriptions: dict[str, tuple] = {}
        self._acts: dict[str | tuple, int] = {}
        self._peaks: dict[str, int] = {}  # per layer name: the same on every device
        self._positional: dict[str, int] = {}
        self._kv: dict[str, int] = {}
        self._rest: dict[tuple, TimeFn] = {}  # second parts' times, one per distinct block

    def _describe(self, node: fx.Node) -> tuple:
        if node.name not in self._descriptions:
            self._descriptions[node.name] = _describe(node)
        return self._descriptions[node.name]

    def node(self, name: str) -> tuple[tuple, NodeCost]:
        node = self.nodes[name]
        sig = _node_signature(node, self._describe)
        if sig not in self._node_cache:
            dtype = dtype_name(node, arg_nodes(node), self.compute_dtype)
            self._node_cache[sig] = program_node_cost(node, self.shapes, dtype) or node_cost(
                node, self.subs, default_attention=self.default_attention,
                compute_dtype=self.compute_dtype, _shapes=self.shapes)
        cost = self._node_cache[sig]
        return sig, (cost if cost.name == name else _renamed(cost, name))

    def layer(self, info: LayerInfo, device: DeviceSpec, fuse: bool) -> LayerExpr:
        missing = [n for n in info.nodes if n not in self.nodes]
        if missing:
            raise CostModelError(
                f"layer {info.name!r} names nodes {missing[:3]} that are not in the graph; "
                "rebuild the layers after the last graph transform"
            )
        if info.name not in self._priced:
            self._priced[info.name] = [self.node(n) for n in info.nodes]
        priced = self._priced[info.name]
        costs = tuple(c for _, c in priced)
        key = (tuple(s for s, _ in priced), device, fuse)
        if key not in self._layer_cache:
            self._layer_cache[key] = self._sum(costs, device, fuse)
        time, matrix, vector, nbytes, fn = self._layer_cache[key]
        kv = sum(c.kv_bytes_per_key for c in costs)
        return LayerExpr(info=info, nodes=costs, time=time, matrix_flops=matrix,
                         vector_flops=vector, bytes=nbytes, fn=fn,
                         **self._memory(info, int(kv), device),
                         unpriced=tuple(sorted({c.op for c in costs if c.unpriced})))

    def parts(self, whole: LayerExpr, device: DeviceSpec, fuse: bool) -> tuple[LayerCost, ...]:
        """The costs of a block's two parts: the first priced like any layer, the second
        the block's time less the first's (its nodes are the rest of the block's, and a
        layer's time is the sum of its nodes'), so a part costs one expression, not two."""
        if not whole.info.parts:
            return ()
        first_info, second_info = whole.info.parts
        first = self.layer(first_info, device, fuse)
        key = ("rest", id(whole.fn), id(first.fn))
        if key not in self._rest:
            self._rest[key] = difference(whole.fn, first.fn)
        if second_info.name not in self._kv:
            self._kv[second_info.name] = int(sum(self.node(n)[1].kv_bytes_per_key
                                                 for n in second_info.nodes))
        second = LayerCost(name=second_info.name, time=self._rest[key],
                           **self._memory(second_info, self._kv[second_info.name], device))
        return layer_cost(first), second

    def _memory(self, info: LayerInfo, kv: int, device: DeviceSpec) -> dict[str, int]:
        """The :data:`~.table.MEMORY_FIELDS` of a layer whose K/V bytes per token are ``kv``."""
        return {"weight_bytes": int(info.param_bytes) + state_bytes(self.nodes, info.nodes),
                "kv_bytes_per_token": kv,
                "act_bytes_per_token": self._act_bytes(info),
                "peak_bytes_per_token": self._peak_bytes(info),
                "positional_bytes_per_token": self._positional_bytes(info),
                "workspace_bytes_per_key": attention_workspace(self.nodes, info.nodes,
                                                               device.name == "cpu")}

    def _sum(self, costs: Sequence[NodeCost], device: DeviceSpec, fuse: bool) -> tuple:
        full = {L: self.seq_len}
        total = []
        overhead = 0.0
        for cost in costs:
            terms = node_time_terms(cost, device, fuse_elementwise=fuse)
            if terms.host:  # the host's issue time overlaps the node's device time
                total.append(terms.total())
                continue
            overhead += terms.overhead
            total.append(terms._replace(overhead=0.0).total())
        symbolic = sympy.Add(*total) + overhead  # in c, p and L: compiled once
        time = symbolic.subs(full)
        live = [c for c in costs if c.kind not in ("view", "const")]
        matrix = sympy.Add(*[c.matrix_flops for c in live]).subs(full)
        vector = sympy.Add(*[c.vector_flops for c in live]).subs(full)
        nbytes = sympy.Add(*[c.bytes for c in live]).subs(full)
        bounds = self._data_dependent_bounds()
        if bounds and (time.free_symbols - {C, P}) & set(bounds):
            time, matrix, vector, nbytes, symbolic = (
                sympy.sympify(e).subs(bounds) for e in (time, matrix, vector, nbytes, symbolic))
        bad = time.free_symbols - {C, P}
        if bad:
            raise CostModelError(
                f"layer time depends on symbols {sorted(map(str, bad))} besides c and p; make "
                "those dimensions static (only the sequence may be dynamic)"
            )
        return time, matrix, vector, nbytes, vectorise(symbolic, self.seq_len)

    def _data_dependent_bounds(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Each data-dependent row count priced at its bound: the rows of ``nonzero`` or a
        one-argument ``where`` (the tokens an expert of an eager mixture-of-experts loop takes,
        ``torch.where(mask[e])``) at the elements of its input (every token routed there), a
        piece of ``split_with_sizes`` by sizes read from values (JetMoE's experts,
        ``expert_size.tolist()``) at the whole axis it splits."""
        if self._bounds is None:
            self._bounds = {}
            for node in self.gm.graph.nodes:
                found: dict[sympy.Symbol, sympy.Expr] = {}
                if node.target is torch.ops.aten.split_with_sizes.default:
                    found = self._split_bounds(node)
                elif node.target in _INDICES_OF_TRUE and len(node.args) == 1:
                    shape = self.shapes.shape(node.args[0])
                    found = {rows: numel(shape) for rows in node.meta.get("unbacked_bindings", {})
                             if shape is not None and isinstance(rows, sympy.Symbol)}
                for symbol, bound in found.items():  # a bound in c, p only (not other counts)
                    if symbol not in self._bounds and bound.free_symbols <= {C, P, L}:
                        self._bounds[symbol] = bound
        return self._bounds

    def _split_bounds(self, node: fx.Node) -> dict[sympy.Symbol, sympy.Expr]:
        """The data-dependent sizes of a ``split_with_sizes``, each at the axis it splits."""
        source, sizes = node.args[0], node.args[1]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        shape = self.shapes.shape(source) if isinstance(source, fx.Node) else None
        if shape is None or not isinstance(sizes, list | tuple):
            return {}
        bounds = {}
        for size in sizes:
            val = size.meta.get("val") if isinstance(size, fx.Node) else None
            if isinstance(val, torch.SymInt):
                expr = sympy.sympify(val.node.expr)
                if isinstance(expr, sympy.Symbol):
                    bounds[expr] = shape[dim]
        return bounds

    def is_causal(self) -> bool:
        """Whether the graph's attention (the first priced) reads the prefix ``p``."""
        for cost in self._node_cache.values():
            if cost.kind == "attention":
                return bool(cost.bytes.has(P) or cost.matrix_flops.has(P))
        return False

    def _act_bytes(self, info: LayerInfo) -> int:
        if info.name not in self._acts:
            self._acts[info.name] = self._compute_act_bytes(info)
        return self._acts[info.name]

    def _positional_bytes(self, info: LayerInfo) -> int:
        """Bytes per sequence token of the layer's positional inputs (once per layer)."""
        if info.name not in self._positional:
            self._positional[info.name] = positional_bytes(self.nodes, info.nodes, self.shapes)
        return self._positional[info.name]

    def _peak_bytes(self, info: LayerInfo) -> int:
        """Largest sum of live per-token values inside the layer (:mod:`.layer_memory`);
        the same on every device, so computed once per layer."""
        if info.name not in self._peaks:
            self._peaks[info.name] = peak_live_bytes(self.nodes, info.nodes, self.shapes,
                                                     self.seq_len)
        return self._peaks[info.name]

    def _compute_act_bytes(self, info: LayerInfo) -> int:
        total = sympy.Integer(0)
        for name in info.outputs:
            node = self.nodes.get(name)
            info_out = node.meta.get(TOKEN) if node is not None else None
            if node is None or not tensor_vals(node.meta.get("val")) or (
                    isinstance(info_out, TokenInfo) and info_out.role != "token"):
                continue
            shape = self.shapes.shape(node)
            size = sympy.Mul(*shape) * tensor_vals(node.meta["val"])[0].element_size()
            if C in size.free_symbols:
                total += size.subs({C: 1, P: 0, L: self.seq_len})
        return int(sympy.ceiling(total))


def _renamed(cost: NodeCost, name: str) -> NodeCost:
    return replace(cost, name=name)


def layer_cost(e: LayerExpr, parts: tuple[LayerCost, ...] = ()) -> LayerCost:
    """The planner's :class:`~.table.LayerCost` of a layer expression (and its parts): its
    name, time function and :data:`~.table.MEMORY_FIELDS`."""
    return LayerCost(name=e.info.name, time=e.fn, parts=parts,
                     **{name: getattr(e, name) for name in MEMORY_FIELDS})
