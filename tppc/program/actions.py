"""Per-stage action lists: the compute order of a schedule, lowered to explicit communication.

Terms:
    action: one thing a stage does (:class:`Action`): compute chunk ``i`` (tokens
        ``[start, end)``) of pipelined step ``t``, send that job's outputs to stage ``peer``,
        or receive them from stage ``peer``, or run a collective on them with the other
        members of a named group. A stage does its actions in the order listed.
    worker: the owner of one list (``actions[w]``); today one worker per stage.
    collective: an action every member of a group (``Action.group``, named by the program:
        ``groups``, name -> member workers) runs together on its values of one job, in the
        same order on every member (:data:`COLLECTIVES`): ``all_reduce`` (the elementwise
        sum), ``all_gather`` (the members' values concatenated along ``dims[0]`` in member
        order), ``reduce_scatter`` (the sum, cut into equal parts along ``dims[0]``: member
        ``r`` keeps part ``r``), ``all_to_all`` (each member cuts its values into equal parts
        along ``dims[0]``, sends part ``r`` to member ``r``, and concatenates what it gets
        along ``dims[1]``: Ulysses' tokens-to-heads exchange), ``ring_shift`` (member ``r``
        sends its values to member ``r + 1`` and gets member ``r - 1``'s, modulo the group's
        size: one step of Ring attention's K/V passing).
    compute lists: what each stage computes, in order (:func:`flow_shop` builds the usual
        ones); ``Program.actions`` holds them.
    lowered lists: the compute lists with every transfer written out (:func:`lower`), as
        ``torch.distributed.pipelining`` lowers its schedules to per-rank actions with
        ``SEND_F`` / ``RECV_F``: a stage sends each job to the next stage right after
        computing it and receives each job from the previous stage just before it needs it,
        in the order the sender sends (messages between two stages arrive in order).
    feedback edge (multi-step diffusion): chunk ``i`` of step ``t`` leaves the last stage,
        is stepped by the scheduler and comes back to the stages that read the latents
        (``feedback``, stage 0 by default) before they compute chunk ``i`` of step ``t + 1``.

Example:
    >>> [str(a) for a in lower(flow_shop(((0, 4), (4, 8)), 2))[1]]
    ['R0.0<0', 'C0.0', 'R0.1<0', 'C0.1']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["COLLECTIVES", "Action", "Actions", "Groups", "Kind", "flow_shop", "is_lowered",
           "job_count", "lower"]

Kind = Literal["compute", "send", "recv", "all_reduce", "all_gather", "reduce_scatter",
               "all_to_all", "ring_shift"]

COLLECTIVES: dict[str, str] = {"all_reduce": "AR", "all_gather": "AG",
                               "reduce_scatter": "RS", "all_to_all": "AA",
                               "ring_shift": "SH"}
"""Collective kinds and their short names in the action grid."""

Groups = tuple[tuple[str, tuple[int, ...]], ...]
"""Named groups of workers, ``((name, members), ...)`` (hashable: the dry run is cached)."""


@dataclass(frozen=True)
class Action:
    """One action of a stage: compute, send or receive job ``(step, chunk)``.

    Attributes:
        step: pipelined step ``t`` (0 for prefill).
        chunk: chunk index ``i`` within the step.
        start: first token of the chunk.
        end: one past its last token.
        kind: ``"compute"``, ``"send"``, ``"recv"`` or a collective (:data:`COLLECTIVES`).
        peer: the stage a send goes to or a receive comes from (``-1`` otherwise).
        group: the group a collective runs over (``""`` otherwise).
        dims: a collective's axes: ``all_gather``/``reduce_scatter`` ``(axis,)``,
            ``all_to_all`` ``(split axis, concat axis)``.
        part: which part of the worker's stage a compute runs (a stage cut into parts at
            its collectives: tensor parallelism; 0 otherwise).
        first: a collective runs on the slot's first ``first`` values, the rest pass
            through unchanged (0: on every value).
    """

    step: int
    chunk: int
    start: int
    end: int
    kind: Kind = "compute"
    peer: int = -1
    group: str = ""
    dims: tuple[int, ...] = ()
    part: int = 0
    first: int = 0

    @property
    def job(self) -> tuple[int, int]:
        """``(step, chunk)``."""
        return self.step, self.chunk

    @property
    def collective(self) -> bool:
        """Whether the action is a collective."""
        return self.kind in COLLECTIVES

    def __str__(self) -> str:
        name = f"{self.step}.{self.chunk}"
        if self.kind == "send":
            return f"S{name}>{self.peer}"
        if self.kind == "recv":
            return f"R{name}<{self.peer}"
        if self.kind in COLLECTIVES:
            dims = ":" + ",".join(map(str, self.dims)) if self.dims else ""
            first = f"^{self.first}" if self.first else ""
            return f"{COLLECTIVES[self.kind]}{name}@{self.group}{dims}{first}"
        return f"C{name}/{self.part}" if self.part else f"C{name}"


Actions = tuple[tuple[Action, ...], ...]
"""``actions[s]``: what stage ``s`` does, in order."""


def flow_shop(chunks: tuple[tuple[int, int], ...], num_stages: int, steps: int = 1) -> Actions:
    """Every stage computes every chunk of every step in token order (a permutation flow shop)."""
    jobs = tuple(Action(t, i, a, b) for t in range(steps) for i, (a, b) in enumerate(chunks))
    return (jobs,) * num_stages


def is_lowered(actions: Actions) -> bool:
    """Whether the lists already hold their sends and receives."""
    return any(a.kind in ("send", "recv") for row in actions for a in row)


def job_count(actions: Actions) -> tuple[int, int]:
    """``(steps, chunks per step)`` the lists name (from their largest indices)."""
    jobs = [a.job for row in actions for a in row if not a.collective]
    if not jobs:
        return 0, 0
    return 1 + max(t for t, _ in jobs), 1 + max(i for _, i in jobs)


def lower(actions: Actions, feedback: Sequence[int] = (0,)) -> Actions:
    """The compute lists with explicit sends and receives (see the module docstring).

    Stage ``s`` sends every job to ``s + 1`` right after computing it; before computing a
    job it receives, in the order they were sent, the messages up to that job from
    ``s - 1`` and (steps after the first, stages in ``feedback``) from the last stage,
    which sends each job of every step but the last back to those stages. A collective
    right after a compute of the same job (or after such collectives) goes before that
    job's send: the send carries the collective's result. Lists that already hold sends
    or receives are returned as they are. Lowering never refuses: lists it
    cannot make consistent come out inconsistent, and :func:`tppc.program.dry_run.
    check_actions` names the action.
    """
    if is_lowered(actions):
        return actions
    last = len(actions) - 1
    steps, _ = job_count(actions)
    back = tuple(sorted({r for r in feedback if 0 <= r < last})) if steps > 1 else ()
    rows = []
    for s, row in enumerate(actions):
        fwd = _Inbox(tuple(a for a in actions[s - 1] if not a.collective) if s else (), s - 1)
        home = _Inbox(tuple(a for a in actions[last] if a.step + 1 < steps
                            and not a.collective)
                      if s in back else (), last)
        out: list[Action] = []
        k = 0
        while k < len(row):
            act = row[k]
            k += 1
            if act.collective:
                out.append(act)
                continue
            if s in back and act.step > 0:
                out += home.until((act.step - 1, act.chunk))
            if s:
                out += fwd.until(act.job)
            out.append(act)
            while k < len(row) and row[k].collective and row[k].job == act.job:
                out.append(row[k])
                k += 1
            if s < last:
                out.append(_comm(act, "send", s + 1))
            elif act.step + 1 < steps:
                out += [_comm(act, "send", r) for r in back]
        rows.append(tuple(out))
    return tuple(rows)


class _Inbox:
    """The messages one sender sends a stage, received in the order they are sent."""

    def __init__(self, sent: tuple[Action, ...], peer: int) -> None:
        self.sent, self.peer, self.next = sent, peer, 0
        self.where = {a.job: k for k, a in enumerate(sent)}

    def until(self, job: tuple[int, int]) -> list[Action]:
        """The receives up to and including ``job`` (none when it is not sent or already in)."""
        k = self.where.get(job, -1)
        out = [_comm(a, "recv", self.peer) for a in self.sent[self.next:k + 1]]
        self.next = max(self.next, k + 1)
        return out


def _comm(act: Action, kind: Kind, peer: int) -> Action:
    return Action(act.step, act.chunk, act.start, act.end, kind, peer)
