"""Failure records and fault drills of the ``distributed`` executor's ranks.

Terms:
    failure record: the first rank that fails writes one line naming the failed stage into
        the job's c10d store (key :data:`FAILURE_KEY`) before it raises; a rank that sees a
        communication error reads it, so every rank's :class:`tppc.errors.StageFailed`
        names the stage that failed, not the neighbour that stopped answering. A rank killed
        outright writes nothing: its neighbours name it (the peer they lost).
    fault injection: ``TPPC_FAULT=ACTION@STAGE:CHUNK`` (``raise``, ``kill`` = SIGKILL itself,
        ``hang``, ``stop`` = SIGSTOP itself) makes that stage (the rank of that number, with
        tensor parallelism) fail at that chunk; tests and drills use it.

A rank's :class:`tppc.backends.torch_distributed.DistributedExecutor` writes and reads the
record (:func:`write_failure`, :func:`read_failure`) and runs the drill (:class:`Fault`).
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from tppc.errors import StageFailed

__all__ = ["FAILURE_KEY", "Fault", "first_line", "is_comm_error", "read_failure",
           "write_failure"]

FAILURE_KEY = "tppc/failure"
"""c10d store key of the first failure's description."""


@dataclass(frozen=True)
class Fault:
    """A drill of ``TPPC_FAULT=ACTION@STAGE:CHUNK``: ``action`` at ``chunk`` of ``stage``."""

    action: str
    stage: int
    chunk: int

    @staticmethod
    def parse(text: str) -> Fault | None:
        """The drill ``text`` asks for (empty: none).

        Raises:
            StageFailed: ``text`` is not ``ACTION@STAGE:CHUNK`` with a known action.
        """
        if not text:
            return None
        action, _, where = text.partition("@")
        stage, _, chunk = where.partition(":")
        if action not in ("raise", "kill", "hang", "stop") or not stage.isdigit() \
                or not chunk.isdigit():
            raise StageFailed(f"TPPC_FAULT={text!r} must read ACTION@STAGE:CHUNK with ACTION "
                              "one of raise, kill, hang, stop (e.g. raise@1:2)")
        return Fault(action, int(stage), int(chunk))

    def inject(self, rank: int, chunk: int) -> None:
        """Fail as asked when ``rank`` computes ``chunk`` of the drill's stage; else nothing."""
        if (self.stage, self.chunk) != (rank, chunk):
            return
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "hang":
            time.sleep(3600)
        if self.action == "stop":  # frozen: no thread of this rank runs until SIGCONT
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"TPPC_FAULT injected a failure in stage {rank}, chunk {chunk}")


def is_comm_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a communication failure (a peer lost), not a stage's own error."""
    if isinstance(exc, dist.DistError | TimeoutError | ConnectionError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        m in text for m in ("Connection", "connection", "Timed out", "timed out", "peer",
                            "Gloo", "gloo", "NCCL", "closed"))


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, at most 300 characters."""
    return (str(exc).strip().splitlines() or [""])[0][:300]


def write_failure(text: str) -> None:
    """Record ``text`` as the job's failure unless one is recorded already."""
    store = _store()
    if store is None:
        return
    try:  # the first failure wins
        store.compare_set(FAILURE_KEY, "", text)
    except Exception:
        pass


def read_failure(wait: float) -> str | None:
    """The recorded failure, waiting up to ``wait`` seconds for it to appear."""
    store = _store()
    if store is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            if store.check([FAILURE_KEY]):
                return store.get(FAILURE_KEY).decode()
        except Exception:
            return None
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None
