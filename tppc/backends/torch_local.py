"""The ``local`` executor, and how one stage runs one chunk (shared by every torch executor).

A stage step feeds each placeholder of the stage graph from the call and its state (see
:mod:`tppc.program` for the wiring): the previous stage's boundary values, the chunk's rows
of a user input, a whole const input, the chunk's rows of a positional value, the stage's
K/V buffers, a whole user input (``full``: the key-validity mask), or an int. The last stage writes a bias-free linear output (an LM head)
straight into the call's full-length output when that slice is contiguous
(:mod:`tppc.passes.stages.direct_output`).

The ``local`` executor runs the program's action lists (:mod:`tppc.program.schedule`) through
THE interpreter one action at a time in the calling thread, in the order of their dry run
(:func:`tppc.program.interpreter.run_in_order`: a receive is the hand-over of the previous
stage's outputs; a collective combines its group's values with :func:`in_place_ops`, as the
threads executor does, so the logits slices written in place are not copied again): the
reference the others are tested against; it also runs the decoding steps of ``generate``.
It keeps its caller's intra-op threads, except for the worker of an intra-op stage
(``StageProgram.intra_op > 1``), whose computes run with its ``threads``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tppc.errors import StageTimeout
from tppc.ir.records import ChunkInput
from tppc.passes.stages.hoist_consts import const_values
from tppc.program.actions import Action
from tppc.program.collectives import CollectiveOps
from tppc.program.interpreter import Deadline, run_in_order
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, CallState

__all__ = ["TORCH_OPS", "LocalExecutor", "Sink", "chunk_rows", "in_place_ops", "past_deadline",
           "prepare_stage", "run_stage", "worker_name"]

TORCH_OPS = CollectiveOps(cat=lambda arrays, axis: torch.cat(list(arrays), axis),
                          split=lambda array, n, axis: torch.tensor_split(array, n, axis),
                          copy=torch.clone)
"""The array operations of collectives on torch tensors (the in-process transports)."""


def in_place_ops(outputs: Sequence[Any]) -> CollectiveOps:
    """:data:`TORCH_OPS` whose all-gather copies nothing when the pieces already lie side by
    side in one of the call's ``outputs`` (each worker wrote its vocabulary slice there:
    ``OutSlot.piece``): it returns the view that covers them."""
    storages = {t.untyped_storage().data_ptr() for t in outputs
                if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
    if not storages:
        return TORCH_OPS

    def cat(arrays: Sequence[Any], axis: int) -> Any:
        arrays = list(arrays)
        first = arrays[0]
        if isinstance(first, torch.Tensor) and first.untyped_storage().data_ptr() in storages:
            joined = _side_by_side(arrays, axis)
            if joined is not None:
                return joined
        return torch.cat(arrays, axis)

    return dataclasses.replace(TORCH_OPS, cat=cat)


def _side_by_side(arrays: list[Any], axis: int) -> torch.Tensor | None:
    """The one view of which ``arrays`` are consecutive blocks along ``axis``, or None."""
    first = arrays[0]
    offset, size = first.storage_offset(), 0
    for a in arrays:
        if not isinstance(a, torch.Tensor) or a.dtype != first.dtype \
                or a.device != first.device or a.stride() != first.stride() \
                or a.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or a.storage_offset() != offset + size * first.stride(axis) \
                or [n for d, n in enumerate(a.shape) if d != axis] \
                != [n for d, n in enumerate(first.shape) if d != axis]:
            return None
        size += a.shape[axis]
    shape = list(first.shape)
    shape[axis] = size
    return first.as_strided(shape, first.stride(), offset)

Sink = Callable[[int, tuple[Any, ...]], None]
"""Receives ``(chunk index, last stage's outputs)`` in chunk order, in the calling thread."""


def prepare_stage(stage: StageProgram, call: Call, state: CallState) -> tuple[Any, ...]:
    """The stage's positional values at ``call.pos_len`` (computed once per epoch and set of
    the values it reads whole: a positional value may read a timestep, which changes from
    one denoising step to the next within an epoch)."""
    program = stage.positional
    placeholders = program.graph.find_nodes(op="placeholder")
    read = [value for ph, value in zip(placeholders, call.flat_inputs)
            if ph.users and isinstance(value, torch.Tensor) and not _symbolic(ph)]
    key = (call.pos_len, call.epoch, _Read(read))
    values = state.positional(stage, key)
    if values is None:
        inputs = [_zeros_like_at(value, ph, call.pos_len, stage.device)
                  for ph, value in zip(placeholders, call.flat_inputs)]
        with torch.no_grad():
            values = tuple(program(*inputs))
        state.set_positional(stage, key, values)
    return values


def chunk_rows(value: torch.Tensor, spec: ChunkInput, start: int, end: int, length: int
               ) -> torch.Tensor:
    """The rows of chunk ``[start, end)`` of ``value`` along ``spec.axis``: one view, or the
    concatenation of one block per frame (video tokens, :meth:`ChunkInput.blocks`)."""
    blocks = spec.blocks(start, end, length)
    if len(blocks) == 1:
        return value.narrow(spec.axis, *blocks[0])
    return torch.cat([value.narrow(spec.axis, *b) for b in blocks], spec.axis)


def run_stage(stage: StageProgram, call: Call, state: CallState, start: int, end: int,
              boundary: Sequence[Any]) -> tuple[Any, ...]:
    """Run chunk ``[start, end)`` on ``stage``; ``boundary``: the previous stage's outputs."""
    positional = prepare_stage(stage, call, state)
    buffers = state.buffers(stage)
    hoisted = const_values(stage, call, state) if stage.consts else ()
    size = end - start
    received = iter(boundary)
    args: list[Any] = []
    for name, spec in stage.inputs:
        kind = spec.kind
        if kind == "boundary":
            args.append(_to(next(received), stage.device))
        elif kind == "token":
            args.append(_to(chunk_rows(call.flat_inputs[spec.index], spec, start, end,
                                       call.seq_len), stage.device))
        elif kind in ("const", "full"):
            args.append(_to(call.flat_inputs[spec.index], stage.device))
        elif kind == "positional":
            value = positional[spec.index]
            args.append(value if spec.axis is None
                        else chunk_rows(value, spec, start, end, call.seq_len))
        elif kind in ("key", "value", "state"):
            args.append(buffers[name])
        elif kind == "hoisted":
            args.append(hoisted[spec.index])
        else:
            args.append({"chunk_start": start, "chunk_size": size,
                         "seq_len": call.seq_len}[kind])
    for slot in stage.out_slots:
        full = call.outputs[slot.index] if call.outputs else None
        view = None if full is None else slot.view(full, start, size)
        if view is None:  # no output (generate's prefill), or batch > 1: rows are strided
            view = torch.empty(slot.fresh_shape(size), dtype=slot.dtype, device=stage.device)
        args.append(view)
    with torch.no_grad():
        return tuple(stage.runnable(*args))


def worker_name(stage: StageProgram) -> str:
    """``stage 1 (cpu)``, or ``stage 1 rank 0 (cpu)`` for a shard of a sharded stage."""
    rank = f" rank {stage.rank}" if stage.parts else ""
    return f"stage {stage.index}{rank} ({stage.device})"


def past_deadline(deadline: float | None) -> bool:
    """Whether ``deadline`` (a ``time.perf_counter`` value; None: none) has passed."""
    return deadline is not None and time.perf_counter() > deadline


def _to(value: Any, device: torch.device) -> Any:
    """``value`` on ``device``; asynchronous only into CUDA (a host copy is read at once)."""
    if not isinstance(value, torch.Tensor) or value.device == device:
        return value
    return value.to(device, non_blocking=device.type == "cuda")


class _Read:
    """The tensors a positional program reads whole, compared by identity and version (and
    kept alive with the cached values)."""

    __slots__ = ("tensors", "versions")

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors, self.versions = tensors, [t._version for t in tensors]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Read) and len(self.tensors) == len(other.tensors) and all(
            a is b for a, b in zip(self.tensors, other.tensors, strict=True)) \
            and self.versions == other.versions

    __hash__ = None  # type: ignore[assignment]


