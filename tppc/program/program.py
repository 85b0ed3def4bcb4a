"""The emitted program of one sequence length: what every backend runs and export writes.

Terms:
    program: the stage graphs of one plan on their devices, the chunk boundaries, and how
        every stage input is fed (the wiring). Immutable and free of per-call state: the
        K/V buffers, positional values and fill level of a call live in a
        :class:`tppc.program.state.CallState`, so one program serves concurrent calls.
    stage program: one stage graph with its own parameter tensors on its device, its
        positional program, its inputs in order (:class:`tppc.ir.records.ChunkInput` each), the K/V
        buffers it owns (:class:`BufferSpec`) and, on the last stage, the outputs it writes
        in place (out slots).
    wiring: stage ``s`` receives the boundary values ``boundary_in`` from stage ``s - 1``
        (in that order) and sends ``boundary_out`` to stage ``s + 1``; every other input is
        fed from the call (a chunk of a user input, a positional slice, a buffer, an int).

Example:
    >>> program = build_program(chunk_gm, ctx, plan)   # tppc.driver.emit  # doctest: +SKIP
    >>> [(st.index, st.layers, [b.name for b in st.buffers]) for st in program.stages]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.ir.records import ChunkInput, ChunkSignature
from tppc.program.actions import Actions, Groups, flow_shop, job_count
from tppc.program.dry_run import DryRun, check_actions
from tppc.program.mesh import Mesh
from tppc.program.sharded import JoinSpec, sharded_lists

__all__ = ["BufferSpec", "OutSlot", "Program", "StageProgram"]


@dataclass(frozen=True)
class OutSlot:
    """One output written in place (see the module docstring).

    Attributes:
        index: flat output index of the stage graph (and of the chunk-step graph).
        axis: token axis of the output.
        shape: full-length shape with ``None`` at the token axis.
        dtype: element type.
        piece: ``(axis, offset, size)`` when the worker writes only that slice of another
            axis (its vocabulary slice of the logits, gathered in place:
            :func:`tppc.passes.stages.direct_output.write_piece_in_place`); None: all of it.
    """

    index: int
    axis: int
    shape: tuple[int | None, ...]
    dtype: torch.dtype
    piece: tuple[int, int, int] | None = None

    def full_shape(self, length: int) -> list[int]:
        """The shape with ``length`` tokens on the token axis."""
        return [length if s is None else s for s in self.shape]

    def view(self, full: torch.Tensor, start: int, size: int) -> torch.Tensor | None:
        """What a chunk ``[start, start + size)`` writes of the full-length output ``full``;
        None when that is not one dense block of rows (batch > 1: a fresh tensor then)."""
        view = full.narrow(self.axis, start, size)
        if self.piece is None:
            return view if view.is_contiguous() else None
        axis, offset, width = self.piece
        view = view.narrow(axis, offset, width)  # strided rows: a GEMM writes them in place
        return view if view.stride(-1) == 1 else None

    def fresh_shape(self, size: int) -> list[int]:
        """The shape of a chunk's own tensor (its piece only) when it has no output view."""
        shape = self.full_shape(size)
        if self.piece is not None:
            shape[self.piece[0]] = self.piece[2]
        return shape


