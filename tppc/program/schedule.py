"""The schedule of a token pipeline as data (actions per stage), and its simulation.

Terms:
    action: one thing a stage does: compute chunk ``i`` (tokens ``[start, end)``) of
        pipelined step ``t``, or send / receive that job (:class:`Action`). A stage does its
        actions in the order listed, as the schedules of ``torch.distributed.pipelining``
        do. ``Program.actions`` holds the compute lists; :func:`lower` writes out their
        sends and receives; :func:`check_actions` dry-runs them (deadlock-free, complete)
        and :func:`simulate` and every executor follow the same lowered lists, so
        prediction and execution cannot drift.
    ``times[s, i]``: seconds stage ``s`` spends on chunk ``i``.
    ``links[s, i]``: seconds to send chunk ``i``'s output from stage ``s`` to ``s + 1``.
    job ``j = t·M + i``: chunk ``i`` of pipelined step ``t`` (``M`` chunks per step).

Semantics of the lowered lists (sends are asynchronous, receives block; a stage's clock runs
through its list)::

    compute:   start = clock; end = clock = start + times[s, i]
    send:      arrives at clock + links[s, i] (the last stage's send back: + back[i])
    receive:   clock = max(clock, arrival)

For :func:`flow_shop` lists this is the permutation flow shop::

    start(j, s) = max(end(j-1, s), end(j, s-1) + links[s-1, i])
    start(j, 0) = max(end(j-1, 0), end(j-M, S-1) + back[i])      # steps after the first

The second line is PipeFusion's rule for multi-step diffusion: the pipeline does not drain
between steps; chunk ``i`` of step ``t+1`` enters stage 0 after chunk ``M-1`` of step ``t``
has left it and once chunk ``i`` of step ``t`` has come out of the last stage (and has been
sent back, ``back[i]`` seconds).

Example:
    >>> import numpy as np
    >>> simulate(np.array([[1.0, 2.0], [3.0, 1.0]]), np.zeros((1, 2))).makespan
    5.0
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from tppc.errors import PlanError
from tppc.program.actions import (
    Action,
    Actions,
    Groups,
    flow_shop,
    is_lowered,
    job_count,
    lower,
)
from tppc.program.dry_run import DryRun, check_actions

__all__ = ["Action", "Actions", "DryRun", "Schedule", "check_actions", "flow_shop", "lower",
           "serial_order", "simulate"]


def serial_order(actions: Actions, feedback: tuple[int, ...] = (0,)) -> list[tuple[int, Action]]:
    """``(stage, compute action)`` pairs in an order one thread can run them (dependencies
    first), from the dry run of the lists (:func:`check_actions`).

    Within a round of the dry run the last stage goes first, so a chunk leaves the pipeline
    before many more enter (the local executor holds few boundary values).

    Raises:
        ScheduleError: the lists cannot run (a :class:`tppc.errors.PlanError`); the message
            prints the action grid with the failing action marked.
    """
    return check_actions(actions, feedback).computes()


@dataclass(frozen=True)
class Schedule:
    """Result of :func:`simulate`.

    Attributes:
        start: ``(S, D·M)`` start times.
        end: ``(S, D·M)`` end times.
        makespan: end of the last job on the last stage.
    """

    start: np.ndarray
    end: np.ndarray
    makespan: float


def simulate(
    times: np.ndarray,
    links: np.ndarray | None = None,
    *,
    steps: int = 1,
    back: np.ndarray | None = None,
    actions: Actions | None = None,
    groups: Groups = (),
    stages: tuple[int, ...] = (),
) -> Schedule:
    """Simulate ``steps`` pipelined passes of ``M`` chunks over ``S`` stages.

    Args:
        times: ``(S, M)`` stage time per chunk.
        links: ``(S-1, M)`` link time per boundary and chunk (zeros when ``None``).
        steps: pipelined steps ``D`` (1 for prefill).
        back: ``(M,)`` time to return chunk ``i`` from the last stage to stage 0 between
            steps (zeros when ``None``).
        actions: compute or lowered lists (default: :func:`flow_shop`, as the executors run
            a program); chunk indices index the columns of ``times``.
        groups: the groups of the lists' collectives; a collective ends when its last
            member reaches it (it takes no time of its own here).
        stages: the stage of each list when stages have several workers (lowered lists;
            ``times`` and ``links`` then have a row per list).

    Returns:
        Start and end of every (stage, job) and the makespan.

    Raises:
        PlanError: on mismatched shapes or ``steps < 1``.
        ScheduleError: the lists cannot run (see :func:`check_actions`).
    """
    times = np.asarray(times, dtype=float)
    if times.ndim != 2 or times.shape[1] == 0:
        raise PlanError(f"times must be (stages, chunks) with chunks ≥ 1; got {times.shape}")
    num_stages, num_chunks = times.shape
    links = np.zeros((num_stages - 1, num_chunks)) if links is None else np.asarray(links, float)
    back = np.zeros(num_chunks) if back is None else np.asarray(back, float)
    if links.shape != (num_stages - 1, num_chunks):
        raise PlanError(f"links shape {links.shape} != {(num_stages - 1, num_chunks)}")
    if back.shape != (num_chunks,):
        raise PlanError(f"back shape {back.shape} != {(num_chunks,)}")
    if steps < 1:
        raise PlanError(f"steps={steps} must be at least 1")
    actions = flow_shop(tuple((i, i + 1) for i in range(num_chunks)), num_stages, steps) \
        if actions is None else actions
    named = job_count(actions)
    if len(actions) != num_stages or named[0] > steps or named[1] > num_chunks:
        raise PlanError(f"actions of {len(actions)} stages, {named[0]} steps, {named[1]} "
                        f"chunks do not fit times {times.shape} and steps={steps}")
    collective = any(a.collective for row in actions for a in row)
    dry = check_actions(actions, groups=groups, stages=stages) \
        if is_lowered(actions) or collective or stages else \
        _dry_run_of_jobs(tuple(tuple(a.job for a in row) for row in actions))
    start = np.zeros((num_stages, steps * num_chunks))
    end = np.zeros((num_stages, steps * num_chunks))
    clock = [0.0] * num_stages
    arrive: dict[tuple[int, int, int, int], float] = {}  # (src, dst, step, chunk) -> time
    met: dict[tuple[str, int], float] = {}  # (group, n): when its last member reached it
    count: dict[tuple[str, int], int] = {}  # (group, stage): collectives done
    for s, k in dry.order:
        act = dry.actions[s][k]
        i = act.chunk
        if act.collective:  # every member has reached it before its first entry
            n = count.get((act.group, s), 0)
            count[(act.group, s)] = n + 1
            if (act.group, n) not in met:
                met[(act.group, n)] = max(clock[m] for m in dry.members(act.group))
            clock[s] = met[(act.group, n)]
        elif act.kind == "compute":
            j = act.step * num_chunks + i
            start[s, j] = clock[s]
            end[s, j] = clock[s] = clock[s] + times[s, i]
        elif act.kind == "send":
            wire = links[s, i] if dry.stage(act.peer) > dry.stage(s) else back[i]
            arrive[(s, act.peer, act.step, i)] = clock[s] + wire
        else:
            clock[s] = max(clock[s], arrive[(act.peer, s, act.step, i)])
    return Schedule(start, end, float(end[-1].max()))


@functools.lru_cache(maxsize=256)
def _dry_run_of_jobs(jobs: tuple[tuple[tuple[int, int], ...], ...]) -> DryRun:
    """The dry run of compute lists given as ``(step, chunk)`` per stage: the simulation
    needs no token ranges, so plans that differ only in their boundaries share it."""
    return check_actions(tuple(tuple(Action(t, i, i, i + 1) for t, i in row) for row in jobs))
