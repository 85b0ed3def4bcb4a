"""Emit: partition a chunk-step graph by a plan, place each stage, let the last stage write
its outputs in place (:mod:`tppc.passes.stages.direct_output`): a
:class:`~tppc.program.program.Program`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx

from tppc.errors import SpecError
from tppc.ir.context import CompileContext
from tppc.ir.records import CHUNK_INPUT, CHUNK_SIGNATURE, STAGE_INFO, ChunkSignature
from tppc.passes.runner import run_passes
from tppc.passes.stages.direct_output import write_outputs_in_place
from tppc.passes.stages.partition_stages import partition_stages
from tppc.passes.subgraph import copy_graph
from tppc.planner.plan import Plan, StagePlan
from tppc.program.program import BufferSpec, Program, StageProgram
from tppc.program.schedule import flow_shop

__all__ = ["build_program", "device_for"]


def build_program(chunk: fx.GraphModule, ctx: CompileContext, plan: Plan,
                  chunks: tuple[tuple[int, int], ...] | None = None,
                  devices: Sequence[str | torch.device] | None = None) -> Program:
    """Partition ``chunk`` (a chunk-step graph) by ``plan`` and place each stage.

    Every stage gets its own parameter tensors: on its device they alias the model's storage
    (nothing is copied or moved), on another device they are copies, so the user's model is
    never modified and tied weights used by two stages on two devices are duplicated.

    Args:
        chunk: output of ``chunk_attention_pass``.
        ctx: the compile context (``ctx.layers`` indexes the plan's layers).
        plan: placement and split.
        chunks: the call's chunks (default: the plan's).
        devices: one torch device per stage (default: see :func:`device_for`).
    """
    ranges = [(st.layer_start, st.layer_end) for st in plan.stages]
    names = [name for st in plan.stages for name in st.layer_names]
    graph = run_passes(chunk, ctx, [partition_stages(ranges, names)])
    signature: ChunkSignature = chunk.meta[CHUNK_SIGNATURE]
    stages = tuple(_stage(getattr(graph, f"stage_{s}"), device_for(st, s, devices), signature)
                   for s, st in enumerate(plan.stages))
    tail = getattr(chunk, "tppc_tail", None)
    if tail is not None:  # a copy with its own module tree (the chunk graph's stays as is)
        tail = _own_tensors(copy_graph(tail), stages[-1].device)
    chunks = chunks or plan.chunks
    return Program(plan=plan, seq_len=plan.seq_len, chunks=chunks, stages=stages,
                   signature=signature, tail=tail, actions=flow_shop(chunks, len(stages)))


def _stage(module: fx.GraphModule, device: torch.device, signature: ChunkSignature
           ) -> StageProgram:
    module = _own_tensors(module, device)
    info = module.meta[STAGE_INFO]
    inputs = tuple((p.name, p.meta[CHUNK_INPUT]) for p in module.graph.find_nodes(op="placeholder"))
    buffers = tuple(
        BufferSpec(name=name, kind=spec.kind, attention=spec.source, layer=spec.layer,
                   axis=int(spec.axis), shape=spec.shape, dtype=spec.dtype,
                   scale=spec.scale, prefix=spec.prefix, suffix=spec.suffix)
        for name, spec in inputs if spec.kind in ("key", "value"))
    runnable, slots = module, {}
    if not info.outputs:  # the last stage: its outputs are the model's
        runnable, slots = write_outputs_in_place(module, signature.output_axes)
    tensors = [*module.parameters(), *module.buffers()]
    return StageProgram(
        index=info.index, device=device, layers=info.layers, module=module, runnable=runnable,
        positional=module.tppc_positional, inputs=inputs, boundary_in=info.inputs,
        boundary_out=info.outputs, buffers=buffers, out_slots=tuple(slots.values()),
        param_count=sum(p.numel() for p in module.parameters()),
        param_bytes=sum(t.numel() * t.element_size() for t in tensors))


def _own_tensors(module: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """Give ``module`` (and its submodules) new tensor objects on ``device``."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(_on(param, device), requires_grad=False)
        for name, buf in list(sub.named_buffers(recurse=False)):
            sub._buffers[name] = _on(buf, device)
    return module


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = tensor.detach()
    return data if data.device == device else data.to(device, copy=True)


def device_for(stage: StagePlan, s: int, devices: Sequence[str | torch.device] | None
               ) -> torch.device:
    """The torch device of stage ``s``: ``devices[s]``, ``cpu`` for CPU presets, else CUDA."""
    if devices is not None:
        if len(devices) < s + 1:
            raise SpecError(f"devices={list(devices)} names {len(devices)} devices, the plan "
                            f"has more stages. fix: give one device per stage")
        return torch.device(devices[s])
    if stage.device_name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > stage.device_index:
        return torch.device("cuda", stage.device_index)
    raise SpecError(
        f"stage {s} is planned for a {stage.device_name}, but cuda:{stage.device_index} is not "
        f"available here. fix: pass devices=['cpu', ...] to run the stages on this machine")