@dataclass(frozen=True)
class BufferSpec:
    """One K or V buffer, or a recurrent node's state, that a stage owns.

    Attributes:
        name: its placeholder name in the stage graph.
        kind: ``"key"``, ``"value"``, or ``"state"`` (a carried state).
        attention: the attention node it belongs to.
        layer: the layer that owns it.
        axis: its token axis; None for a recurrent node's carried state (``kind="state"``:
            sized by batch, heads and channels, never by the length).
        shape: its shape with ``None`` at the token axis (a state: its whole shape).
        dtype: its element type.
        scale: token rows per unit of the sequence (a DiT's patch columns; 1 for LLMs).
        prefix: rows of the unsplit text segment before them (joint attention).
        suffix: rows of the unsplit text segment after them (text after the image, SD3).
        parts: a Ring attention worker's buffer holds ``1/parts`` of the sequence's rows
            (its own K/V block) beside the whole text.
    """

    name: str
    kind: str
    attention: str
    layer: str
    axis: int | None
    shape: tuple[int | None, ...]
    dtype: torch.dtype
    scale: int = 1
    prefix: int = 0
    suffix: int = 0
    parts: int = 1

    def rows(self, capacity: int) -> int:
        """Rows of the token axis for ``capacity`` units of the sequence (a state: 1)."""
        if self.axis is None:
            return 1
        return self.prefix + self.scale * -(-capacity // self.parts) + self.suffix

    def allocate(self, capacity: int, device: torch.device) -> torch.Tensor:
        """A zero buffer of ``capacity`` units of the sequence on ``device``."""
        shape = [self.rows(capacity) if s is None else s for s in self.shape]
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def nbytes(self, capacity: int) -> int:
        """Bytes of a buffer of ``capacity`` units of the sequence (:meth:`rows`)."""
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
        consts: const programs feeding its ``hoisted`` inputs
            (:mod:`tppc.passes.stages.hoist_consts`; ``denoise`` only, else empty).
        rank: the worker's place in its stage's mesh (0 when alone).
        parts: the worker's shard cut at its collectives (:mod:`tppc.passes.sharding`):
            part ``p`` is a stage program of its own, run by a compute of ``part=p``
            (empty: ``runnable`` runs whole).
        joins: the collective after each part but the last, ``(kind, dims)``.
        join_axes: the mesh axis whose group runs each join (:mod:`tppc.program.mesh`;
            empty: ``tp`` for every join).
        threads: the intra-op threads its worker runs: its CPU device's share of the
            machine's cores (:mod:`tppc.program.cores`, set by the emitter from the plan's
            cluster); None: the worker's device is not a CPU (it keeps torch's count).
        intra_op: the CPU devices whose shares ``threads`` adds up (the plan's
            ``StagePlan.intra_op``; 1: one device's). Every executor runs such a worker
            with ``threads``, the ``local`` one too (which otherwise keeps its caller's).
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
    rank: int = 0
    parts: tuple[StageProgram, ...] = ()
    joins: tuple[tuple[str, tuple[int, ...]], ...] = ()
    join_axes: tuple[str, ...] = ()
    threads: int | None = None
    intra_op: int = 1

    def part(self, index: int) -> StageProgram:
        """What a compute of part ``index`` runs (the stage itself when it has no parts)."""
        return self.parts[index] if self.parts else self


@dataclass(frozen=True)
class Program:
    """The emitted program of one sequence length (see the module docstring).

    Attributes:
        plan: the :class:`tppc.planner.Plan` it was emitted for (opaque to executors).
        seq_len: tokens per call.
        chunks: ``(start, end)`` token ranges of one call, in order.
        stages: one :class:`StageProgram` per stage.
        signature: how the model's inputs and outputs map to the chunk step.
        tail: the ``global`` epilogue run once on the full outputs, or None.
        actions: what each stage computes, in order (:mod:`tppc.program.schedule`; compute
            lists, or lists with their sends and receives already written out): the lists
            the plan's simulation replayed, which every executor lowers and follows.
        groups: the named groups of stage workers the lists' collectives run over.
        workers: one stage program per worker when a stage has several (a mesh of
            workers: those of stage ``s`` are the workers whose ``index`` is ``s``, in rank
            order; a stage of one worker is its stage program); empty: one worker per
            stage, ``stages``. ``stages[s]`` is then the first worker of stage ``s``.
        meshes: every stage's mesh of workers (:class:`tppc.program.mesh.Mesh`; empty:
            tensor parallelism alone, one tp group of each stage's workers).
    """

    plan: Any
    seq_len: int
    chunks: tuple[tuple[int, int], ...]
    stages: tuple[StageProgram, ...]
    signature: ChunkSignature
    tail: fx.GraphModule | None
    actions: Actions = ()
    groups: Groups = ()
    workers: tuple[StageProgram, ...] = ()
    meshes: tuple[Mesh, ...] = ()

    @property
    def runners(self) -> tuple[StageProgram, ...]:
        """The stage program of every worker (list ``w`` of the action lists)."""
        return self.workers or self.stages

    @property
    def stage_of(self) -> tuple[int, ...]:
        """The stage of every worker (empty: one worker per stage)."""
        return tuple(w.index for w in self.workers)

    @property
    def leader(self) -> int:
        """The worker whose outputs are the model's (the first of the last stage)."""
        return len(self.runners) - sum(w.index == len(self.stages) - 1 for w in self.runners)

    def dry_run(self, chunks: tuple[tuple[int, int], ...], steps: int = 1,
                feedback: tuple[int, ...] = (0,), rest: Program | None = None) -> DryRun:
        """The checked, lowered lists of a call (:meth:`actions_for`, with :attr:`groups`).

        Raises:
            ScheduleError: the lists cannot run (the message prints the action grid).
        """
        return check_actions(self.actions_for(chunks, steps, rest), feedback,
                             groups=self.groups, stages=self.stage_of)

    def actions_for(self, chunks: tuple[tuple[int, int], ...], steps: int = 1,
                    rest: Program | None = None) -> Actions:
        """The compute lists of a call with ``chunks`` and ``steps`` pipelined steps: the
        program's own when they are for those chunks and steps; otherwise (a decoding step,
        a denoising call) every stage runs every chunk of every step in order; the workers
        of sharded stages run their parts and collectives (:func:`sharded_lists`), those of
        ``rest`` for every chunk after the first (the later patches of a step with joint
        attention run a program of their own, whose workers may have other parts)."""
        if self.workers:
            later = None if rest is None or rest is self else (
                _parts(rest), tuple(_joins(w) for w in rest.workers))
            return sharded_lists(chunks, steps, self.stage_of, _parts(self),
                                 tuple(_joins(w) for w in self.workers), self.meshes,
                                 later=later)
        if chunks == self.chunks and self.actions and job_count(self.actions)[0] == steps:
            return self.actions
        return flow_shop(chunks, len(self.stages), steps)

    def buffer_specs(self) -> tuple[BufferSpec, ...]:
        """Every K/V buffer of the program, worker by worker."""
        return tuple(b for st in self.runners for b in st.buffers)


def _parts(program: Program) -> tuple[int, ...]:
    """The parts of every worker."""
    return tuple(max(1, len(w.parts)) for w in program.workers)


def _joins(worker: StageProgram) -> tuple[JoinSpec, ...]:
    """The worker's joins with their mesh axes."""
    axes = worker.join_axes or ("tp",) * len(worker.joins)
    return tuple((kind, dims, axis) for (kind, dims), axis in zip(worker.joins, axes,
                                                                   strict=True))
