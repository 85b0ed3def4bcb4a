"""Pass: group nodes into ordered layers (writes ``meta[LAYER]`` and ``ctx.layers``).

Blocks are the children of the outermost module list with at least two numbered children
(``model.layers.0``, ``model.layers.1``, ... found in ``nn_module_stack``). Nodes before the
first block form the ``prologue``, nodes after the last one the ``epilogue``; a node between
two blocks that belongs to neither joins the block before it. Parameters belong to every
layer that reads them (through ``get_attr``). Token values that skip layers (HunyuanDiT's long
skips, block i -> block N-i) are an output of their layer, an input of their reader's, and
``through`` every layer in between.

A block with a waist (one token value live across a point of it: the residual stream
between attention and MLP) also gets two sub-layers, ``LayerInfo.parts`` (``<block>.attn``,
``<block>.mlp``; each node's suffix in ``meta[PART]``), where a plan may cut it.

Example:
    >>> group_layers_pass(gm, ctx)                                       # doctest: +SKIP
    >>> [layer.name for layer in ctx.layers]
    ['prologue', 'blocks.0', 'blocks.1', 'epilogue']
"""

from __future__ import annotations

import dataclasses
import operator
import re
from collections import Counter, defaultdict

import torch
from torch import fx

from tppc.errors import AnnotationError
from tppc.ir.context import CompileContext
from tppc.ir.op_rules import op_rule
from tppc.ir.records import LAYER, TOKEN, LayerInfo
from tppc.passes.annotation.waist import find_waist, mark_parts, part_names
from tppc.passes.shapes import source_line

__all__ = ["group_layers_pass"]

_NUMBERED = re.compile(r"^(?P<prefix>.+)\.(?P<index>\d+)$")
_OPS = ("call_function", "call_method", "call_module")


def group_layers_pass(gm: fx.GraphModule, ctx: CompileContext) -> fx.GraphModule:
    """Assign every node to a layer and record the layers on ``ctx.layers``."""
    prefix = _block_prefix(gm)
    nodes = list(gm.graph.nodes)
    block_of = {n: _block_name(n, prefix) for n in nodes if n.op in _OPS}
    order = [b for b in dict.fromkeys(block_of.values()) if b is not None]
    if not order:
        raise AnnotationError(
            f"no repeated blocks found in {ctx.model_name}: tppc pipelines models whose layers "
            "live in an nn.ModuleList (model.layers.0, model.layers.1, ...). fix: keep the "
            "transformer blocks in an nn.ModuleList"
        )
    names = _assign(nodes, block_of, order)
    for node, name in names.items():
        node.meta[LAYER] = name
    ctx.layers = _with_parts(gm, nodes, names, order, _layer_infos(gm, nodes, names, order))
    return gm


def _with_parts(gm: fx.GraphModule, nodes: list[fx.Node], names: dict[fx.Node, str],
                order: list[str], infos: list[LayerInfo]) -> list[LayerInfo]:
    """``infos`` with each block's two sub-layers (``LayerInfo.parts``) where it has a waist
    (:mod:`tppc.passes.annotation.waist`); marks their nodes' ``meta[PART]``."""
    rank = {info.name: info.index for info in infos}
    output = nodes[-1]
    fine = dict(names)
    fine_order: list[str] = []
    split: dict[str, tuple[str, str]] = {}
    for name in order:
        own = [n for n in nodes if names.get(n) == name and n.op not in ("placeholder", "get_attr")]
        after = {n for n in nodes if rank.get(names.get(n, ""), -1) > rank[name]} | {output}
        cut = find_waist(own, after, gm)
        if cut is None:
            fine_order.append(name)
            continue
        suffixes = part_names(own, cut)
        mark_parts(own, cut, suffixes)
        split[name] = (f"{name}.{suffixes[0]}", f"{name}.{suffixes[1]}")
        fine_order.extend(split[name])
        for i, node in enumerate(own):
            fine[node] = split[name][0 if i <= cut else 1]
    if not split:
        return infos
    for node in nodes:
        if node.op in ("placeholder", "get_attr") and names.get(node) in split:
            fine[node] = split[names[node]][0]
    by_name = {info.name: info for info in _layer_infos(gm, nodes, fine, fine_order)}
    return [dataclasses.replace(info, parts=tuple(
        dataclasses.replace(by_name[p], index=info.index) for p in split[info.name]))
        if info.name in split else info for info in infos]


def _block_prefix(gm: fx.GraphModule) -> set[str]:
    """The module lists whose numbered children are the blocks.

    Lists whose children hold attention (``mixing`` nodes) win, all of the outermost such
    ones (Flux: ``transformer_blocks`` then ``single_transformer_blocks``); without any,
    the outermost, longest list with at least two children. So a DiT's
    ``t_mlp = nn.Sequential(...)`` never wins over its attention ``blocks``.
    """
    counts: dict[str, set[int]] = defaultdict(set)
    attention: set[str] = set()
    for node in gm.graph.nodes:
        info = node.meta.get(TOKEN)
        for path in _module_paths(node):
            match = _NUMBERED.match(path)
            if match:
                counts[match["prefix"]].add(int(match["index"]))
                if info is not None and info.role == "mixing":
                    attention.add(match["prefix"])
    if not counts:
        return set()
    if attention:
        depth = min(p.count(".") for p in attention)
        return {p for p in attention if p.count(".") == depth}
    repeated = [p for p in counts if len(counts[p]) >= 2] or list(counts)
    return {min(repeated, key=lambda p: (p.count("."), -len(counts[p])))}


