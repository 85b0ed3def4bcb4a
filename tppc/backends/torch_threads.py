"""The ``threads`` executor: one worker thread per stage, joined by bounded queues.

Stage ``s``'s worker runs its lowered action list (``program.actions`` with their sends
and receives written out and dry-run, :meth:`tppc.program.program.Program.dry_run`) through
THE interpreter (:mod:`tppc.program.interpreter`) over the thread transport
(:mod:`tppc.program.threads`): a receive takes the next item from its inbox, a compute runs
the chunk, a send puts the boundary values on the inbox of stage ``s + 1`` while the worker
goes on with its next action, a collective meets the group's other workers in shared
buffers (an all-gather of slices the workers wrote into the call's output in place copies
nothing: :func:`tppc.backends.torch_local.in_place_ops`): the stages run concurrently
(PyTorch releases the GIL inside every op). Each worker sets its own intra-op thread count
(``torch.set_num_threads`` is per thread; ``threads_per_stage``, else the worker's
``StageProgram.threads``: its plan device's share of the cores) and grad mode.

Transfers: when the next stage lives on another CUDA device, the worker copies its outputs
on a side stream after its compute (``non_blocking``) and sends a CUDA event with them; the
next worker's stream waits on that event, so the copy of chunk ``i`` overlaps the compute
of chunk ``i + 1``. On CPU a transfer is a hand-over of the tensor.

A failure in any worker stops every worker and is re-raised in the calling thread, with a
note naming the stage, the step, the chunk and the action, and the action grid with that
action marked. A run returns only when every chunk has left the last stage; ``timeout``
(seconds) raises :class:`tppc.errors.StageTimeout` naming the stage that has not answered.
Each call gets its own queues, workers and trace, so concurrent calls (on their own call
states) do not interfere.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tppc.backends.torch_local import Sink, in_place_ops, past_deadline, run_stage, worker_name
from tppc.errors import StageTimeout
from tppc.program.actions import Action
from tppc.program.interpreter import Interpreter
from tppc.program.program import Program
from tppc.program.state import Call, CallState
from tppc.program.threads import POLL, ThreadWorld

__all__ = ["ThreadsExecutor"]


class ThreadsExecutor:
    """One worker thread per stage (see the module docstring).

    Args:
        threads_per_stage: intra-op threads of each worker (None: its own,
            ``StageProgram.threads``: its CPU device's share of the machine's cores,
            :mod:`tppc.program.cores`; never the calling thread's count).
        queue_depth: chunks that may wait between two stages.
    """

    name = "threads"

    def __init__(self, threads_per_stage: int | Sequence[int] | None = None,
                 queue_depth: int = 2) -> None:
        self.threads_per_stage = threads_per_stage
        self.queue_depth = queue_depth
        self.last_trace: list[tuple[int, int, float, float]] = []
        """``(stage, chunk, start, end)`` (``time.perf_counter``) of every job of the last run."""

    def check(self, program: Program) -> str | None:
        """None when it can run the program (CPU or CUDA stages, a thread count per stage)."""
        bad = [str(st.device) for st in program.stages if st.device.type not in ("cpu", "cuda")]
        if bad:
            return f"devices {bad} are neither cpu nor cuda"
        t = self.threads_per_stage
        if t is not None and not isinstance(t, int) and len(t) < len(program.stages):
            return (f"threads_per_stage={list(t)} names {len(t)} stages, the plan has "
                    f"{len(program.stages)}")
        return None

    def run(self, program: Program, call: Call, state: CallState, sink: Sink | None = None,
            timeout: float | None = None, trace: list | None = None) -> list[tuple[Any, ...]]:
        """Every chunk through every stage, stages concurrently.

        ``trace``: a list that receives ``(stage, chunk, start, end)`` of every job.

        Returns the last stage's outputs per chunk, or ``[]`` when they go to ``sink`` (called
        in the calling thread as each chunk leaves the last stage).

        Raises:
            StageTimeout: ``timeout`` seconds passed before the last chunk left the last stage.
        """
        stages = program.runners
        dry = program.dry_run(call.chunks)
        world = ThreadWorld(dry, self.queue_depth, in_place_ops(call.outputs))
        run = _Run(call, state, [None] * len(stages), [] if trace is None else trace)
        mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        workers = world.threads(lambda s: self._work_in_mode(mode, program, s, run, world),
                                "tppc-stage")
        deadline = None if timeout is None else time.perf_counter() + timeout
        results: dict[int, tuple[Any, ...]] = {}
        timed_out = False
        try:
            for _ in range(len({a.job for a in dry.actions[program.leader]
                                if a.kind == "compute"})):
                item = self._next(run, world, workers, deadline, program, timeout)
                if item is None:
                    break
                (_step, chunk), values, event = item
                _wait_event(event, stages[-1].device)
                if sink is None:
                    results[chunk] = values
                else:
                    sink(chunk, values)
        except StageTimeout:
            timed_out = True
            raise
        finally:
            world.stop.set()
            for w in workers:  # a worker stuck in an op cannot be interrupted: not waited for
                w.join(timeout=POLL * 4 if timed_out else None)
        self.last_trace = run.trace
        if world.errors:
            raise world.errors[0]
        return [results[i] for i in sorted(results)]

    def _next(self, run: _Run, world: ThreadWorld, workers: list[threading.Thread],
              deadline: float | None, program: Program, timeout: float | None) -> Any:
        """The next chunk out of the last stage; None when a worker failed.

        Raises:
            StageTimeout: the ``deadline`` (``time.perf_counter``) passed before the chunk
                came out; waits end at the deadline, never a poll interval after it.
        """
        while not world.errors:
            wait = POLL if deadline is None else min(POLL, deadline - time.perf_counter())
            try:
                if wait > 0:
                    item = world.inboxes[-1].get(timeout=wait)
                    if not past_deadline(deadline):
                        return item
            except queue.Empty:
                pass
            if past_deadline(deadline):
                raise self._timed_out(run, program, timeout)
            if not any(w.is_alive() for w in workers):
                try:  # the last item may have been put just before its worker exited
                    return world.inboxes[-1].get_nowait()
                except queue.Empty:
                    if not world.errors:
                        raise RuntimeError(
                            f"tppc threads executor: every worker ended with {run.done} chunks "
                            f"done per stage of {len(run.call.chunks)}") from None
        return None

    @staticmethod
    def _timed_out(run: _Run, program: Program, timeout: float | None) -> StageTimeout:
        s = run.stuck_stage()
        stage = program.runners[s]
        what = (f"has not finished chunk {run.done[s]} of {len(run.call.chunks)} within"
                if run.done[s] < len(run.call.chunks) else "finished its last chunk after")
        return StageTimeout(
            f"stage {stage.index}{f' rank {stage.rank}' if stage.parts else ''} "
            f"({stage.device}, layers {stage.layers[0]}..{stage.layers[-1]}) {what} "
            f"timeout={timeout} s. fix: raise the timeout, or check that stage's device")

    def _work_in_mode(self, mode: tuple[bool, bool], *args: Any) -> None:
        """Run :meth:`_work` under the caller's inference / grad mode (both are per thread)."""
        inference, grad = mode
        with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
            self._work(*args)

    def _work(self, program: Program, s: int, run: _Run, world: ThreadWorld) -> None:
        """Stage ``s``'s lowered list through the interpreter (see the module docstring)."""
        stage = program.runners[s]
        last = len(program.stages) - 1
        nxt = program.stages[stage.index + 1].device if stage.index < last else stage.device
        call = run.call
        leader = s == program.leader

        def output(act: Action, values: Any) -> None:
            if leader:  # another shard of the last stage holds the same values
                world.put(world.inboxes[-1], (act.job, values, None))

        interpreter = Interpreter(
            world.dry, s, lambda act, got: run_stage(stage.part(act.part), call, run.state,
                                                     act.start, act.end, got),
            world.end(s), output, who=worker_name(stage), trace=run.trace)
        run.interpreters[s] = interpreter
        try:
            threads = self._threads(stage.index)
            threads = stage.threads if threads is None else threads
            if threads is not None:
                torch.set_num_threads(threads)
            if stage.device.type == "cuda":
                torch.cuda.set_device(stage.device)
            copier = _Copier(stage.device, nxt)
            interpreter.transport = world.end(
                s, ship=copier.send, land=lambda event: _wait_event(event, stage.device))
            if s > 0 and leader:
                _touch_while_idle(call.outputs, lambda: not world.inboxes[s].empty()
                                  or world.stop.is_set())
        except BaseException as exc:  # re-raised in the calling thread
            exc.add_note(interpreter.note(0))
            world.errors.append(exc)
            world.stop.set()
            return
        world.work(interpreter)

    def _threads(self, s: int) -> int | None:
        t = self.threads_per_stage
        if t is None or isinstance(t, int):
            return t
        return t[s]


