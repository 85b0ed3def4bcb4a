"""The ONNX Runtime executor: one session per stage, stages pipelined in Python threads.

Terms:
    ORT stage: one exported stage (:class:`OrtStage`): an ``InferenceSession`` with its own
        intra-op threads (spinning off, so stages sharing a machine do not steal each
        other's cores), its positional program's session, and its entry of ``plan.json``.
    call: one run on one sequence (:class:`OrtCall`): the flat inputs, the chunks, the
        sequence length, the length positional values are evaluated at, and the state it
        mutates: each K/V buffer as a numpy array wrapped (not copied) by an ``OrtValue``
        that every chunk binds with IOBinding, and each stage's positional values.
    K/V rows: an exported stage returns the chunk's new K and V rows; the stage writes them
        into its buffers (``c`` rows, in place) before its next chunk, so no chunk copies a
        whole buffer (see :mod:`tppc.artifact.writer.graphs`).
    carried state: a state buffer (kind ``state``, shape ``(2, *state)``: a recurrent
        layer's) is bound like a K/V buffer; the chunk returns its new state, written into
        slot 1 for the stage's next chunk (:mod:`tppc.artifact.writer.state_reads`).

Both loops run the call's action lists (:mod:`tppc.program.schedule`; the loaded
artifact derives them from ``plan.json``'s chunks) through THE interpreter
(:mod:`tppc.program.interpreter`): :func:`run_serial` in the dry run's order in the calling
thread, :func:`run_pipeline` with a thread per stage over the thread transport.

Imports no torch: this module, :mod:`tppc.artifact.core.load` and numpy/onnxruntime are all
a loaded artifact needs. ONNX Runtime releases the GIL in ``run_with_iobinding``, so the
stage threads overlap like the torch ``threads`` executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from tppc.errors import StageTimeout
from tppc.program.actions import Actions, flow_shop
from tppc.program.collectives import NUMPY
from tppc.program.cores import cores_per_device
from tppc.program.dry_run import DryRun, check_actions
from tppc.program.interpreter import Deadline, Interpreter, run_in_order
from tppc.program.sharded import sharded_groups
from tppc.program.threads import ThreadWorld

__all__ = ["OrtCall", "OrtStage", "OrtWorker", "default_threads", "run_pipeline",
           "run_serial", "session_options", "span"]

Sink = Callable[[int, list[np.ndarray]], None]
"""Receives ``(chunk index, last stage's outputs)``."""


def session_options(threads: int) -> ort.SessionOptions:
    """Options of a stage session: ``threads`` intra-op threads, no spinning, sequential."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    return opts


@dataclass
class OrtCall:
    """One run of the loaded program (see the module docstring)."""

    flat: list[Any]
    chunks: tuple[tuple[int, int], ...]
    seq_len: int
    pos_len: int
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    positional: dict[Any, list[np.ndarray]] = field(default_factory=dict)


class OrtStage:
    """One exported stage on ONNX Runtime (see the module docstring).

    Args:
        entry: the stage's entry of ``plan.json`` (already validated).
        root: the artifact directory.
        signature: ``plan.json["signature"]``.
        threads: intra-op threads of its sessions.
        providers: ONNX Runtime execution providers (default: CPU).
    """

    def __init__(self, entry: dict[str, Any], root: Path, signature: dict[str, Any],
                 threads: int, providers: Sequence[Any] | None = None,
                 variant: str = "") -> None:
        self.entry, self.index = entry, int(entry["index"])
        self.key: Any = self.index if not variant else (self.index, variant)
        """Its positional values' key in a call (a later chunks' stage has its own)."""
        self.inputs = entry["inputs"]
        self.buffers = entry["buffers"]
        self.signature = signature
        providers = list(providers or ["CPUExecutionProvider"])
        opts = session_options(threads)
        self.session = ort.InferenceSession(str(root / entry["file"]), opts,
                                            providers=providers)
        pos = entry.get("positional_file")
        self.positional_session = None if pos is None else ort.InferenceSession(
            str(root / pos), session_options(1), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.n_main = len(entry["outputs"])

    def allocate(self, call: OrtCall, capacity: int) -> None:
        """Zero K/V buffers for ``capacity`` units of the sequence in ``call`` (wrapped, not copied), and
        state buffers (their size fixed; a call's first chunk reads no slot)."""
        for b in self.buffers:
            array = np.zeros(_buffer_shape(b, capacity), dtype=np.dtype(b["dtype"]))
            call.buffers[b["name"]] = array
            call.values[b["name"]] = ort.OrtValue.ortvalue_from_numpy(array)

    def buffer_bytes(self, capacity: int) -> int:
        """Bytes :meth:`allocate` takes for ``capacity`` units (host memory)."""
        return sum(int(np.prod(_buffer_shape(b, capacity))) * np.dtype(b["dtype"]).itemsize
                   for b in self.buffers)

    def prepare(self, call: OrtCall) -> list[np.ndarray]:
        """The stage's positional values at ``call.pos_len`` (computed once per call)."""
        values = call.positional.get(self.key)
        if values is None:
            values = []
            if self.positional_session is not None:
                feeds = {}
                by_name = {e["name"]: (i, e) for i, e in enumerate(self.signature["inputs"])}
                for name in self.entry["positional_inputs"]:
                    i, spec = by_name[name]
                    shape = list(np.shape(call.flat[i]))
                    rows = spec.get("seq_rows") or [1] * len(spec["seq_axes"])
                    for axis, per_unit in zip(spec["seq_axes"], rows):
                        shape[axis] = call.pos_len * per_unit
                    feeds[name] = np.zeros(shape, dtype=np.dtype(spec["dtype"]))
                values = self.positional_session.run(None, feeds)
            call.positional[self.key] = values
        return values

    def step(self, call: OrtCall, start: int, end: int, boundary: Sequence[np.ndarray]
             ) -> list[np.ndarray]:
        """Run chunk ``[start, end)``; returns the stage's boundary (or model) outputs."""
        positional = self.prepare(call)
        size = end - start
        binding = self.session.io_binding()
        received = iter(boundary)
        for spec in self.inputs:
            name, kind = spec["name"], spec["kind"]
            if kind in ("key", "value", "state"):
                binding.bind_ortvalue_input(name, call.values[name])
                continue
            if kind == "boundary":
                value = next(received)
            elif kind == "token":
                value = _rows(call.flat[spec["index"]], spec["axis"], *span(spec, start, end))
            elif kind in ("const", "full"):
                value = np.ascontiguousarray(call.flat[spec["index"]])
            elif kind == "positional":
                value = positional[spec["index"]]
                if spec["axis"] is not None:
                    value = _rows(value, spec["axis"], *span(spec, start, end))
            else:
                value = np.array({"chunk_start": start, "chunk_size": size,
                                  "seq_len": call.seq_len}[kind], dtype=np.int64)
            binding.bind_cpu_input(name, value)
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        outs = binding.copy_outputs_to_cpu()
        for b, rows in zip(self.buffers, outs[self.n_main:]):
            target = call.buffers[b["name"]]
            if b.get("kind") == "state":  # the state the next chunk on this stage reads
                target[1] = rows
                continue
            index = [slice(None)] * target.ndim
            lo, count = span(b, start, end)
            index[b["axis"]] = slice(lo, lo + count)
            target[tuple(index)] = rows  # only the chunk's rows are written
        return list(outs[: self.n_main])


    def part(self, index: int) -> OrtStage:
        """What a compute of part ``index`` runs: the stage itself (it has one part)."""
        return self


class OrtWorker:
    """One worker of a tensor-parallel stage: an :class:`OrtStage` per part of its shard.

    Args:
        entry: its entry of ``plan.json["workers"]`` (already validated).
        root, signature, threads, providers: as :class:`OrtStage`'s.
    """

    def __init__(self, entry: dict[str, Any], root: Path, signature: dict[str, Any],
                 threads: int, providers: Sequence[Any] | None = None) -> None:
        self.index, self.rank = int(entry["stage"]), int(entry["rank"])
        self.parts = tuple(OrtStage(e, root, signature, threads, providers,
                                    f"tp{self.rank}.part{p}")
                           for p, e in enumerate(entry["parts"]))

    def allocate(self, call: OrtCall, capacity: int) -> None:
        """Zero K/V buffers of every part (see :meth:`OrtStage.allocate`)."""
        for part in self.parts:
            part.allocate(call, capacity)

    def buffer_bytes(self, capacity: int) -> int:
        """Bytes of every part's buffers (see :meth:`OrtStage.buffer_bytes`)."""
        return sum(part.buffer_bytes(capacity) for part in self.parts)

    def part(self, index: int) -> OrtStage:
        """What a compute of part ``index`` runs."""
        return self.parts[index]


def span(spec: dict[str, Any], start: int, end: int) -> tuple[int, int]:
    """``(offset, count)`` of chunk ``[start, end)`` on an input's or buffer's token axis:
    ``scale`` positions per unit (a DiT's patch columns, a latent's patch size), and the
    unsplit ``prefix`` (joint attention's text) carried by the first chunk (as
    :meth:`tppc.ir.records.ChunkInput.rows`)."""
    scale, prefix = int(spec.get("scale", 1)), int(spec.get("prefix", 0))
    lo = 0 if start == 0 else prefix + scale * start
    return lo, prefix + scale * end - lo


def _buffer_shape(spec: dict[str, Any], capacity: int) -> list[int]:
    """A buffer's shape for ``capacity`` units: its token axis (``None``) has their rows."""
    rows = span(spec, 0, capacity)[1]
    return [rows if s is None else s for s in spec["shape"]]


def _rows(value: np.ndarray, axis: int, start: int, size: int) -> np.ndarray:
    index = [slice(None)] * value.ndim
    index[axis] = slice(start, start + size)
    return np.ascontiguousarray(value[tuple(index)])


def run_serial(stages: Sequence[OrtStage | OrtWorker], call: OrtCall, sink: Sink,
               actions: Actions | None = None, timeout: float | None = None,
               stage_of: Sequence[int] = ()) -> None:
    """The stages' lists of ``actions`` (default: every chunk through every stage in order)
    in the dry run's order, in the calling thread (decoding steps, one-stage pipelines).
    ``stage_of``: the stage of each worker when ``stages`` are the workers of
    tensor-parallel stages (their lowered lists in ``actions``; the first worker of the
    last stage feeds ``sink``).

    Raises:
        StageTimeout: ``timeout`` seconds passed (checked after every compute: at most one
            chunk's time late).
    """
    leader = _leader(stages, stage_of)
    run_in_order(_dry_run(stages, call, actions, stage_of),
                 lambda s, act, got: stages[s].part(act.part).step(call, act.start, act.end,
                                                                   list(got)),
                 output=lambda s, act, values: sink(act.chunk, values) if s == leader else None,
                 ops=NUMPY, who=lambda s: _who(stages[s], s), deadline=_deadline(timeout))


def run_pipeline(stages: Sequence[OrtStage | OrtWorker], call: OrtCall, sink: Sink, *,
                 actions: Actions | None = None, timeout: float | None = None,
                 trace: list[tuple[int, int, float, float]] | None = None,
                 stage_of: Sequence[int] = ()) -> None:
    """The stages' lowered lists of ``actions`` (default: every chunk through every stage
    in order), one thread per stage (chunk i on stage s+1 while chunk i+1 runs on stage s;
    one per worker with ``stage_of``, as :func:`run_serial`) through THE interpreter over
    the thread transport, collectives over numpy; ``sink`` runs in the last stage's
    thread, in chunk order.

    Raises:
        ScheduleError: the actions cannot run (the message prints the action grid).
        StageTimeout: the call took longer than ``timeout`` seconds.
        Exception: the first stage's error, with a note naming the stage and the action.
    """
    if len(stages) == 1:
        run_serial(stages, call, sink, actions, timeout, stage_of)
        return
    world = ThreadWorld(_dry_run(stages, call, actions, stage_of), 0, NUMPY)
    leader = _leader(stages, stage_of)

    def work(s: int) -> None:
        world.work(Interpreter(
            world.dry, s, lambda act, got: stages[s].part(act.part).step(
                call, act.start, act.end, list(got)),
            world.end(s), lambda act, values: sink(act.chunk, values) if s == leader else None,
            who=_who(stages[s], s), trace=trace))

    threads = world.threads(work, "tppc-ort-stage")
    deadline = None if timeout is None else time.monotonic() + timeout
    for s, t in enumerate(threads):
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive() or (deadline is not None and time.monotonic() > deadline
                            and not world.errors):
            world.stop.set()
            state = "still running" if t.is_alive() else "finished after it"
            raise StageTimeout(f"the ONNX Runtime pipeline did not finish in {timeout} s "
                               f"({_who(stages[s], s)} {state}). fix: raise timeout")
    if world.errors:
        raise world.errors[0]


def _leader(stages: Sequence[Any], stage_of: Sequence[int]) -> int:
    """The worker whose outputs are the model's: the first of the last stage."""
    return list(stage_of).index(max(stage_of)) if stage_of else len(stages) - 1


def _who(stage: Any, s: int) -> str:
    """``ORT stage 1``, or ``ORT stage 1 rank 0`` for a worker of a tensor-parallel stage."""
    if isinstance(stage, OrtWorker):
        return f"ORT stage {stage.index} rank {stage.rank}"
    return f"ORT stage {s}"


def _deadline(timeout: float | None) -> Deadline | None:
    """The serial loop's deadline: a compute that ends past it raises StageTimeout."""
    if timeout is None:
        return None
    return Deadline(timeout, lambda s, act: StageTimeout(
        f"the ONNX Runtime pipeline did not finish in {timeout} s (ORT stage {s} ended "
        f"chunk {act.chunk} after it). fix: raise timeout"))


def _dry_run(stages: Sequence[Any], call: OrtCall, actions: Actions | None,
             stage_of: Sequence[int] = ()) -> DryRun:
    """The dry run of the call's actions (the flow shop of its chunks when None; the
    workers' lowered lists with their groups under ``stage_of``)."""
    if stage_of:
        return check_actions(actions, groups=sharded_groups(stage_of), stages=tuple(stage_of))
    return check_actions(flow_shop(call.chunks, len(stages)) if actions is None else actions)


def default_threads(stages: int) -> int:
    """Intra-op threads per stage by default: the machine's physical cores (those this
    process may run on) shared by the stages (:func:`tppc.program.cores.cores_per_device`)."""
    return cores_per_device(stages)