def _block_name(node: fx.Node, prefixes: set[str]) -> str | None:
    for path in _module_paths(node):
        match = _NUMBERED.match(path)
        if match and match["prefix"] in prefixes:
            return path
    return None


def _module_paths(node: fx.Node) -> list[str]:
    """Module paths enclosing the node, outermost first (``blocks``, ``blocks.0``, ...)."""
    paths = [path for path, _cls in (node.meta.get("nn_module_stack") or {}).values() if path]
    if node.op == "call_module":
        parts = str(node.target).split(".")
        paths += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return paths


def _assign(nodes: list[fx.Node], block_of: dict[fx.Node, str | None],
            order: list[str]) -> dict[fx.Node, str]:
    first = next(i for i, n in enumerate(nodes) if block_of.get(n))
    last = max(i for i, n in enumerate(nodes) if block_of.get(n))
    names: dict[fx.Node, str] = {}
    current = "prologue"
    for i, node in enumerate(nodes):
        if node.op in ("placeholder", "get_attr"):
            continue
        block = block_of.get(node)
        if block:
            current = block
        elif i < first:
            current = "prologue"
        elif i > last:
            current = "epilogue"
        names[node] = current
        info = node.meta.get(TOKEN)
        if info is not None and info.role == "global" and current != "epilogue":
            raise AnnotationError(
                f"node {node.name!r} (module {info.module or '<top level>'}, "
                f"{source_line(node)}) needs the whole sequence (role global: "
                f"{info.why or _why_global(node)}) but runs in layer {current!r}; tppc runs a "
                "block chunk by chunk, so it can run such ops only after the last block."
                + ("" if "fix:" in info.why else " The model cannot be pipelined by tokens as "
                   "written (refused before anything ran). fix: in a model of your own, move "
                   "the op after the last block; a library model runs unsplit (eager or "
                   "torch.compile)"))
    for node in nodes:
        if node.op in ("placeholder", "get_attr"):
            users = [names[u] for u in node.users if u in names]
            names[node] = users[0] if users else "prologue"
    return names


def _why_global(node: fx.Node) -> str:
    """What a ``global`` node does to the token axis, from its op's rule."""
    role = op_rule(node.target).role if node.op == "call_function" else ""
    if role == "reduction":
        return (f"{getattr(node.target, '__name__', node.target)} over the token axis, which "
                "every chunk would need whole; a linear attention's normaliser outside its "
                "matmul is one (tppc buffers only a matmul that contracts two token values: "
                "fold the normaliser into it, phi(K)^T [V, 1], as Sana's processor does)")
    what = {"selects": "selects part of the token axis", "reshape": "reorders the tokens"}
    return what.get(role, "changes or loses the token axis")


def _layer_infos(gm: fx.GraphModule, nodes: list[fx.Node], names: dict[fx.Node, str],
                 order: list[str]) -> list[LayerInfo]:
    layer_names = [n for n in ["prologue", *order, "epilogue"] if n in set(names.values())]
    rank = {name: i for i, name in enumerate(layer_names)}
    members: dict[str, list[fx.Node]] = defaultdict(list)
    for node in nodes:
        members[names[node]].append(node)
    infos = []
    for index, name in enumerate(layer_names):
        own = [n for n in members[name] if n.op not in ("placeholder", "get_attr")]
        params = _params(gm, own)
        attn = [n for n in own if n.meta[TOKEN].role == "mixing"]
        infos.append(LayerInfo(
            index=index, name=name,
            kind="prologue" if name == "prologue" else "epilogue" if name == "epilogue" else "block",
            nodes=tuple(n.name for n in own),
            params=tuple(params),
            param_count=sum(t.numel() for t in params.values() if isinstance(t, torch.nn.Parameter)),
            param_bytes=sum(t.numel() * t.element_size() for t in params.values()),
            attention_nodes=tuple(n.name for n in attn),
            attention_kinds=tuple(n.meta[TOKEN].attention for n in attn),
            inputs=tuple(_crossing(own, names, rank, name, incoming=True)),
            outputs=tuple(_crossing(own, names, rank, name, incoming=False)),
            through=tuple(_through(nodes, names, rank, index)),
        ))
    return infos


def _through(nodes: list[fx.Node], names: dict[fx.Node, str], rank: dict[str, int],
             layer: int) -> list[str]:
    """Token values produced before layer ``layer`` and read after it (skip connections)."""
    out = []
    for node in nodes:
        if node.op == "placeholder" or node.meta[TOKEN].role not in ("token", "mixing"):
            continue
        readers = [rank.get(names.get(u, ""), -1) for u in node.users if u.op != "output"]
        if rank.get(names.get(node, ""), layer) < layer < max(readers, default=-1):
            out.append(node.name)
    return out


def _params(gm: fx.GraphModule, own: list[fx.Node]) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for node in own:
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                found[str(arg.target)] = operator.attrgetter(str(arg.target))(gm)
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
                found[f"{node.target}.{name}"] = tensor
    return found


def _crossing(own: list[fx.Node], names: dict[fx.Node, str], rank: dict[str, int],
              name: str, *, incoming: bool) -> list[str]:
    out: Counter[str] = Counter()
    for node in own:
        for other in (node.all_input_nodes if incoming else list(node.users)):
            src, dst = (other, node) if incoming else (node, other)
            if src.meta[TOKEN].role not in ("token", "mixing"):
                continue
            if dst.op == "output" and not incoming:
                out[src.name] += 1
            elif src.op == "placeholder" and incoming:
                out[src.name] += 1
            elif names.get(src) != names.get(dst) and rank.get(names[src], -1) < rank.get(names[dst], -1):
                out[src.name] += 1
    return list(out)
