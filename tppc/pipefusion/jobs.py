"""The patches of pipelined denoising steps through the stages (see
:mod:`tppc.pipefusion.denoise` for the terms): :class:`Jobs` holds them, :func:`run_serial`
computes them in the dry run's order in the calling thread (the reference),
:func:`run_pipelined` with one worker per stage following its lowered action list.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tppc.backends.torch_local import run_stage
from tppc.errors import ScheduleError
from tppc.program.program import StageProgram
from tppc.program.schedule import Action, DryRun
from tppc.program.state import Call, CallState

__all__ = ["Jobs", "idle_threads", "run_pipelined", "run_serial"]

_POLL = 0.05


class Jobs(NamedTuple):
    """The pipelined steps of one call: the dry run of their lists (step ``t`` of the lists
    is step ``warm + t`` of the call), each step's call, the state, the stage of a patch
    (``stage_of(m, s)``) and what happens when a patch leaves the last stage (``finish``)."""

    dry: DryRun
    calls: list[Call]
    state: CallState
    stage_of: Callable[[int, int], StageProgram]
    finish: Callable[[int, int, tuple[Any, ...]], None]
    warm: int

    def compute(self, s: int, act: Action, received: tuple[Any, ...]) -> tuple[Any, ...]:
        """Compute action ``act`` of stage ``s``."""
        return run_stage(self.stage_of(act.chunk, s), self.calls[act.step], self.state,
                         act.start, act.end, received)

    def note(self, s: int, k: int) -> str:
        return (f"[tppc] denoise (pipelined step t is step {self.warm} + t): stage {s}, "
                f"{self.dry.describe(s, k)}")


def run_serial(jobs: Jobs) -> None:
    """The computes of the lists in the dry run's order, in the calling thread."""
    last = len(jobs.dry.actions) - 1
    sent: dict[tuple[int, tuple[int, int]], tuple[Any, ...]] = {}
    for s, act in jobs.dry.computes():
        values = jobs.compute(s, act, sent.pop((s - 1, act.job), ()))
        if s < last:
            sent[(s, act.job)] = values
        else:
            jobs.finish(act.step, act.chunk, values)


def run_pipelined(cp: Any, jobs: Jobs) -> None:
    """One worker per stage follows its lowered list; the calling thread steps each patch as
    it leaves the last stage, and that is the send back: a feedback stage's receive of
    patch ``m`` of step ``t`` waits until the calling thread has stepped it."""
    dry = jobs.dry
    last = len(dry.actions) - 1
    queues = [queue.Queue(cp.options.queue_depth) for _ in range(last + 2)]
    stop, errors = threading.Event(), []
    done: dict[int, int] = {}  # patch -> the last step the calling thread stepped it for
    cond = threading.Condition()
    threads = cp.options.threads_per_stage

    def back(t: int, m: int) -> None:
        with cond:
            while done.get(m, -1) < t:
                if stop.is_set():
                    raise _Stopped
                cond.wait(_POLL)

    def work(s: int) -> None:
        k = 0
        got: dict[tuple[int, int], tuple[Any, ...]] = {}  # received, not yet computed
        made: dict[tuple[int, int], tuple[Any, ...]] = {}  # computed, not yet sent
        try:
            borrow = idle_threads(threads, dry.actions, s)
            for k, act in enumerate(dry.actions[s]):
                if k in borrow:
                    torch.set_num_threads(borrow[k])
                if act.kind == "recv" and act.peer == last:  # back from the last stage
                    back(*act.job)
                elif act.kind == "recv":
                    job, values = _get(queues[s], stop)
                    if job != act.job:
                        raise ScheduleError(f"stage {s} expected {act}, got job {job}")
                    got[job] = values
                elif act.kind == "compute":
                    values = jobs.compute(s, act, got.pop(act.job, ()))
                    if s == last:  # to the calling thread
                        _put(queues[-1], (act.job, values), stop)
                    else:
                        made[act.job] = values
                elif act.peer == s + 1:  # (a send back is the calling thread's step)
                    _put(queues[s + 1], (act.job, made.pop(act.job)), stop)
        except _Stopped:
            return
        except BaseException as exc:  # re-raised in the calling thread
            exc.add_note(jobs.note(s, k))
            errors.append(exc)
            stop.set()

    workers = [threading.Thread(target=work, args=(s,), daemon=True, name=f"tppc-denoise-{s}")
               for s in range(last + 1)]
    for w in workers:
        w.start()
    try:
        for _ in range(sum(a.kind == "compute" for a in dry.actions[last])):
            (t, m), values = _get(queues[-1], stop)
            jobs.finish(t, m, values)
            with cond:
                done[m] = t
                cond.notify_all()
    except _Stopped:
        pass
    finally:
        stop.set()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]


def idle_threads(threads: int | tuple[int, ...] | None, actions: Any, s: int
                 ) -> dict[int, int]:
    """Intra-op threads of stage ``s`` from its action ``k`` on (``{k: threads}``): its
    first compute (the fill) also takes the threads of the later stages, which wait for it,
    its last compute (the drain) those of the earlier stages, which are done; between them
    its own. ``{}`` when the threads are torch's own (``threads_per_stage=None``)."""
    if threads is None:
        return {}
    n = len(actions)
    per = [threads] * n if isinstance(threads, int) else list(threads[:n])
    computes = [k for k, act in enumerate(actions[s]) if act.kind == "compute"]
    if len(computes) < 2:
        return {0: per[s]}
    first, last = computes[0], computes[-1]
    return {0: sum(per[s:]), first + 1: per[s], last: sum(per[:s + 1])}


class _Stopped(Exception):
    """Another worker failed."""


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while True:
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            if stop.is_set():
                raise _Stopped from None


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL)
            return
        except queue.Full:
            continue
    raise _Stopped
