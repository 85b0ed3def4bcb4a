"""Capture a model with a Python loop over positions: two static exports, re-rolled, generalised.

Terms:
    loop over positions: as in :mod:`tppc.frontend.guard_sites` (``for t in range(seq_len)``,
        transformers' Mamba slow path); torch.export needs an int for ``range`` and pins the
        length, even with its guards deferred to runtime asserts (``range`` reads the int).
    re-rolled capture: the model exported at two fixed lengths ``n`` and ``n + 1``, each
        graph's loop re-rolled into one :class:`tppc.ir.loop_scan.LoopScan` node
        (:mod:`tppc.frontend.reroll`), and the two graphs compared node by node: they must be
        the same graph (same ops, same step) whose integer arguments differ only by a linear
        function of the length, ``a·L + b`` (a ``view`` to ``[1, L, 32]``, a crop to ``L``
        rows). Those become ``a·sym_size(input, axis) + b`` and the graph's shapes are
        propagated again with a symbolic length (fake tensors), as torch.export's would be.

Why two exports and not one: the unrolled graph holds the length as literal ints, some of
them sizes the length does not touch (a hidden size may equal the length); a second length
tells them apart without guessing, and any argument that is no linear function of the
length, or any difference in the graphs' structure, refuses the capture. Why not
``torch._higher_order_ops.scan``: transformers' code is a Python loop, not a scan call, and
torch.export cannot capture the loop with a symbolic count; a node of tppc's own runs the
step over whatever rows a chunk has, with the same ops in the same order (bit-identical).
"""

from __future__ import annotations

import inspect
import operator
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch._decomp
import torch._refs
from torch import fx
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from tppc.frontend.reroll import RerollError, loop_block, reroll_loops
from tppc.ir.loop_scan import LoopScan
from tppc.passes.shapes import constant_pad_fill

__all__ = ["export_rerolled", "grown"]

_aten = torch.ops.aten
_STEPS = 4
"""The fewest steps the loop is exported with (a shorter example is grown): the steps
before the last hold ops only later steps read, which the graph drops at the last ones."""


def grown(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]], rows: int = 1
          ) -> inspect.BoundArguments:
    """``bound`` with every sequence input ``rows`` units longer (its last row repeated)."""
    args = OrderedDict()
    for name, value in bound.arguments.items():
        if name in axes and isinstance(value, torch.Tensor):
            for d in axes[name]:
                last = value.narrow(d, value.shape[d] - 1, 1)
                value = torch.cat([value, *[last] * rows], d)
        args[name] = value
    return inspect.BoundArguments(bound.signature, args)


