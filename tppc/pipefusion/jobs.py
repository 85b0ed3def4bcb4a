"""The patches of pipelined denoising steps through the stages (see
:mod:`tppc.pipefusion.denoise` for the terms): :class:`Jobs` holds them, :func:`run_serial`
computes them in the dry run's order in the calling thread (the reference),
:func:`run_pipelined` with one worker per stage following its lowered action list (both
through THE interpreter, :mod:`tppc.program.interpreter`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from tppc.backends.torch_local import TORCH_OPS, run_stage
from tppc.program.interpreter import Interpreter, Stopped, run_in_order
from tppc.program.program import StageProgram
from tppc.program.schedule import Action, DryRun
from tppc.program.state import Call, CallState
from tppc.program.threads import POLL, ThreadWorld

__all__ = ["Jobs", "idle_threads", "run_pipelined", "run_serial"]


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

    def who(self, s: int) -> str:
        """How a failure note names stage ``s``."""
        return f"stage {s}, denoise (pipelined step t is step {self.warm} + t)"


def run_serial(jobs: Jobs) -> None:
    """The lists in the dry run's order, in the calling thread, through THE interpreter."""
    run_in_order(jobs.dry, jobs.compute,
                 output=lambda s, act, values: jobs.finish(act.step, act.chunk, values),
                 ops=TORCH_OPS, who=jobs.who)


def run_pipelined(cp: Any, jobs: Jobs) -> None:
    """One worker per stage runs its lowered list through THE interpreter over the thread
    transport; the calling thread steps each patch as it leaves the last stage, and that is
    the send back: a feedback stage's receive of patch ``m`` of step ``t`` waits until the
    calling thread has stepped it."""
    dry = jobs.dry
    last = len(dry.actions) - 1
    world = ThreadWorld(dry, cp.options.queue_depth, TORCH_OPS)
    done: dict[int, int] = {}  # patch -> the last step the calling thread stepped it for
    cond = threading.Condition()
    threads = cp.options.threads_per_stage

    def back(act: Action) -> None:
        t, m = act.job
        with cond:
            while done.get(m, -1) < t:
                if world.stop.is_set():
                    raise Stopped
                cond.wait(POLL)

    def work(s: int) -> None:
        borrow = idle_threads(threads, dry.actions, s)

        def before(k: int, act: Action) -> None:
            if k in borrow:
                torch.set_num_threads(borrow[k])

        world.work(Interpreter(
            dry, s, lambda act, got: jobs.compute(s, act, got), world.end(s, feedback=back),
            lambda act, values: world.put(world.inboxes[-1], (act.job, values, None)),
            who=jobs.who(s), before=before))

    workers = world.threads(work, "tppc-denoise")
    try:
        for _ in range(sum(a.kind == "compute" for a in dry.actions[last])):
            (t, m), values, _ = world.get(world.inboxes[-1])
            jobs.finish(t, m, values)
            with cond:
                done[m] = t
                cond.notify_all()
    except Stopped:
        pass
    finally:
        world.stop.set()
        for w in workers:
            w.join()
    if world.errors:
        raise world.errors[0]


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
