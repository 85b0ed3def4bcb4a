"""Flow-shop simulation of a token pipeline: when each chunk runs on each stage.

Terms:
    ``times[s, i]``: seconds stage ``s`` spends on chunk ``i``.
    ``links[s, i]``: seconds to send chunk ``i``'s output from stage ``s`` to ``s + 1``.
    job ``j = t·M + i``: chunk ``i`` of pipelined step ``t`` (``M`` chunks per step).

Semantics (a permutation flow shop; one job at a time per stage, jobs in order)::

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

from dataclasses import dataclass

import numpy as np

from tppc.errors import PlanError

__all__ = ["Schedule", "simulate"]


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
) -> Schedule:
    """Simulate ``steps`` pipelined passes of ``M`` chunks over ``S`` stages.

    Args:
        times: ``(S, M)`` stage time per chunk.
        links: ``(S-1, M)`` link time per boundary and chunk (zeros when ``None``).
        steps: pipelined steps ``D`` (1 for prefill).
        back: ``(M,)`` time to return chunk ``i`` from the last stage to stage 0 between
            steps (zeros when ``None``).

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
    jobs = steps * num_chunks
    start = np.zeros((num_stages, jobs))
    end = np.zeros((num_stages, jobs))
    for j in range(jobs):
        i = j % num_chunks
        for s in range(num_stages):
            ready = end[s, j - 1] if j > 0 else 0.0
            if s > 0:
                ready = max(ready, end[s - 1, j] + links[s - 1, i])
            elif j >= num_chunks:
                ready = max(ready, end[num_stages - 1, j - num_chunks] + back[i])
            start[s, j] = ready
            end[s, j] = ready + times[s, i]
    return Schedule(start, end, float(end[-1, -1]))