def export_rerolled(bound: inspect.BoundArguments, axes: dict[str, tuple[int, ...]],
                    length: tuple[int, int],
                    export: Callable[[inspect.BoundArguments], fx.GraphModule],
                    source: str) -> tuple[fx.GraphModule, int]:
    """The re-rolled capture (see the module docstring) with symbolic shapes, and the rows
    per step (1, or ``b`` for a loop over blocks of ``b`` rows: the graph's symbol then
    counts blocks, ``L = b·blocks``).

    Args:
        bound: the example inputs; ``axes`` their sequence axes.
        length: the example's tokens, and the tokens of a unit of the symbol (1, or the
            block a model pads its sequence to: :mod:`.block_capture`).
        export: a static torch.export of the model (guards dropped) at given inputs.
        source: the loop's ``file:line``, for the loop nodes.

    Raises:
        RerollError: a loop that is no re-rollable recurrence, or graphs at the two lengths
            that are no one graph with the length as a symbol (the reason).
    """
    two = sorted(name for name, dims in axes.items() if len(dims) != 1)
    if two:
        raise RerollError(f"sequence inputs {two} have several sequence axes (e.g. a square "
                          "mask); the re-rolled capture takes inputs with one sequence axis "
                          "each (pass a 2-D attention_mask)")
    units, unit = length
    first = export(bound)
    block = loop_block(first)
    if block is None:
        raise RerollError("no stack (or cat of equal blocks) of values read one position "
                          "(or one block of rows) per step")
    if unit > 1 and block > 1 and unit != block:
        raise RerollError(f"a loop over blocks of {block} rows in a sequence padded to "
                          f"blocks of {unit}")
    block = max(block, unit)  # the tokens of one step of the symbol
    if units % block:
        raise RerollError(f"a loop over blocks of {block} rows and an example of {units} "
                          f"tokens, whose last block is partial (a step unlike the others); "
                          f"capture with a whole number of blocks, e.g. "
                          f"{max(_STEPS, -(-units // block)) * block} tokens")
    if units < _STEPS * block:  # the re-roller matches steps 1 and 2 (and 0)
        bound = grown(bound, axes, _STEPS * block - units)
        units, first = _STEPS * block, export(bound)
    second = export(grown(bound, axes, block))
    unrolled = _run(first, bound)
    loops = reroll_loops(first, source)
    if reroll_loops(second, source) != loops or not loops:
        raise RerollError(f"the loops at the lengths {units} and {units + block} differ")
    name, (axis,) = _principal(first, axes)
    _generalise(first, second, units // block, (name, axis, block))
    _propagate(first, bound, axes, block)
    _check_equal(unrolled, _run(first, bound))
    return first, block


def _principal(gm: fx.GraphModule, axes: dict[str, tuple[int, ...]]
               ) -> tuple[str, tuple[int, ...]]:
    """The sequence input whose length the graph's sizes are written with: the first one the
    graph reads (an ``attention_mask`` the model ignores, RWKV's, is read by nothing)."""
    used = {n.target for n in gm.graph.find_nodes(op="placeholder") if n.users}
    return next(((k, v) for k, v in axes.items() if k in used), next(iter(axes.items())))


def _run(gm: fx.GraphModule, bound: inspect.BoundArguments) -> list[torch.Tensor]:
    with torch.no_grad():
        out = gm(*bound.args, **bound.kwargs)
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def _check_equal(unrolled: list[torch.Tensor], rerolled: list[torch.Tensor]) -> None:
    """The re-rolled graph computes what the unrolled one did on the example (the same ops
    in the same order: equal up to kernel noise), or the capture is refused."""
    if len(unrolled) != len(rerolled):
        raise RerollError(f"the re-rolled graph returns {len(rerolled)} tensors, the unrolled "
                          f"one {len(unrolled)}")
    for i, (want, got) in enumerate(zip(unrolled, rerolled, strict=True)):
        if want.is_meta or got.is_meta:  # a model without its weights: nothing to compare
            continue
        try:
            torch.testing.assert_close(got, want)
        except AssertionError as exc:
            raise RerollError(f"output {i} of the re-rolled graph differs from the unrolled "
                              f"one on the example: {str(exc).splitlines()[1:3]}") from exc


def _generalise(gm: fx.GraphModule, other: fx.GraphModule, units: int,
                seq: tuple[str, int, int]) -> None:
    """``gm``'s literal sizes that differ in ``other`` (one unit longer: a token, or a block
    of ``seq[2]`` tokens) as ``a·n + b``, ``n`` the units (the length over the block)."""
    nodes, others = list(gm.graph.nodes), list(other.graph.nodes)
    if len(nodes) != len(others):
        raise RerollError(f"the graphs at the lengths {units} and {units + 1} have "
                          f"{len(nodes)} and {len(others)} nodes")
    index = {n: i for i, n in enumerate(nodes)}
    index2 = {n: i for i, n in enumerate(others)}
    placeholder = next(n for n in nodes if n.op == "placeholder" and n.target == seq[0])
    last = [n for n in nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        length = gm.graph.call_function(_aten.sym_size.int, (placeholder, seq[1]))
    if seq[2] > 1:
        with gm.graph.inserting_after(length):
            length = gm.graph.call_function(operator.floordiv, (length, seq[2]))
    made: dict[tuple[int, int], fx.Node] = {}

    def size(a: int, b: int, before: fx.Node) -> fx.Node:
        if (a, b) not in made:
            with gm.graph.inserting_before(before):
                value = length if a == 1 else gm.graph.call_function(operator.mul, (length, a))
                if b:
                    value = gm.graph.call_function(operator.add, (value, b))
            made[a, b] = value
        return made[a, b]

    for node, twin in zip(nodes, others, strict=True):
        if node.op != twin.op or not _same_target(node.target, twin.target):
            raise RerollError(f"node {node.name} ({node.target}) is {twin.target} at the "
                              f"length {units + 1}")
        lengths: list[tuple[int, int]] = []

        def merge(u: Any, v: Any, node: fx.Node = node, lengths: list = lengths) -> Any:
            if isinstance(u, fx.Node):
                if not isinstance(v, fx.Node) or index[u] != index2[v]:
                    raise RerollError(f"node {node.name} reads other values at the lengths "
                                      f"{units} and {units + 1}")
                return u
            if isinstance(u, list | tuple) and type(u) is type(v) and len(u) == len(v):
                return type(u)(merge(a, b) for a, b in zip(u, v, strict=True))
            if isinstance(u, dict) and isinstance(v, dict) and u.keys() == v.keys():
                return {k: merge(u[k], v[k]) for k in u}
            if u == v and type(u) is type(v):
                return u
            if type(u) is int and type(v) is int:
                a, b = v - u, u - (v - u) * units
                return size(a, b, node)
            raise RerollError(f"node {node.name} ({node.target}) has the argument {u!r} at "
                              f"the length {units} and {v!r} at {units + 1}: no size")

        node.args = merge(node.args, twin.args)
        node.kwargs = merge(node.kwargs, twin.kwargs)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def _same_target(a: Any, b: Any) -> bool:
    if isinstance(a, LoopScan) and isinstance(b, LoopScan):
        return (a.carries, a.xs_dims, a.out_dim) == (b.carries, b.xs_dims, b.out_dim) \
            and _same_graph(a.step.graph, b.step.graph)
    return a == b


def _same_graph(g1: fx.Graph, g2: fx.Graph) -> bool:
    """Whether two step graphs are the same computation (names aside)."""
    n1, n2 = list(g1.nodes), list(g2.nodes)
    if len(n1) != len(n2):
        return False
    index = {n: i for i, n in enumerate(n1)}
    index2 = {n: i for i, n in enumerate(n2)}

    def same(u: Any, v: Any) -> bool:
        if isinstance(u, fx.Node):
            return isinstance(v, fx.Node) and index[u] == index2[v]
        if isinstance(u, list | tuple):
            return type(u) is type(v) and len(u) == len(v) \
                and all(same(a, b) for a, b in zip(u, v, strict=True))
        if isinstance(u, dict):
            return isinstance(v, dict) and u.keys() == v.keys() \
                and all(same(u[k], v[k]) for k in u)
        return type(u) is type(v) and u == v

    return all(a.op == b.op and (a.op == "placeholder" or a.target == b.target)
               and same(a.args, b.args)
               and same(a.kwargs, b.kwargs) for a, b in zip(n1, n2, strict=True))




def _propagate(gm: fx.GraphModule, bound: inspect.BoundArguments,
               axes: dict[str, tuple[int, ...]], block: int) -> None:
    """Every node's ``meta["val"]`` again, with the sequence axis of every input in ``axes``
    one symbolic length (a multiple ``block·n`` of a symbol ``n`` for a loop over blocks)."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    length: Any = None
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        value = bound.arguments.get(node.target)
        if isinstance(value, torch.Tensor) and node.target in axes:
            (axis,) = axes[node.target]
            if length is None:
                units = value.shape[axis] // block
                symbol = env.create_symbol(units, ConstantSource("length"),
                                           dynamic_dim=DimDynamic.DYNAMIC)
                length = block * env.create_symintnode(symbol, hint=units)
            shape = list(value.shape)
            shape[axis] = length
            with mode:
                value = torch.empty(shape, dtype=value.dtype)
        elif isinstance(value, torch.Tensor):
            value = mode.from_tensor(value, symbolic_context=StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.STATIC] * value.dim()))
        inputs.append(value)
    _PinsNamed(gm, mode).propagate_dont_convert_inputs(*inputs)


class _PinsNamed(FakeTensorProp):
    """Fake propagation that names the first node whose shapes pin the length (a size the
    model computes from the length and compares with a constant)."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            fill = constant_pad_fill(n)
            if fill is not None:  # its C++ kernel pins the length (a pad by nothing, a shift)
                args, kwargs = self.fetch_args_kwargs_from_env(n)
                with self._mode:
                    result = torch._refs.constant_pad_nd(args[0], args[1], fill)
                n.meta["val"] = result
            else:
                result = super().run_node(n)
        except RuntimeError as exc:  # a kernel whose meta wants concrete sizes: decomposed
            decomposed = _decomposition(n) if "concrete integers" in str(exc) else None
            if decomposed is None:
                raise
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            with self._mode:
                result = decomposed(*args, **kwargs)
            n.meta["val"] = result
        env = self._mode.shape_env
        if env is not None and env.replacements and any(
                not getattr(v, "free_symbols", True) for v in env.replacements.values()):
            trace = (n.meta.get("stack_trace") or "").strip().splitlines()
            where = f" ({trace[-2].strip()}: `{trace[-1].strip()}`)" if len(trace) > 1 else ""
            raise RerollError(f"node {n.name} ({n.target}){where} fixes the length once the "
                              "shapes outside the loop are symbolic")
        return result


def _decomposition(n: fx.Node) -> Any:
    """torch's decomposition of ``n``'s op (``baddbmm`` into ``bmm`` and adds: its meta
    kernel expands with concrete sizes only, RecurrentGemma's gates), or None."""
    return torch._decomp.decomposition_table.get(n.target) if n.op == "call_function" \
        else None
