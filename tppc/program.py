"""The emitted program of one sequence length: what every backend runs and export writes.

Terms:
    program: the stage graphs of one plan on their devices, the chunk boundaries, and how
        every stage input is fed (the wiring). Immutable and free of per-call state: the
        K/V buffers, positional values and fill level of a call live in a
        :class:`tppc.runtime.state.CallState`, so one program serves concurrent calls.
    stage program: one stage graph with its own parameter tensors on its device, its
        positional program, its inputs in order (:class:`tppc.ir.ChunkInput` each), the K/V
        buffers it owns (:class:`BufferSpec`) and, on the last stage, the outputs it writes
        in place (out slots).
    wiring: stage ``s`` receives the boundary values ``boundary_in`` from stage ``s - 1``
        (in that order) and sends ``boundary_out`` to stage ``s + 1``; every other input is
        fed from the call (a chunk of a user input, a positional slice, a buffer, an int).

Example:
    >>> program = build_program(chunk_gm, ctx, plan)                     # doctest: +SKIP
    >>> [(st.index, st.layers, [b.name for b in st.buffers]) for st in program.stages]
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.backends._direct_output import OutSlot, write_outputs_in_place
from tppc.context import CompileContext
from tppc.errors import SpecError
from tppc.ir import CHUNK_INPUT, CHUNK_SIGNATURE, STAGE_INFO, ChunkInput
from tppc.passes.chunk_attention import ChunkSignature
from tppc.passes.partition_stages import partition_stages
from tppc.passes.runner import run_passes
from tppc.planner.plan import Plan, StagePlan
from tppc.planner.schedule import Actions, flow_shop

__all__ = ["BufferSpec", "Program", "StageProgram", "build_program", "device_for"]


@dataclass(frozen=True)
class BufferSpec:
    """One K or V buffer a stage owns.

    Attributes:
        name: its placeholder name in the stage graph.
        kind: ``"key"`` or ``"value"``.
        attention: the attention node it belongs to.
        layer: the layer that owns it.
        axis: its token axis.
        shape: its shape with ``None`` at the token axis.
        dtype: its element type.
        scale: token rows per unit of the sequence (a DiT's patch columns; 1 for LLMs).
        prefix: rows of the unsplit text segment before them (joint attention).
    """

    name: str
    kind: str
    attention: str
    layer: str
    axis: int
    shape: tuple[int | None, ...]
    dtype: torch.dtype
    scale: int = 1
    prefix: int = 0

    def rows(self, capacity: int) -> int:
        """Rows of the token axis for ``capacity`` units of the sequence."""
        return self.prefix + self.scale * capacity

    def allocate(self, capacity: int, device: torch.device) -> torch.Tensor:
        """A zero buffer of ``capacity`` tokens on ``device``."""
        shape = [self.rows(capacity) if s is None else s for s in self.shape]
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def nbytes(self, capacity: int) -> int:
        """Bytes of a buffer of ``capacity`` tokens."""
        n = self.rows(capacity)
        for s in self.shape:
            n *= 1 if s is None else s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StageProgram:
    """One stage (see the module docstring).

    Attributes:
        index: stage number.
        device: where it runs.
        layers: names of its layers.
        module: the stage graph (its own parameter tensors on ``device``).
        runnable: what runs: ``module``, or the last stage's copy that writes out slots.
        positional: its positional program (frontier values at the full length).
        inputs: ``(placeholder name, ChunkInput)`` of ``module``, in order.
        boundary_in: names of the boundary values it receives, in order.
        boundary_out: names of the boundary values it sends (last stage: ``()``).
        buffers: the K/V buffers it owns.
        out_slots: the last stage's outputs written in place, in placeholder order.
        param_count: parameter elements it holds.
        param_bytes: bytes of its parameters and module buffers.
        consts: const programs feeding its ``hoisted`` inputs (:mod:`tppc.backends._hoist`;
            ``denoise`` only, else empty).
    """

    index: int
    device: torch.device
    layers: tuple[str, ...]
    module: fx.GraphModule
    runnable: fx.GraphModule
    positional: fx.GraphModule
    inputs: tuple[tuple[str, ChunkInput], ...]
    boundary_in: tuple[str, ...]
    boundary_out: tuple[str, ...]
    buffers: tuple[BufferSpec, ...]
    out_slots: tuple[OutSlot, ...]
    param_count: int
    param_bytes: int
    consts: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Program:
    """The emitted program of one sequence length (see the module docstring).

    Attributes:
        plan: the plan it was emitted for.
        seq_len: tokens per call.
        chunks: ``(start, end)`` token ranges of one call, in order.
        stages: one :class:`StageProgram` per stage.
        signature: how the model's inputs and outputs map to the chunk step.
        tail: the ``global`` epilogue run once on the full outputs, or None.
        actions: what each stage runs, in order (:mod:`tppc.planner.schedule`): the lists the
            plan's simulation replayed, read by every executor.
    """

    plan: Plan
    seq_len: int
    chunks: tuple[tuple[int, int], ...]
    stages: tuple[StageProgram, ...]
    signature: ChunkSignature
    tail: fx.GraphModule | None
    actions: Actions = ()

    def actions_for(self, chunks: tuple[tuple[int, int], ...]) -> Actions:
        """The actions of a call with ``chunks``: the program's own for its chunks; other
        chunkings (a decoding step) run every chunk in order on every stage."""
        if chunks == self.chunks and self.actions:
            return self.actions
        return flow_shop(chunks, len(self.stages))

    def buffer_specs(self) -> tuple[BufferSpec, ...]:
        """Every K/V buffer of the program, stage by stage."""
        return tuple(b for st in self.stages for b in st.buffers)


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
    graph = run_passes(chunk, ctx, [partition_stages(plan)])
    signature: ChunkSignature = chunk.meta[CHUNK_SIGNATURE]
    stages = tuple(_stage(getattr(graph, f"stage_{s}"), device_for(st, s, devices), signature)
                   for s, st in enumerate(plan.stages))
    tail = getattr(chunk, "tppc_tail", None)
    if tail is not None:  # a copy with its own module tree (the chunk graph's stays as is)
        tail = _own_tensors(fx.GraphModule(tail, copy.deepcopy(tail.graph)), stages[-1].device)
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
                   scale=spec.scale, prefix=spec.prefix)
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
