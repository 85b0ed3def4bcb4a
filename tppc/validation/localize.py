"""Localise a difference between an emitted program and its capture: the first diverging node.

Terms:
    per-layer replay: the failing check's chunk step emitted with one stage per layer (on the
        devices the failing program ran each layer on) and replayed on the same inputs and
        chunks, so that the values every layer hands to the next cross a stage boundary.
    boundary bisection: the boundary values of the per-layer replay (each stage's outputs, one
        chunk at a time) compared with the same nodes of the unsplit graph at the chunk's
        rows; the first stage whose outputs differ holds the diverging layer.
    node-by-node: that stage replayed once more for the diverging chunk with an
        :class:`fx.Interpreter` that keeps every node's value, compared in graph order with the
        same nodes of the unsplit graph (matched by :func:`tppc.validation.replay.origin`).

The error names the node, its op, its module path (``meta["nn_module_stack"]``), the layer and
the construct when it is a known one (a float attention bias, an in-place write into a slice,
a value made inside the graph and written in place).
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import fx

from tppc.backends.torch_local import chunk_rows as block_rows
from tppc.driver.emit import build_program
from tppc.errors import SoundnessError
from tppc.frontend.front_end import FrontEnd
from tppc.ir.records import CHUNK_INPUT
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.planner.manual import manual_plan
from tppc.program.program import Program
from tppc.validation.replay import (
    Difference,
    RecordingStage,
    Replay,
    StageFailed,
    chunk_rows,
    compare,
    origin,
    run_reference,
    token_info,
)

__all__ = ["construct_of", "describe", "raise_crash", "raise_divergence"]

_UNKNOWN = "not one of the known constructs"
_UNINITIALISED = {"empty", "new_empty", "empty_like", "empty_strided", "empty_permuted"}
_CREATORS = {"zeros", "zeros_like", "new_zeros", "full", "full_like", "new_full", "ones",
             "ones_like", "new_ones", *_UNINITIALISED}


@dataclass(frozen=True)
class _Divergence:
    """The first diverging value of a per-layer replay."""

    node: fx.Node          # in the captured graph
    emitted: str           # its name in the stage graph
    stage: int
    chunk: tuple[int, int]
    diff: Difference
    inside: bool           # found node by node (else: a boundary value of the stage)


def raise_divergence(front: FrontEnd, replay: Replay, index: int, diff: Difference, *,
                     label: str) -> NoReturn:
    """Raise :class:`SoundnessError` for output ``index`` of ``replay``, naming the first
    diverging node when the per-layer replay finds it."""
    what = (f"length {replay.length}, chunks {list(replay.chunks)}, stages "
            f"{[list(st.layers) for st in replay.program.stages]}"
            + (", after a one-chunk warm-up pass" if replay.warmup else ""))
    head = (f"{front.ctx.model_name}: the {label} ({what}) differs from the captured graph: "
            f"output {index} {describe(diff)}.")
    try:
        found = _first_divergence(front, replay)
    except StageFailed as failed:  # the per-layer replay crashes where the checked one did not
        raise_crash(front, _per_layer(front, replay), failed, label="per-layer replay")
    if found is None:
        raise SoundnessError(head + " A replay with one layer per stage does not reproduce it"
                             " (it depends on this placement)." + _fix(known=False),
                             max_diff=diff.max_abs)
    node = found.node
    module, cls = _module(node)
    layer = front.ctx.layers[found.stage].name  # the per-layer replay: stage s = layer s
    construct = construct_of(node)
    start, end = found.chunk
    where = (f"node {node.name!r} (op {node.target}, module {module or '<top level>'}"
             f"{f' ({cls})' if cls else ''}, layer {layer}"
             + (f", emitted as {found.emitted!r}" if found.emitted != node.name else "") + ")")
    level = ("every value before it in the layer agrees" if found.inside
             else "a value this layer sends on; no node inside it could be compared")
    raise SoundnessError(
        f"{head} First diverging value: {where}, chunk [{start}, {end}) of a replay with one "
        f"layer per stage: {describe(found.diff)}; {level}. Construct: {construct}."
        + _fix(known=not construct.startswith(_UNKNOWN)),
        node=node.name, op=str(node.target), module=module, layer=layer, construct=construct,
        max_diff=found.diff.max_abs)


def raise_crash(front: FrontEnd, replay: Replay, failed: StageFailed, *,
                label: str) -> NoReturn:
    """Raise :class:`SoundnessError` for a stage of ``replay`` that raised: the emitted program
    cannot run what the captured graph runs, so it is unsound for this model."""
    start, end = failed.rows
    what = (f"length {replay.length}, chunks {list(replay.chunks)}, stages "
            f"{[list(st.layers) for st in replay.program.stages]}"
            + (", after a one-chunk warm-up pass" if replay.warmup else ""))
    error = f"{type(failed.error).__name__}: {str(failed.error).strip().splitlines()[0]}"
    head = (f"{front.ctx.model_name}: the {label} ({what}) crashed in stage {failed.stage} "
            f"(layers {list(failed.layers)}), chunk [{start}, {end}): {error}.")
    emitted = failed.node
    node = _match(_origins(front), emitted) if emitted is not None else None
    if node is None:
        where = f" At stage node {emitted.name!r} ({emitted.target})." if emitted else ""
        raise SoundnessError(head + where + _fix(known=False), node=None)
    module, cls = _module(node)
    construct = construct_of(node)
    raise SoundnessError(
        f"{head} Failing node: {node.name!r} (op {node.target}, module "
        f"{module or '<top level>'}{f' ({cls})' if cls else ''}"
        + (f", emitted as {emitted.name!r}" if emitted.name != node.name else "")
        + f"). Construct: {construct}." + _fix(known=not construct.startswith(_UNKNOWN)),
        node=node.name, op=str(node.target), module=module, construct=construct)


def _fix(*, known: bool) -> str:
    skip = "or compile with verify=False to keep this pipeline although its outputs differ."
    if known:
        return (" fix: rewrite that construct in the model (the README's refusal table lists "
                f"the known ones), {skip}")
    return (" fix: this is a tppc bug for an ordinary op: report it with this message, "
            f"{skip}")


def describe(diff: Difference) -> str:
    """``max |diff| 0.13 (tolerance 0.00014)``, with the relative norm where it counts."""
    text = f"max |diff| {diff.max_abs:.3g} (tolerance {diff.tolerance:.3g}"
    if diff.norm_tolerance is not None:
        text += f"; relative norm {diff.rel_norm:.3g}, tolerance {diff.norm_tolerance:.3g}"
    return text + ")"


def _first_divergence(front: FrontEnd, failing: Replay) -> _Divergence | None:
    """Bisect the boundaries of a per-layer replay, then compare node by node."""
    replay = _per_layer(front, failing)
    sent: dict[tuple[int, int], tuple[Any, ...]] = {}
    got = replay.run(hook=lambda s, m, values: sent.__setitem__((s, m), values))
    origins = _origins(front)
    last = len(replay.program.stages) - 1
    pairs = {}  # (s, m) -> [(emitted node, captured node)] of the stage's boundary outputs
    for (s, m) in sent:
        if s < last:
            outs = _output_nodes(replay.stage(s, m).module)
            pairs[s, m] = [(n, _match(origins, n)) for n in outs]
    wanted = {c.name for pair in pairs.values() for _, c in pair if c is not None}
    outputs, values = run_reference(front.annotated, replay.flat, wanted)
    for s in range(last):
        for m, chunk in enumerate(replay.chunks):
            for k, (emitted, captured) in enumerate(pairs.get((s, m), ())):
                if captured is None:
                    continue
                want = chunk_rows(values[captured.name], sent[s, m][k], token_info(captured),
                                  chunk[0], replay.length)
                diff = compare(sent[s, m][k], want)
                if want is not None and diff.exceeds:
                    inside = _inside(front, replay, s, [m], origins)
                    return inside or _Divergence(captured, emitted.name, s, chunk, diff,
                                                 inside=False)
    if not any(compare(a, b).exceeds for a, b in zip(got, outputs, strict=False)):
        return None
    return _inside(front, replay, last, list(range(len(replay.chunks))), origins)


def _inside(front: FrontEnd, replay: Replay, s: int, chunks: list[int],
            origins: _Origins) -> _Divergence | None:
    """The first node of stage ``s`` whose value differs, trying ``chunks`` in order."""
    for m in chunks:
        stage = replay.stage(s, m)
        recorder = RecordingStage(stage.runnable)
        replay.run(swap={(s, m): dataclasses.replace(stage, runnable=recorder)})
        graph = recorder.graph_module.graph
        matched = [(n, _captured(n, origins, front)) for n in graph.nodes if n.op != "output"]
        wanted = {c.name for _, c in matched if c is not None}
        _, values = run_reference(front.annotated, replay.flat, wanted)
        start, end = replay.chunks[m]
        for emitted, captured in matched:
            if captured is None or emitted.name not in recorder.values \
                    or _op_name(captured) in _UNINITIALISED:
                continue
            got = recorder.values[emitted.name]
            want = _rows_of(emitted, captured, values[captured.name], got, start, end,
                            replay.length)
            diff = compare(got, want)
            if want is not None and diff.exceeds:
                return _Divergence(captured, emitted.name, s, (start, end), diff, inside=True)
    return None


_Origins = dict[tuple[str, int], list[fx.Node]]


def _origins(front: FrontEnd) -> _Origins:
    """The captured nodes by origin; one op that export decomposed (``chunk`` into a
    ``split`` and its ``getitem``s) is the origin of several."""
    found: _Origins = {}
    for n in front.annotated.graph.nodes:
        found.setdefault(origin(n), []).append(n)
    return found


def _match(origins: _Origins, node: fx.Node) -> fx.Node | None:
    """The captured node ``node`` was copied (or rewritten: SDPA into ``chunk_attention``)
    from: its origin's node, or of several the one with its op (a ``getitem``: its index),
    else of its name (None when that does not decide: the value is not compared)."""
    found = origins.get(origin(node), [])
    same = [n for n in found if n.target == node.target
            and (n.target is not operator.getitem or n.args[1:] == node.args[1:])]
    if len(found) == 1 or len(same) == 1:
        return (same or found)[0]
    return next((n for n in found if n.name == node.name), None)


def _captured(node: fx.Node, origins: _Origins, front: FrontEnd) -> fx.Node | None:
    """The captured-graph node a stage node computes, or None (tppc's own nodes, inputs)."""
    if node.op == "placeholder":
        spec = node.meta.get(CHUNK_INPUT)
        if spec is None or spec.kind != "positional":
            return None
        return _by_name(front.annotated, spec.source)
    if node.op != "call_function":
        return None
    return _match(origins, node)


def _by_name(gm: fx.GraphModule, name: str) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.name == name), None)


