"""The ``threads`` executor: one worker thread per stage, joined by bounded queues.

Stage ``s``'s worker takes chunk ``i`` from its input queue, runs it, and puts the boundary
values on the queue of stage ``s + 1`` while it goes on with chunk ``i + 1``: the stages run
concurrently (PyTorch releases the GIL inside every op). Each worker sets its own intra-op
thread count (``torch.set_num_threads`` is per thread) and grad mode.

Transfers: when the next stage lives on another CUDA device, the worker copies its outputs
on a side stream after its compute (``non_blocking``) and sends a CUDA event with them; the
next worker's stream waits on that event, so the copy of chunk ``i`` overlaps the compute
of chunk ``i + 1``. On CPU a transfer is a hand-over of the tensor.

A failure in any worker stops every worker and is re-raised in the calling thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tppc.backends.torch_local import Call, Sink, StageRunner

__all__ = ["ThreadsExecutor"]

_POLL = 0.05
"""Seconds between checks of the stop flag while a worker waits on a queue."""


@dataclass(frozen=True)
class _Item:
    index: int
    values: tuple[Any, ...]
    event: Any = None


class _Stopped(Exception):
    """Raised inside a worker when another worker failed."""


class ThreadsExecutor:
    """One worker thread per stage (see the module docstring).

    Args:
        threads_per_stage: intra-op threads of each worker (None: keep torch's setting).
        queue_depth: chunks that may wait between two stages.
    """

    name = "threads"

    def __init__(self, threads_per_stage: int | Sequence[int] | None = None,
                 queue_depth: int = 2) -> None:
        self.threads_per_stage = threads_per_stage
        self.queue_depth = max(1, int(queue_depth))
        self.last_trace: list[tuple[int, int, float, float]] = []
        """``(stage, chunk, start, end)`` (``time.perf_counter``) of every job of the last run."""

    def check(self, runners: Sequence[StageRunner]) -> str | None:
        """None when it can run the stages (any CPU or CUDA devices)."""
        bad = [str(r.device) for r in runners if r.device.type not in ("cpu", "cuda")]
        return f"devices {bad} are neither cpu nor cuda" if bad else None

    def run(self, runners: Sequence[StageRunner], call: Call, sink: Sink | None = None
            ) -> list[tuple[Any, ...]]:
        """Every chunk through every stage, stages concurrently.

        Returns the last stage's outputs per chunk, or ``[]`` when they go to ``sink`` (called
        in the calling thread as each chunk leaves the last stage).
        """
        queues = [queue.Queue(self.queue_depth) for _ in range(len(runners) + 1)]
        self.last_trace = []
        stop = threading.Event()
        errors: list[BaseException] = []
        mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        workers = [
            threading.Thread(target=self._work_in_mode, name=f"tppc-stage-{s}", daemon=True,
                             args=(mode, runners, s, call, queues, stop, errors))
            for s in range(len(runners))
        ]
        for w in workers:
            w.start()
        results: list[tuple[Any, ...]] = []
        done = 0
        try:
            while done < len(call.chunks) and not errors:
                try:
                    item = queues[-1].get(timeout=_POLL)
                except queue.Empty:
                    if not any(w.is_alive() for w in workers):
                        break
                    continue
                _wait_event(item.event, runners[-1].device)
                if sink is None:
                    results.append(item.values)
                else:
                    sink(item.index, item.values)
                done += 1
        finally:
            if done < len(call.chunks):
                stop.set()
            for w in workers:
                w.join()
        if errors:
            raise errors[0]
        return results

    def _work_in_mode(self, mode: tuple[bool, bool], *args: Any) -> None:
        """Run :meth:`_work` under the caller's inference / grad mode (both are per thread)."""
        inference, grad = mode
        with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
            self._work(*args)

    def _work(self, runners: Sequence[StageRunner], s: int, call: Call,
              queues: list[queue.Queue], stop: threading.Event,
              errors: list[BaseException]) -> None:
        runner = runners[s]
        nxt = runners[s + 1].device if s + 1 < len(runners) else runner.device
        try:
            threads = self._threads(s)
            if threads is not None:
                torch.set_num_threads(threads)
            if runner.device.type == "cuda":
                torch.cuda.set_device(runner.device)
            copier = _Copier(runner.device, nxt)
            runner.prepare(call)
            for i, (start, end) in enumerate(call.chunks):
                if s == 0:
                    received: tuple[Any, ...] = ()
                else:
                    item = _get(queues[s], stop)
                    _wait_event(item.event, runner.device)
                    received = item.values
                t0 = time.perf_counter()
                values = runner.run(call, start, end, received)
                self.last_trace.append((s, i, t0, time.perf_counter()))
                values, event = copier.send(values)
                _put(queues[s + 1], _Item(i, values, event), stop)
        except _Stopped:
            return
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
            stop.set()

    def _threads(self, s: int) -> int | None:
        t = self.threads_per_stage
        if t is None or isinstance(t, int):
            return t
        return t[s]


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


def _get(q: queue.Queue, stop: threading.Event) -> _Item:
    while True:
        if stop.is_set():
            raise _Stopped
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            continue


def _put(q: queue.Queue, item: _Item, stop: threading.Event) -> None:
    while True:
        if stop.is_set():
            raise _Stopped
        try:
            q.put(item, timeout=_POLL)
            return
        except queue.Full:
            continue
