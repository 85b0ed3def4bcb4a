"""The patches of pipelined denoising steps through the stages (see
:mod:`tppc.pipefusion.denoise` for the terms): :class:`Jobs` holds them, :func:`run_serial`
computes them in the dry run's order in the calling thread (the reference),
:func:`run_pipelined` with one thread per worker following its lowered action list (both
through THE interpreter, :mod:`tppc.program.interpreter`). A stage of several workers (tensor
parallelism) runs its parts and collectives per worker; its first worker's outputs leave.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from tppc.backends.torch_local import TORCH_OPS, run_stage
from tppc.program.interpreter import Interpreter, Stopped, run_in_order
from tppc.program.program import StageProgram
from tppc.program.schedule import Action, DryRun
from tppc.program.state import Call, CallState
from tppc.program.threads import POLL, ThreadWorld

__all__ = ["Jobs", "idle_threads", "one_stage", "run_pipelined", "run_serial"]


class Jobs(NamedTuple):
    """The pipelined steps of one call: the dry run of their lists (step ``t`` of the lists
    is step ``warm + t`` of the call), each step's call, the state, the worker of a patch
    (``stage_of(m, w)``: list ``w``'s stage program, a stage's when it has one worker) and
    what happens when a patch leaves the last stage (``finish``; the outputs of worker
    ``leader``, whose are the model's)."""

    dry: DryRun
    calls: list[Call]
    state: CallState
    stage_of: Callable[[int, int], StageProgram]
    finish: Callable[[int, int, tuple[Any, ...]], None]
    warm: int
    leader: int = -1
    """The worker whose outputs are the model's (-1: the last list)."""

    def compute(self, s: int, act: Action, received: tuple[Any, ...]) -> tuple[Any, ...]:
        """Compute action ``act`` of worker ``s`` (its part ``act.part``)."""
        return run_stage(self.stage_of(act.chunk, s).part(act.part), self.calls[act.step],
                         self.state, act.start, act.end, received)

    def who(self, s: int) -> str:
        """How a failure note names worker ``s``."""
        return f"worker {s}, denoise (pipelined step t is step {self.warm} + t)"

    def leads(self, s: int) -> bool:
        """Whether worker ``s``'s outputs are the model's."""
        return s == self.leader % len(self.dry.actions)


def run_serial(jobs: Jobs) -> None:
    """The lists in the dry run's order, in the calling thread, through THE interpreter; a
    worker of an intra-op stage (``StageProgram.intra_op > 1``) computes with its own
    ``threads``, the caller's count given back after (as the ``local`` executor does)."""

    def output(s: int, act: Action, values: tuple[Any, ...]) -> None:
        if jobs.leads(s):
            jobs.finish(act.step, act.chunk, values)

    def compute(s: int, act: Action, received: tuple[Any, ...]) -> tuple[Any, ...]:
        worker = jobs.stage_of(act.chunk, s)
        threads = worker.threads if worker.intra_op > 1 else None
        mine = torch.get_num_threads()
        if threads is None or threads == mine:
            return jobs.compute(s, act, received)
        torch.set_num_threads(threads)
        try:
            return jobs.compute(s, act, received)
        finally:
            torch.set_num_threads(mine)

    run_in_order(jobs.dry, compute, output=output, ops=TORCH_OPS, who=jobs.who)


def run_pipelined(cp: Any, jobs: Jobs) -> None:
    """One thread per worker (a stage's, or each member of a stage's group) runs its lowered
    list through THE interpreter over the thread transport; the calling thread steps each
    patch as it leaves the last stage (its leader), and that is the send back: a feedback
    stage's receive of patch ``m`` of step ``t`` waits until the calling thread stepped it."""
    dry = jobs.dry
    leader = jobs.leader % len(dry.actions)
    world = ThreadWorld(dry, cp.options.queue_depth, TORCH_OPS)
    done: dict[int, int] = {}  # patch -> the last step the calling thread stepped it for
    cond = threading.Condition()
    threads = cp.options.threads_per_stage
    stages = [dry.stage(w) for w in range(len(dry.actions))]
    if threads is None:  # each worker its own device's share (StageProgram.threads)
        threads = tuple(jobs.stage_of(0, w).threads for w in range(len(stages)))
    elif not isinstance(threads, int):  # one count per stage: each worker its stage's
        threads = tuple(threads[stage] for stage in stages)

    def back(act: Action) -> None:
        t, m = act.job
        with cond:
            while done.get(m, -1) < t:
                if world.stop.is_set():
                    raise Stopped
                cond.wait(POLL)

    alone = one_stage(dry)

    def work(s: int) -> None:
        borrow = idle_threads(threads, dry.actions, s, stages)

        def before(k: int, act: Action) -> None:
            if alone and act.kind == "compute" and act.step and not act.part:
                back(Action(act.step - 1, act.chunk, act.start, act.end))
            if k in borrow:
                torch.set_num_threads(borrow[k])

        def output(act: Action, values: tuple[Any, ...]) -> None:
            if s == leader:  # another worker of the last stage: the same values
                world.put(world.inboxes[-1], (act.job, values, None))

        world.work(Interpreter(
            dry, s, lambda act, got: jobs.compute(s, act, got), world.end(s, feedback=back),
            output, who=jobs.who(s), before=before))

    workers = world.threads(work, "tppc-denoise")
    try:
        for _ in range(sum(a.kind == "compute" and not a.part for a in dry.actions[leader])):
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


def one_stage(dry: DryRun) -> bool:
    """Whether the lists are one stage of several workers over several steps: no list goes
    back to stage 0 (its workers are the last stage's), so before patch ``m`` of step
    ``t > 0`` each worker waits until patch ``m`` of step ``t - 1`` was stepped (a
    multi-stage program's feedback receive does that wait)."""
    return len(dry.actions) > 1 and len({dry.stage(w) for w in range(len(dry.actions))}) == 1 \
        and any(a.step for row in dry.actions for a in row)


def idle_threads(threads: int | Sequence[int | None] | None, actions: Any, s: int,
                 stages: Sequence[int] | None = None) -> dict[int, int]:
    """Intra-op threads of worker ``s`` from its action ``k`` on (``{k: threads}``): the
    first stage's first compute (the fill) takes every stage's threads, the last stage's
    last compute (the drain) too, each while no other stage computes; otherwise a worker
    runs on its own, set at its first compute, never before. MKL keeps one thread count
    per process, so a count set while another stage computes could change that stage's
    GEMM split mid-call and its result by an ulp: a middle stage never borrows, and runs
    stay bit for bit repeatable with equal per-stage threads.

    ``threads``: one count for every worker, or one per worker (list ``w``), None for a
    worker that keeps torch's own. ``stages``: the stage of each list (None: list ``w`` is
    stage ``w``); where a stage has several workers (a mesh: CFG, Ulysses, Ring, TP) they
    compute at once, so nobody borrows and each worker keeps its own count. ``{}`` when
    the threads are torch's own (``threads=None``)."""
    if threads is None:
        return {}
    n = len(actions)
    per = [threads] * n if isinstance(threads, int) else list(threads[:n])
    computes = [k for k, act in enumerate(actions[s]) if act.kind == "compute"]
    if not computes or per[s] is None:
        return {}
    first, last = computes[0], computes[-1]
    alone = stages is None or len(set(stages)) == n  # one worker a stage
    if len(computes) < 2 or n < 2 or not alone or None in per:
        return {first: per[s]}
    every = sum(per)  # type: ignore[arg-type]  # no None: checked above
    if s == 0:
        return {first: every, first + 1: per[s]}
    return {first: per[s], last: every} if s == n - 1 else {first: per[s]}
