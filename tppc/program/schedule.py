"""The schedule of a token pipeline as data (actions per stage), and its simulation.

Terms:
    action: one job a stage runs: chunk ``i`` (tokens ``[start, end)``) of pipelined step
        ``t`` (:class:`Action`). A stage runs its actions in the order listed, as the
        schedules of ``torch.distributed.pipelining`` do; ``simulate`` and every executor
        read the same lists (``Program.actions``), so prediction and execution cannot drift.
    ``times[s, i]``: seconds stage ``s`` spends on chunk ``i``.
    ``links[s, i]``: seconds to send chunk ``i``'s output from stage ``s`` to ``s + 1``.
    job ``j = t·M + i``: chunk ``i`` of pipelined step ``t`` (``M`` chunks per step).

Semantics (a permutation flow shop; one job at a time per stage, jobs in order)::

    start(j, s) = max(end(j-1, s), end(j, s-1) + links[s-1, i])
    start(j, 0) = max(end(j-1, 0), end(j-M, S-1) + back[i])      # steps after the first

(:func:`flow_shop` builds those lists; :func:`simulate` replays any lists it is given, with
the same dependencies: a job runs after its stage's previous action and after the same job
left the stage before.) The second line is PipeFusion's rule for multi-step diffusion: the pipeline does not drain
between steps; chunk ``i`` of step ``t+1`` enters stage 0 after chunk ``M-1`` of step ``t``
has left it and once chunk ``i`` of step ``t`` has come out of the last stage (and has been
sent back, ``back[i]`` seconds).

Example:
    >>> import numpy as np
    >>> simulate(np.array([[1.0, 2.0], [3.0, 1.0]]), np.zeros((1, 2))).makespan
    5.0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tppc.errors import PlanError

__all__ = ["Action", "Actions", "Schedule", "flow_shop", "serial_order", "simulate"]


@dataclass(frozen=True)
class Action:
    """One job of a stage: chunk ``chunk`` (tokens ``[start, end)``) of step ``step``."""

    step: int
    chunk: int
    start: int
    end: int


Actions = tuple[tuple[Action, ...], ...]
"""``actions[s]``: what stage ``s`` runs, in order."""


def flow_shop(chunks: tuple[tuple[int, int], ...], num_stages: int, steps: int = 1) -> Actions:
    """Every stage runs every chunk of every step in token order (a permutation flow shop)."""
    jobs = tuple(Action(t, i, a, b) for t in range(steps) for i, (a, b) in enumerate(chunks))
    return (jobs,) * num_stages


def serial_order(actions: Actions) -> list[tuple[int, Action]]:
    """``(stage, action)`` pairs in an order one thread can run them (dependencies first).

    Each round runs at most one ready action per stage, last stage first, so a chunk leaves
    the pipeline before many more enter (the local executor holds few boundary values).

    Raises:
        PlanError: the lists wait on each other (no action can run).
    """
    done: set[tuple[int, int, int]] = set()
    nxt = [0] * len(actions)
    order: list[tuple[int, Action]] = []
    while any(n < len(a) for n, a in zip(nxt, actions)):
        progressed = False
        for s in reversed(range(len(actions))):
            if nxt[s] < len(actions[s]):
                act = actions[s][nxt[s]]
                before = (s - 1, act.step, act.chunk) if s else \
                    (len(actions) - 1, act.step - 1, act.chunk)  # the previous step's exit
                if before in done or (s == 0 and act.step == 0):
                    order.append((s, act))
                    done.add((s, act.step, act.chunk))
                    nxt[s] += 1
                    progressed = True
        if not progressed:
            raise PlanError(f"schedule deadlocks: stage actions wait on each other at {nxt}")
    return order


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
) -> Schedule:
    """Simulate ``steps`` pipelined passes of ``M`` chunks over ``S`` stages.

    Args:
        times: ``(S, M)`` stage time per chunk.
        links: ``(S-1, M)`` link time per boundary and chunk (zeros when ``None``).
        steps: pipelined steps ``D`` (1 for prefill).
        back: ``(M,)`` time to return chunk ``i`` from the last stage to stage 0 between
            steps (zeros when ``None``).
        actions: what each stage runs, in order (default: :func:`flow_shop`, as the
            executors run a program); chunk indices index the columns of ``times``.

    Returns:
        Start and end of every (stage, job) and the makespan.

    Raises:
        PlanError: on mismatched shapes or ``steps < 1``.
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
    start = np.zeros((num_stages, steps * num_chunks))
    end = np.zeros((num_stages, steps * num_chunks))
    free = np.zeros(num_stages)  # when each stage finished its previous action
    for s, act in serial_order(actions):
        j, i = act.step * num_chunks + act.chunk, act.chunk
        ready = free[s]
        if s > 0:
            ready = max(ready, end[s - 1, j] + links[s - 1, i])
        elif act.step > 0:
            ready = max(ready, end[num_stages - 1, j - num_chunks] + back[i])
        start[s, j] = ready
        end[s, j] = free[s] = ready + times[s, i]
    return Schedule(start, end, float(end[-1].max()))