def _symbolic(placeholder: Any) -> bool:
    val = placeholder.meta.get("val")
    return val is not None and any(isinstance(s, torch.SymInt) for s in val.shape)


def _zeros_like_at(value: Any, placeholder: Any, length: int, device: torch.device) -> Any:
    """A zero-valued stand-in for a flat input, its sequence axes set to ``length``."""
    if not isinstance(value, torch.Tensor):
        return value
    val = placeholder.meta.get("val")
    if val is None or not any(isinstance(s, torch.SymInt) for s in val.shape):
        return value.to(device)
    shape = [int(s.node.expr.xreplace({x: length for x in s.node.expr.free_symbols}))
             if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
    return torch.zeros(shape, dtype=value.dtype, device=device)


class LocalExecutor:
    """Runs every stage in order in the calling thread (the reference executor)."""

    name = "local"

    def check(self, program: Program) -> str | None:
        """None: it can run any program."""
        return None

    def run(self, program: Program, call: Call, state: CallState, sink: Sink | None = None,
            timeout: float | None = None, trace: list | None = None) -> list[tuple[Any, ...]]:
        """Every stage's actions (``program.actions``) in a dependency order in one thread.

        ``trace``: a list that receives ``(stage, chunk, start, end)`` of every job.

        Returns the last stage's outputs per chunk, or ``[]`` when they go to ``sink``.

        Raises:
            StageTimeout: ``timeout`` seconds passed; checked after every compute, so it is
                raised at most one chunk's time late.
        """
        results: dict[int, tuple[Any, ...]] = {}
        stages, leader = program.runners, program.leader
        dry = program.dry_run(call.chunks)
        computes = sum(a.kind == "compute" for row in dry.actions for a in row)
        done = [0]

        def compute(s: int, act: Action, got: Any) -> tuple[Any, ...]:
            done[0] += 1
            threads = stages[s].threads if stages[s].intra_op > 1 else None
            if threads is None or threads == torch.get_num_threads():
                return run_stage(stages[s].part(act.part), call, state, act.start, act.end,
                                 got)
            mine = torch.get_num_threads()  # the worker's own count, the caller's restored
            torch.set_num_threads(threads)
            try:
                return run_stage(stages[s].part(act.part), call, state, act.start, act.end,
                                 got)
            finally:
                torch.set_num_threads(mine)

        def late(s: int, act: Action) -> StageTimeout:
            stage = stages[s]
            return StageTimeout(
                f"the call did not finish within timeout={timeout} s: stage {s} "
                f"({stage.device}, layers {stage.layers[0]}..{stage.layers[-1]}) ended "
                f"chunk {act.chunk} of {len(call.chunks)} after it ({done[0]} of {computes} "
                "stage steps done). fix: raise the timeout, or check that stage's device")

        def output(s: int, act: Action, values: tuple[Any, ...]) -> None:
            if s != leader:  # another shard of the last stage: the same values
                return
            if sink is None:
                results[act.chunk] = values
            else:
                sink(act.chunk, values)

        run_in_order(dry, compute, output=output, ops=in_place_ops(call.outputs),
                     who=lambda s: worker_name(stages[s]),
                     deadline=None if timeout is None else Deadline(timeout, late), trace=trace)
        return [results[i] for i in sorted(results)]
