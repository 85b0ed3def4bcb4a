"""Const sub-graphs of a stage, evaluated once and fed in (``denoise``'s text K/V).

Terms:
    const node: a node of a stage graph that depends only on ``const`` user inputs (the
        prompt's ``encoder_hidden_states``, the timestep) and the stage's weights, on at
        least one such input, and has no side effect. Cross-attention K/V projections of
        the text are const nodes.
    frontier: const nodes (tensor-valued) with a non-const user; they become placeholders
        of kind ``hoisted`` of the stage's runnable graph.
    const program: computes the frontier values that read the same set of const inputs
        (one program per set, so the text K/V do not depend on the timestep's program).
        Its values are kept in the call state under the worker (stage and rank), the const
        program itself and the identity (and version) of the inputs it read: one ``denoise``
        call computes the text K/V once per program for all steps and patches, the
        timestep's values once per step (two programs, or two workers of a tensor-parallel
        stage, never share values: their shards differ).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.ir.records import ChunkInput
from tppc.passes.shapes import ancestors
from tppc.passes.subgraph import copy_subgraph

__all__ = ["ConstProgram", "const_values", "hoist_constants"]


@dataclass(frozen=True)
class ConstProgram:
    """One const program of a stage.

    Attributes:
        names: the frontier nodes it computes (their names in the stage graph).
        inputs: flat indices of the const user inputs it reads, in placeholder order.
        module: ``module(*inputs) -> tuple`` of the frontier values.
        first: index of its first value among the stage's hoisted values.
    """

    names: tuple[str, ...]
    inputs: tuple[int, ...]
    module: fx.GraphModule
    first: int


def hoist_constants(stage: Any) -> Any:
    """``stage`` (a :class:`tppc.program.program.StageProgram`) with its const frontier computed by
    const programs and fed to its runnable as ``hoisted`` inputs (unchanged when none)."""
    graph = stage.runnable.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    deps = _const_deps(graph, placeholders, stage.inputs)
    frontier = [n for n in graph.nodes
                if n.op == "call_function" and deps.get(n)
                and isinstance(n.meta.get("val"), torch.Tensor)
                and any(deps.get(u) is None for u in n.users)]
    if not frontier:
        return stage
    groups: dict[frozenset[int], list[fx.Node]] = {}
    for node in frontier:
        groups.setdefault(deps[node], []).append(node)
    programs, first = [], 0
    for key, nodes in groups.items():
        programs.append(ConstProgram(
            names=tuple(n.name for n in nodes), inputs=tuple(sorted(key)), first=first,
            module=_extract(stage.runnable, nodes, sorted(key), placeholders, stage.inputs)))
        first += len(nodes)
    hoisted = [n for nodes in groups.values() for n in nodes]
    count = len(stage.inputs)  # hoisted inputs follow the stage's inputs (before ``out_`` slots)
    runnable = copy_subgraph(
        stage.runnable, list(graph.nodes), graph.output_node().args[0],
        inputs=[*placeholders[:count], *hoisted, *placeholders[count:]],
        rename={n: f"tppc_hoisted_{n.name}" for n in hoisted}, prune=True)
    names = [p.name for p in runnable.graph.find_nodes(op="placeholder")][count:]
    inputs = [*stage.inputs, *((name, ChunkInput(kind="hoisted", source=node.name, index=k))
                               for k, (name, node) in enumerate(zip(names, hoisted)))]
    return dataclasses.replace(stage, runnable=runnable, inputs=tuple(inputs),
                               consts=tuple(programs))


def const_values(stage: Any, call: Any, state: Any) -> list[Any]:
    """The stage's hoisted values for ``call``, computed once per set of input values."""
    out: list[Any] = []
    for program in stage.consts:
        values = [call.flat_inputs[i] for i in program.inputs]
        key = (call.epoch, tuple((id(v), getattr(v, "_version", None)) for v in values))
        # a worker's own; the patch programs of one call share a const graph of equal code
        slot = (stage.index, stage.rank, program.module.code)
        entry = state.consts.get(slot)
        if entry is None or entry[0] != key:
            args = [v.to(stage.device) if isinstance(v, torch.Tensor) else v for v in values]
            with torch.no_grad():
                entry = (key, tuple(program.module(*args)), values)  # values: keep ids alive
            state.consts[slot] = entry
        out.extend(entry[1])
    return out


def _const_deps(graph: fx.Graph, placeholders: list[fx.Node], inputs: Any
                ) -> dict[fx.Node, frozenset[int] | None]:
    """Each node's set of const input indices, or None when it is not const."""
    deps: dict[fx.Node, frozenset[int] | None] = {}
    for i, ph in enumerate(placeholders):
        spec = inputs[i][1] if i < len(inputs) else None
        deps[ph] = frozenset({spec.index}) if spec is not None and spec.kind == "const" else None
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            deps[node] = frozenset()
        elif node.op != "call_function" or node.is_impure():
            deps[node] = None
        else:
            found = [deps.get(n) for n in node.all_input_nodes]
            deps[node] = (None if any(d is None for d in found)
                          else frozenset().union(*found))
    return deps


def _extract(root: fx.GraphModule, nodes: list[fx.Node], indices: list[int],
             placeholders: list[fx.Node], inputs: Any) -> fx.GraphModule:
    """A module computing ``nodes`` from the const inputs ``indices`` (and the weights)."""
    by_index = {inputs[i][1].index: ph for i, ph in enumerate(placeholders[: len(inputs)])
                if inputs[i][1].kind == "const"}
    body = [n for n in ancestors(nodes) if n.op != "placeholder"]
    return copy_subgraph(root, body, tuple(nodes), inputs=[by_index[i] for i in indices],
                         class_name="ConstProgram")