def _rows_of(emitted: fx.Node, captured: fx.Node, full: Any, got: Any, start: int, end: int,
             length: int) -> Any:
    spec = emitted.meta.get(CHUNK_INPUT) if emitted.op == "placeholder" else None
    if spec is not None and isinstance(full, torch.Tensor):
        return full if spec.axis is None else block_rows(full, spec, start, end, length)
    return chunk_rows(full, got, token_info(captured), start, length)


def _per_layer(front: FrontEnd, failing: Replay) -> Replay:
    """The failing replay's chunk step emitted with one stage per layer (see module)."""
    names = [layer.name for layer in front.ctx.layers]
    seq_len = failing.program.seq_len
    plan = manual_plan(names, seq_len, cuts=tuple(range(len(names) + 1)),
                       boundaries=(0, seq_len))
    devices = [_device_of(failing.program, name) for name in names]
    program = build_program(front.chunk, front.ctx, plan, plan.chunks, devices)
    rest = front.chunk.meta.get(REST_CHUNK) if failing.rest is not None else None
    rest_program = (build_program(rest, front.ctx, plan, failing.chunks, devices)
                    if rest is not None else None)
    return Replay(program, rest_program, failing.flat, failing.length, failing.chunks,
                  warmup=failing.warmup)


def _device_of(program: Program, layer: str) -> torch.device:
    for st in program.stages:
        if any(name == layer or name.startswith(layer + ".") for name in st.layers):
            return st.device
    return program.stages[0].device


