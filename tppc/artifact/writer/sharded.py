"""Tensor-parallel stages in an artifact: one ONNX graph per part of every worker's shard.

Terms:
    worker: rank ``r`` of stage ``s``'s tensor-parallel group (``Program.workers``); its
        entry in ``plan.json["workers"]`` holds ``stage``, ``rank``, its ``joins`` (the
        group's collective after each part but the last, ``[kind, dims]``) and its
        ``parts``.
    part: a worker's shard cut at its collectives; each is written like a stage
        (``stage_<s>.tp<r>.part<p>.onnx``, only that shard's weights, with its positional
        program) and its entry has a stage entry's fields. A part's outputs are
        ``carry.<j>`` (the slot the collective after it runs on: the partial sum or the cut
        value first, the values passed through after), the last part's are the stage's
        ``boundary.<name>`` values, or the model's ``output.<j>`` on the last stage.

The runner (:mod:`tppc.artifact.core.loaded`) lowers the same lists as
:func:`tppc.program.sharded.sharded_lists` from ``stage``, ``parts`` and ``joins``, and runs
them through THE interpreter with numpy collectives (:mod:`tppc.program.collectives`).

Example:
    >>> workers = write_workers(program, out, files, None, _write_stage, None)  # doctest: +SKIP
    >>> [(w["stage"], w["rank"], len(w["parts"])) for w in workers]
    [(0, 0, 3), (0, 1, 3), (1, 0, 4), (1, 1, 4)]
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from tppc.errors import ExportError
from tppc.passes.subgraph import copy_graph

__all__ = ["part_outputs", "write_workers"]


def part_outputs(program: Any, worker: Any, p: int) -> tuple[str, ...]:
    """The output names of part ``p`` of ``worker`` (see the module docstring)."""
    part = worker.part(p)
    if p < max(1, len(worker.parts)) - 1:
        out = next(iter(part.module.graph.find_nodes(op="output")))
        return tuple(f"carry.{j}" for j in range(len(out.args[0])))
    if worker.index == len(program.stages) - 1:
        return tuple(f"output.{j}" for j in range(len(program.signature.output_axes)))
    return tuple(f"boundary.{n}" for n in part.boundary_out)


def write_workers(program: Any, out: Path, files: dict[str, dict[str, Any]],
                  progress: Callable[[str], None] | None, write_stage: Callable[..., Any],
                  external: bool | None) -> list[dict[str, Any]]:
    """Write every part of every worker of ``program``; returns ``plan.json["workers"]``.

    ``write_stage(stage, program, out, external, files, variant, outputs)`` writes one part
    (:func:`tppc.artifact.writer.write._write_stage`)."""
    if getattr(program, "meshes", ()):
        raise ExportError(
            f"the program's stages run on meshes {list(program.meshes)} (cfg, ring or ulysses "
            "above 1); an artifact holds tensor-parallel workers only. fix: export a plan with "
            "cfg_parallel=1, ring=1 and ulysses=1 (tensor_parallel may stay)")
    workers = []
    for worker in program.workers:
        t0 = time.perf_counter()
        parts, received = [], None
        for p in range(max(1, len(worker.parts))):
            variant = f".tp{worker.rank}.part{p}"
            part, vals = _named(worker.part(p), worker.rank, received)
            degree = sum(w.index == worker.index for w in program.workers)
            received = _joined(vals, worker.joins[p], degree) if p < len(worker.joins) \
                else None
            parts.append(write_stage(part, program, out, external, files, variant,
                                     part_outputs(program, worker, p)))
        workers.append({"stage": worker.index, "rank": worker.rank,
                        "joins": [[kind, list(dims)] for kind, dims in worker.joins],
                        "parts": parts, "param_count": worker.param_count,
                        "param_bytes": worker.param_bytes})
        if progress is not None:
            size = sum(files[f]["size"] for e in parts for f in e["files"])
            progress(f"stage {worker.index} rank {worker.rank}: {len(parts)} part(s), "
                     f"{worker.param_count:,} parameters, {size / 2**20:.1f} MiB, "
                     f"{time.perf_counter() - t0:.1f} s")
    return workers


def _named(part: Any, rank: int, received: list[Any] | None) -> tuple[Any, list[Any]]:
    """``part`` ready for export, and the shapes of its outputs (fake tensors).

    Its K/V buffers are named ``<name>_tp<rank>`` in its graph, its inputs and its buffer
    specs (a shard's graph calls them by the unsharded name, its specs ``<name>@tp<rank>``;
    the artifact needs one name, distinct per rank). Its graph's ``meta["val"]`` are
    propagated again from the shard's sizes (the sharding pass leaves the unsharded ones,
    which the ONNX translation reads): the buffers' per-rank shapes, and ``received``, the
    values the collective before it hands on (None: the whole values its stage receives).
    """
    gm = copy_graph(part.module)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    specs = {b.name: b for b in part.buffers}
    renamed: dict[str, str] = {}
    inputs, args = [], []
    boundary = iter(received) if received is not None else None
    mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    chunk = next(s for n in placeholders for s in getattr(n.meta.get("val"), "shape", ())
                 if isinstance(s, torch.SymInt))
    start, capacity = _symbol(mode, "chunk_start", 16), _symbol(mode, "capacity", 4096)
    had = {n for n in gm.graph.nodes if "val" in n.meta}
    for node, (name, spec) in zip(placeholders, part.inputs, strict=True):
        val = node.meta.get("val")
        if spec.kind in ("key", "value"):
            b = specs[name]
            with mode:
                val = torch.empty([capacity if s is None else s for s in b.shape],
                                  dtype=b.dtype)
            new = f"{name.split('@')[0]}_tp{rank}"
            renamed[name] = new
            node.name = node.target = new
            name = new
        elif spec.kind == "boundary" and boundary is not None:
            val = next(boundary)
        elif spec.kind == "chunk_start":
            val = start
        elif spec.kind == "chunk_size":
            val = chunk
        elif spec.kind == "seq_len":
            val = _symbol(mode, "seq_len", 4096)
        inputs.append((name, spec))
        args.append(val)
    try:
        _propagate(gm, mode, args)
    except Exception as exc:
        raise ExportError(f"stage {part.index} rank {rank}: the sizes of its shard could not "
                          f"be propagated through its graph ({type(exc).__name__}: "
                          f"{str(exc)[:200]}). fix: report the model, or export with "
                          "tensor_parallel=1") from exc
    output = next(iter(gm.graph.find_nodes(op="output")))
    outs = [a.meta.get("val") for a in output.args[0]]
    for node in gm.graph.nodes:  # the translation reads the sizes the capture recorded
        if node not in had:
            node.meta.pop("val", None)
    gm.recompile()
    buffers = tuple(dataclasses.replace(b, name=renamed.get(b.name, b.name))
                    for b in part.buffers)
    return dataclasses.replace(part, module=gm, runnable=gm, inputs=tuple(inputs),
                               buffers=buffers), outs


def _symbol(mode: Any, name: str, hint: int) -> torch.SymInt:
    """A fresh size symbol of ``mode``'s shape environment (a chunk start, a capacity)."""
    from torch._dynamo.source import ConstantSource

    env = mode.shape_env
    return env.create_symintnode(env.create_symbol(hint, ConstantSource(name)), hint=hint)


def _propagate(gm: torch.fx.GraphModule, mode: Any, args: list[Any]) -> None:
    """``meta["val"]`` of every node from ``args`` (fake tensors and sizes of ``mode``)."""
    allowed = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True  # the shard's own weights are real tensors
    try:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
    finally:
        mode.allow_non_fake_inputs = allowed


def _joined(vals: list[Any], join: tuple[str, tuple[int, ...]], degree: int) -> list[Any]:
    """What the next part receives: the collective ``join`` of a group of ``degree`` on the
    first value (an all-gather joins the members' parts along its axis), the rest passed
    through."""
    kind, dims = join
    head = vals[0]
    if kind == "all_gather":
        with detect_fake_mode([head]):
            head = torch.cat([head] * degree, dims[0])
    elif kind != "all_reduce":
        raise ExportError(f"a {kind} between the parts of a shard: tppc exports all-reduce "
                          "and all-gather joins only. fix: export with tensor_parallel=1")
    return [head, *vals[1:]]