class _Run:
    """The call, state, interpreters and trace of one call."""

    def __init__(self, call: Call, state: CallState, interpreters: list[Any],
                 trace: list) -> None:
        self.call, self.state = call, state
        self.interpreters: list[Interpreter | None] = interpreters
        self.trace: list[tuple[int, int, float, float]] = trace

    @property
    def done(self) -> list[int]:
        """Computes each stage has done."""
        return [0 if it is None else it.done for it in self.interpreters]

    def stuck_stage(self) -> int:
        """The first stage that is behind the stage before it (or the first stage)."""
        done = self.done
        for s, count in enumerate(done):
            if count < (len(self.call.chunks) if s == 0 else done[s - 1]):
                return s
        return len(done) - 1


class _Copier:
    """Copies a stage's outputs to the next stage's CUDA device on a side stream."""

    def __init__(self, src: torch.device, dst: torch.device) -> None:
        self.dst = dst
        self.active = dst.type == "cuda" and src != dst
        owner = src if src.type == "cuda" else dst
        self.stream = torch.cuda.Stream(device=owner) if self.active else None

    def send(self, values: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
        if not self.active:
            return values, None
        assert self.stream is not None
        self.stream.wait_stream(torch.cuda.current_stream())
        out = []
        with torch.cuda.stream(self.stream):
            for v in values:
                if isinstance(v, torch.Tensor):
                    copy = v.to(self.dst, non_blocking=True)
                    if v.device.type == "cuda":
                        v.record_stream(self.stream)
                    out.append(copy)
                else:
                    out.append(v)
            event = torch.cuda.Event()
            event.record(self.stream)
        return tuple(out), event


def _wait_event(event: Any, device: torch.device) -> None:
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


_TOUCH_ELEMENTS = 1 << 21
"""Elements the last stage zeroes between two looks at its queue (8 MiB of fp32)."""


def _touch_while_idle(outputs: tuple[Any, ...], ready: Callable[[], bool]) -> None:
    """Write the call's fresh CPU outputs once while the last stage waits for its first chunk.

    A full-length output is new memory each call: the OS maps and zeroes each page when it
    is first written (about 0.3 ns per byte here, 80 ms for a 2048 × 32000 fp32 logits
    tensor), work that would otherwise fall on the last stage, the pipeline's critical
    path. During the fill that stage's core is idle, so it touches the pages then, a slice
    at a time, and stops as soon as its first chunk arrives (``ready``); the chunks
    overwrite every row afterwards.
    """
    for out in outputs:
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" \
                or not out.is_contiguous():
            continue
        flat = out.view(-1)
        for i in range(0, flat.numel(), _TOUCH_ELEMENTS):
            if ready():
                return
            flat[i:i + _TOUCH_ELEMENTS].zero_()