def _output_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    out = gm.graph.output_node().args[0]
    return [n for n in (out if isinstance(out, list | tuple) else [out])
            if isinstance(n, fx.Node)]


def _module(node: fx.Node) -> tuple[str, str]:
    """``(module path, class name)`` of the innermost module that made ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return path, name


def _op_name(node: fx.Node) -> str:
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", getattr(target, "__name__", str(target)))


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and bool(getattr(node.target, "is_view", False))


def construct_of(node: fx.Node) -> str:
    """A known construct at (or just before) a diverging captured node, in words."""
    if _op_name(node) == "scaled_dot_product_attention":
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        val = mask.meta.get("val") if isinstance(mask, fx.Node) else None
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            return (f"an additive float attention bias ({mask.name!r} passed as attn_mask; "
                    "ALiBi-style): tppc evaluates its rows per chunk over the keys the chunk "
                    "sees; a query that sees no key (all hidden by a finite minimum: a padded "
                    "query) averages every key's value in the model, later keys included, "
                    "which a causal chunk cannot see")
    write = _written_in_place(node)
    if write is not None:
        base, writer = write
        if _op_name(base) in _CREATORS:
            return (f"a value made inside the graph by {_op_name(base)} ({base.name!r}) and "
                    f"then written in place ({writer.target} at {writer.name!r}): the writes "
                    "do not reach the emitted program")
        return (f"an in-place write into a slice of {base.name!r} ({writer.target} at "
                f"{writer.name!r}, as in x[..., n:] = f(x[..., n:])): the write does not "
                "reach the emitted program")
    if token_info(node) is not None and token_info(node).role == "mixing":
        return f"{_UNKNOWN} (attention, {node.target})"
    return f"{_UNKNOWN} (op {node.target})"


def _written_in_place(node: fx.Node, depth: int = 4) -> tuple[fx.Node, fx.Node] | None:
    """``(value, writer)``: the nearest value ``node`` reads (or ``node`` itself, up to
    ``depth`` inputs back) that an op writes in place, directly or through a view."""
    frontier, seen = [node], {node}
    for _ in range(depth + 1):
        for value in frontier:
            views, todo = [], [value]
            while todo:
                v = todo.pop()
                views.append(v)
                todo.extend(u for u in v.users if _is_view(u) and u not in views)
            for v in views:
                writer = next((u for u in v.users if _mutates(u) and u.args and u.args[0] is v),
                              None)
                if writer is not None:
                    return value, writer
        frontier = [a for n in frontier for a in n.all_input_nodes if a not in seen]
        seen.update(frontier)
    return None
