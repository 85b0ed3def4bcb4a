"""The process-group transport: one rank's end of a torch.distributed job (a ``Transport`` of
:mod:`tppc.program.interpreter`), shared by the distributed executor, distributed denoising
and the distributed artifact runner.

Terms:
    forward send: posted asynchronously (``isend``); at most ``queue_depth`` are in flight,
        the oldest waited for first; :meth:`RankEnd.flush` waits for the rest.
    feedback: a denoised patch going back from the last rank to the ranks that read the
        latents; ``feedback_send`` posts it (kept until completed), ``feedback_recv`` lands it.
    collective: the group's process group runs it (:func:`tppc.backends.torch_collectives.
        run_collective`); ``arrays`` converts a numpy runner's values to tensors and back.
    failure: an action that raises becomes the executor's :class:`tppc.errors.StageFailed`
        (the failure record names the failed stage) or, past the call's deadline, its
        :class:`tppc.errors.StageTimeout`, with the action grid.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tppc.backends.torch_collectives import process_groups, run_collective
from tppc.errors import StageFailed, StageTimeout
from tppc.program.actions import Action
from tppc.program.dry_run import DryRun
from tppc.program.interpreter import Deadline, Interpreter

__all__ = ["RankEnd", "numpy_arrays", "rank_deadline"]

Posted = tuple[Sequence[Any], Any]
"""``(works, what they send)``: posted operations and the buffers they keep alive."""


def rank_deadline(comm: Any, timeout: float | None) -> Deadline:
    """The call's deadline on this rank: a compute that ends past it records and raises
    the executor's StageTimeout naming this stage."""
    return Deadline(timeout, lambda s, act: comm.late(timeout, act.chunk))


class RankEnd:
    """This rank's transport (see the module docstring).

    Args:
        comm: the executor whose waits, failure record and messages it uses
            (:class:`tppc.backends.torch_distributed.DistributedExecutor`).
        dry: the dry run (its groups get process groups).
        recv: ``recv(act)``: a forward receive's values.
        send: ``send(act, values)``: posts a forward send.
        deadline: the call's deadline (bounds every wait).
        feedback_recv: ``feedback_recv(act)``: lands a patch sent back (denoising).
        feedback_send: ``feedback_send(act)``: posts a patch back (denoising).
        arrays: ``(to_tensor, from_tensor)`` when the values are not tensors (numpy).
    """

    def __init__(self, comm: Any, dry: DryRun, *,
                 recv: Callable[[Action], Any], send: Callable[[Action, Any], Posted],
                 deadline: Deadline, feedback_recv: Callable[[Action], None] | None = None,
                 feedback_send: Callable[[Action], Posted] | None = None,
                 arrays: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None = None
                 ) -> None:
        self.comm, self.dry, self.rank = comm, dry, comm.rank
        self._recv, self._send, self.deadline = recv, send, deadline
        self.feedback_recv, self.feedback_send, self.arrays = feedback_recv, feedback_send, arrays
        self.groups: Mapping[str, Any] = process_groups(dry.groups) if dry.groups else {}
        self.sends: list[tuple[int, Posted]] = []  # forward sends in flight
        self.patches: list[tuple[int, Posted]] = []  # patches sent back, until completed

    def recv(self, act: Action) -> Any:
        if self.dry.stage(act.peer) > self.dry.stage(self.rank):
            if self.feedback_recv is None:
                raise StageFailed(f"stage {self.rank}: {act} comes back along the pipeline; "
                                  "only denoising sends patches back")
            self.feedback_recv(act)
            return None
        return self._recv(act)

    def send(self, act: Action, values: Any) -> None:
        if self.dry.stage(act.peer) < self.dry.stage(self.rank):
            if self.feedback_send is None:
                raise StageFailed(f"stage {self.rank}: {act} goes back along the pipeline; "
                                  "only denoising sends patches back")
            self.patches = [p for p in self.patches if not all(
                w.is_completed() for w in p[1][0])]
            self.patches.append((act.peer, self.feedback_send(act)))
            return
        self.sends.append((act.peer, self._send(act, values)))
        while len(self.sends) > self.comm.queue_depth:
            peer, (works, _) = self.sends.pop(0)
            self.comm.wait(works, peer, self.deadline.at)

    def collective(self, act: Action, values: Any) -> Any:
        members = self.dry.members(act.group)
        self.comm._peer = None
        if self.arrays is None:
            return run_collective(act, values, members, self.rank, self.groups[act.group])
        to_tensor, from_tensor = self.arrays
        out = run_collective(act, [to_tensor(v) for v in values], members, self.rank,
                             self.groups[act.group])
        return [from_tensor(v) for v in out]

    def flush(self) -> None:
        for peer, (works, _) in [*self.sends, *self.patches]:
            self.comm.wait(works, peer, self.deadline.at)
        self.sends, self.patches = [], []

    def failure(self, exc: BaseException, where: Interpreter, k: int) -> BaseException:
        if isinstance(exc, StageFailed | StageTimeout) or not isinstance(exc, Exception):
            return exc
        place, grid = where.where(k), self.dry.describe(self.rank, k)
        if self.comm.expired(self.deadline.at):
            return self.comm.timed_out(self.deadline.seconds, place, grid)
        return self.comm.failure(exc, place, grid)


def numpy_arrays() -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """The ``arrays`` of a numpy runner: numpy arrays as CPU tensors and back."""
    return (lambda a: torch.from_numpy(np.ascontiguousarray(a)),
            lambda t: t.numpy())
