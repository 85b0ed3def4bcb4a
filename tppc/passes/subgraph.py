"""THE fx subgraph copier: slice a set of nodes out of a graph into a new GraphModule.

Terms:
    inputs: the nodes whose values the copy takes as arguments, in order; each becomes one
        placeholder of the copy (a source placeholder is copied as it is, with its name and
        target; any other node, or a renamed one, becomes ``placeholder(name)``). These are
        the frontier of the slice: boundary values, const inputs, full-length token values.
    nodes: the nodes the copy computes, copied in the source graph's order (not their
        iteration order); every input they read must be an input or one of them.
    outputs: what the copy returns, any structure (a node, a tuple, a list, constants) of
        source nodes, mapped onto their copies; the copy's output node returns it.

Every copied node keeps its name, target, arguments (mapped) and a copy of its ``meta``
(``Graph.node_copy`` does a shallow copy: annotations such as ``meta["tppc.token"]`` survive,
and editing the copy's meta leaves the source untouched). Inputs that are not copied
placeholders take a copy of their source's meta. The copy's root is the given module: the
new GraphModule holds only the parameters and submodules its ``get_attr`` and
``call_module`` nodes read.

Example:
    >>> gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Tanh()))
    >>> relu, tanh = [n for n in gm.graph.nodes if n.op == "call_module"]
    >>> tail = copy_subgraph(gm, [tanh], tanh, inputs=[relu])
    >>> [n.op for n in tail.graph.nodes]
    ['placeholder', 'call_module', 'output']
    >>> float(tail(torch.tensor([0.0])))
    0.0
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from tppc.errors import PassError

__all__ = ["copy_graph", "copy_placeholders", "copy_subgraph"]


def copy_placeholders(graph: fx.Graph, inputs: Sequence[fx.Node],
                      rename: Mapping[fx.Node, str] | None = None) -> dict[fx.Node, fx.Node]:
    """Append one placeholder per node of ``inputs`` to ``graph``, in order (module docstring).

    Returns:
        ``{source node: its placeholder in graph}``.
    """
    rename = rename or {}
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        if node.op == "placeholder" and node not in rename:
            env[node] = graph.node_copy(node)
            continue
        ph = graph.placeholder(rename.get(node, node.name))
        ph.meta.update(node.meta)
        env[node] = ph
    return env


def copy_subgraph(root: torch.nn.Module, nodes: Collection[fx.Node], outputs: Any, *,
                  inputs: Sequence[fx.Node] = (), rename: Mapping[fx.Node, str] | None = None,
                  class_name: str = "GraphModule", prune: bool = False
                  ) -> fx.GraphModule:
    """A GraphModule that computes ``outputs`` from ``inputs`` with copies of ``nodes``.

    Args:
        root: the module owning the parameters and submodules the nodes read.
        nodes: the nodes to copy (any order; copied in graph order; inputs are skipped).
        outputs: the structure the copy returns (nodes are mapped onto their copies).
        inputs: the nodes that become the copy's placeholders, in this order.
        rename: placeholder names for some inputs (default: the input's own name).
        class_name: the class name of the returned GraphModule.
        prune: drop copied nodes the outputs do not need, and the parameters only they
            read (``Graph.eliminate_dead_code``: side-effecting nodes and placeholders stay).

    Raises:
        PassError: a copied node reads a value that is neither an input nor copied.
    """
    graph = fx.Graph()
    env = copy_placeholders(graph, inputs, rename)
    wanted = set(nodes)
    if wanted:
        source = next(iter(wanted)).graph
        for node in source.nodes:
            if node in wanted and node not in env and node.op != "output":
                env[node] = graph.node_copy(node, lambda a, user=node: _lookup(env, a, user))
    graph.output(fx.node.map_arg(outputs, lambda a: _lookup(env, a, None)))
    if prune:
        graph.owning_module = root  # type: ignore[assignment]  (call_module purity lookups)
        graph.eliminate_dead_code()
    return fx.GraphModule(root, graph, class_name=class_name)


def copy_graph(gm: fx.GraphModule, class_name: str = "GraphModule") -> fx.GraphModule:
    """A copy of ``gm``'s graph (same nodes, names, node meta, calling convention; ``gm``'s
    parameters) that can be edited without touching ``gm``'s. ``gm.meta`` is not copied."""
    output = gm.graph.output_node()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    result = copy_subgraph(gm, list(gm.graph.nodes), output.args[0], inputs=placeholders,
                           class_name=class_name)
    result.graph.output_node().meta.update(output.meta)
    result.graph._codegen = copy.deepcopy(gm.graph._codegen)  # pytree in/out specs
    result.recompile()
    return result


def _lookup(env: Mapping[fx.Node, fx.Node], arg: fx.Node, user: fx.Node | None) -> fx.Node:
    if arg not in env:
        who = f"node {user.name!r}" if user is not None else "the output"
        raise PassError(f"subgraph copy: {who} reads {arg.name!r}, which is neither an input "
                        "of the copy nor among its nodes; fix: add it to inputs or nodes")
    return env[arg]
