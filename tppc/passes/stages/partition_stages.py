"""Pass: split a chunk-step graph at stage cuts into one GraphModule per stage.

Terms:
    cuts: the layer ranges of the stages, ``((0, e_1), (e_1, e_2), ..., (e_{S-1}, N))``,
        and the layer names they index (a plan's ``StagePlan.layer_start/layer_end`` and
        ``layer_names``); the pass never sees the plan itself.
    owned node: a ``token``/``mixing`` node (and each K/V buffer); it runs in the stage whose
        layer range holds its layer.
    shared node: a ``const`` node (weights, conditioning, symbolic sizes); it is recomputed
        in every stage that needs it and never sent.
    boundary value: a token value produced in stage ``≤ s`` and read after stage ``s``;
        stage ``s`` sends it to stage ``s + 1`` (values needed further on pass through).

Every stage graph takes its boundary inputs first (placeholders of kind ``boundary``), then
the chunk inputs it reads (chunk of a token input, ints, frontier slices, its own K/V
buffers; see :class:`tppc.passes.chunking.chunk_attention.ChunkInput`), and returns its boundary
outputs (the last stage: the model's flat outputs). Each stage module holds only the
parameters its nodes read, and ``stage.tppc_positional`` computes only its frontier values.

The pass returns a GraphModule whose graph calls ``stage_0 … stage_{S-1}`` in order: one
chunk step of the whole model, equal to the chunk-step graph it was made from.

Example:
    >>> gm = run_passes(gm, ctx, [..., chunk_attention_pass, partition_stages(ranges, names)])
    >>> [type(m).__name__ for m in gm.children()]                      # doctest: +SKIP
    ['Stage', 'Stage']
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence

import torch
from torch import fx

from tppc.errors import PassError, PlanError
from tppc.ir.context import CompileContext
from tppc.ir.records import (
    CHUNK_INPUT,
    CHUNK_SIGNATURE,
    LAYER,
    PART,
    STAGE_INFO,
    TOKEN,
    ChunkInput,
    LayerInfo,
    StageInfo,
)
from tppc.passes.runner import Pass
from tppc.passes.subgraph import copy_placeholders, copy_subgraph

__all__ = ["partition_stages", "plan_layer_names", "split_stages"]

def partition_stages(ranges: Sequence[tuple[int, int]], planned: Sequence[str]) -> Pass:
    """The partition pass for stage layer ``ranges`` over the ``planned`` layer names (a
    ``(gm, ctx) -> gm`` pass; see the module docstring)."""

    def partition_stages_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
        return split_stages(gm, plan_layer_names(ctx.layers, planned), ranges)

    return partition_stages_pass


def plan_layer_names(layers: Sequence[LayerInfo], planned: Sequence[str]) -> list[str]:
    """The layer names a plan indexes: ``layers``' names, with a block the plan cuts at its
    waist replaced by its two parts (``LayerInfo.parts``, named in ``planned``, the plan's
    layer names stage by stage).

    Raises:
        PlanError: the plan names some parts but its layers are not ``layers`` so refined.
    """
    coarse = [layer.name for layer in layers]
    planned = list(planned)
    part_names = {p.name for layer in layers for p in layer.parts}
    if not part_names.intersection(planned):
        return coarse
    names: list[str] = []
    for layer in layers:
        parts = [p.name for p in layer.parts]
        names.extend(parts if parts and parts[0] in planned else [layer.name])
    if names != planned:
        raise PlanError(
            f"the plan's layers ({', '.join(planned[:4])}, ...) are not the model's layers with "
            "some blocks cut at their waist; fix: plan for this model")
    return names


def split_stages(gm: fx.GraphModule, layer_names: Sequence[str],
                 ranges: Sequence[tuple[int, int]]) -> fx.GraphModule:
    """Split the chunk-step graph ``gm`` into stages, stage ``s`` running ``ranges[s]``.

    Args:
        gm: output of ``chunk_attention_pass``.
        layer_names: names of the layers in order, as the plan indexes them
            (:func:`plan_layer_names`: ``ctx.layers``, a block the plan cuts as its parts).
        ranges: stage ``s`` runs layers ``[ranges[s][0], ranges[s][1])``.

    Raises:
        PlanError: the plan's stages do not cover the layers contiguously.
        PassError: a node would read a value from a later stage.
    """
    stage_of_layer = _stage_of_layer(layer_names, ranges)
    nodes = list(gm.graph.nodes)
    owner = {n: _owner(n, stage_of_layer) for n in nodes}
    num = len(ranges)
    output = nodes[-1]
    needs = [_closure(nodes, owner, s, output if s == num - 1 else None) for s in range(num)]
    final = {a for a in output.all_input_nodes if owner[a] is not None}
    boundaries = []
    for s in range(num - 1):
        later = set().union(*(needs[t][1] for t in range(s + 1, num))) | final
        boundaries.append([n for n in nodes if n in later and owner[n] is not None
                           and owner[n] <= s])
    top = fx.Graph()
    placeholders = [n for n in nodes if n.op == "placeholder"]
    top_env = {n.name: ph for n, ph in copy_placeholders(top, placeholders).items()}
    root = torch.nn.Module()
    prev: list[fx.Node] = []
    for s in range(num):
        inputs = boundaries[s - 1] if s else []
        outs = boundaries[s] if s < num - 1 else None
        stage = _stage_module(gm, nodes, owner, s, needs[s][0], inputs, outs, output,
                              tuple(layer_names[i] for i in range(*ranges[s])))
        name = f"stage_{s}"
        root.add_module(name, stage)
        args = [*prev, *(top_env[p] for p in _driver_placeholders(stage))]
        call = top.call_module(name, tuple(args))
        count = len(outs) if outs is not None else len(output.args[0])
        prev = [top.call_function(operator.getitem, (call, i)) for i in range(count)]
    top.output(tuple(prev))
    result = fx.GraphModule(root, top, class_name="Pipeline")
    result.meta.update(gm.meta)
    return result


def _stage_of_layer(layer_names: Sequence[str], ranges: Sequence[tuple[int, int]]
                    ) -> dict[str, int]:
    expected = 0
    out: dict[str, int] = {}
    for s, (start, end) in enumerate(ranges):
        if start != expected or end <= start:
            raise PlanError(
                f"plan stage {s} runs layers [{start}, {end}); stages must "
                f"be non-empty and contiguous from layer {expected}. fix: re-plan"
            )
        for i in range(start, end):
            out[layer_names[i]] = s
        expected = end
    if expected != len(layer_names):
        raise PlanError(
            f"the plan's stages cover {expected} layers, the model has {len(layer_names)} "
            f"({', '.join(layer_names[:3])}, ...). fix: plan for this model"
        )
    return out


def _owner(node: fx.Node, stage_of_layer: dict[str, int]) -> int | None:
    if node.op == "placeholder":
        spec: ChunkInput = node.meta[CHUNK_INPUT]
        if spec.kind not in ("key", "value", "state"):
            return None
    elif node.op != "call_function":
        return None
    else:
        info = node.meta.get(TOKEN)
        if info is None or info.role not in ("token", "mixing"):
            return None
    layer, part = node.meta.get(LAYER) or node.meta[CHUNK_INPUT].layer, node.meta.get(PART)
    if part and f"{layer}.{part}" in stage_of_layer:  # a block the plan cuts at its waist
        return stage_of_layer[f"{layer}.{part}"]
    if layer not in stage_of_layer:
        raise PassError(f"node {node.name!r} of layer {layer!r} has no sub-layer (meta "
                        f"{PART!r}), but the plan cuts that layer into parts")
    return stage_of_layer[layer]


def _closure(nodes: list[fx.Node], owner: dict[fx.Node, int | None], s: int,
             output: fx.Node | None) -> tuple[set[fx.Node], set[fx.Node]]:
    """(nodes stage ``s`` runs or reads, owned values it receives from earlier stages)."""
    local: set[fx.Node] = set()
    received: set[fx.Node] = set()
    todo = [n for n in nodes if owner[n] == s]
    todo += output.all_input_nodes if output is not None else []
    while todo:
        n = todo.pop()
        if n in local or n in received:
            continue
        o = owner[n]
        if o is not None and o < s and n.op != "placeholder":
            received.add(n)
            continue
        if o is not None and o > s:
            raise PassError(f"node {n.name!r} of stage {o} is read by stage {s}; layers must "
                            "be ordered in the graph as in the plan")
        local.add(n)
        todo.extend(n.all_input_nodes)
    return local, received


def _stage_module(gm: fx.GraphModule, nodes: list[fx.Node], owner: dict[fx.Node, int | None],
                  s: int, local: set[fx.Node], inputs: list[fx.Node],
                  outs: list[fx.Node] | None, output: fx.Node,
                  layers: tuple[str, ...]) -> fx.GraphModule:
    frontier = [n for n in nodes if n in local and n.op == "placeholder"
                and n.meta[CHUNK_INPUT].kind == "positional"]
    own = [n for n in nodes if n in local and n.op == "placeholder"]
    result = tuple(output.args[0] if outs is None else outs)
    stage = copy_subgraph(gm, local, result, inputs=[*inputs, *own], class_name="Stage")
    for n, ph in zip([*inputs, *own], stage.graph.find_nodes(op="placeholder"), strict=True):
        if n in frontier:
            ph.meta[CHUNK_INPUT] = dataclasses.replace(n.meta[CHUNK_INPUT],
                                                       index=frontier.index(n))
        elif n not in own:
            ph.meta[CHUNK_INPUT] = ChunkInput("boundary", n.name, axis=n.meta[TOKEN].axis)
    stage.add_submodule("tppc_positional", _prune(gm.tppc_positional,
                                                  [n.meta[CHUNK_INPUT].source for n in frontier]))
    buffers = tuple(n.name for n in nodes if n in local and n.op == "placeholder"
                    and n.meta[CHUNK_INPUT].kind in ("key", "value", "state"))
    stage.meta[STAGE_INFO] = StageInfo(
        index=s, layers=layers, inputs=tuple(n.name for n in inputs),
        outputs=tuple(n.name for n in outs) if outs is not None else (), buffers=buffers)
    stage.meta[CHUNK_SIGNATURE] = gm.meta[CHUNK_SIGNATURE]
    return stage


def _driver_placeholders(stage: fx.GraphModule) -> list[str]:
    return [p.name for p in stage.graph.find_nodes(op="placeholder")
            if p.meta[CHUNK_INPUT].kind != "boundary"]


def _prune(positional: fx.GraphModule, names: list[str]) -> fx.GraphModule:
    """A copy of the positional program that returns only the frontier values ``names``."""
    src_out = positional.graph.output_node()
    by_name = {n.name: n for n in src_out.args[0]}
    placeholders = list(positional.graph.find_nodes(op="placeholder"))
    return copy_subgraph(positional, list(positional.graph.nodes),
                         tuple(by_name[name] for name in names), inputs=placeholders,
                         class_name="PositionalProgram", prune=True)
