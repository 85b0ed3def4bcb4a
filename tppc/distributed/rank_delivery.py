"""How a call's outputs leave the last rank of a job: the distributed pipeline's delivery.

The last rank is the program's leader (:attr:`tppc.program.program.Program.leader`): the
last stage's rank, or the first worker of a tensor-parallel last stage (the others hold the
same outputs and deliver nothing).

Terms:
    shared: rank 0 and the last rank share a machine: the last stage writes the outputs into
        one shared-memory file that rank 0 maps (:mod:`tppc.distributed.shared_results`).
    streamed: every output has a token axis and there is no epilogue: the last rank sends
        each chunk's outputs as soon as it has them (:mod:`tppc.distributed.result_stream`).
    gathered: otherwise the last rank runs the epilogue and sends the whole outputs in the
        wire format (:mod:`tppc.backends.wire`) to rank 0, or broadcasts them to every rank
        (``results="all"``).

Every rank decides among the three from the same program, so they agree without a message.
Every wait for the results is bounded by the call's deadline as well as the communication
timeout: rank 0 waiting for a last stage that hangs raises :class:`tppc.errors.StageTimeout`
when the call's ``timeout`` ends, naming the last rank.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from tppc.backends import wire
from tppc.calls.call import new_outputs, with_tail
from tppc.distributed.result_stream import ResultSender, receive_results, streamable
from tppc.distributed.shared_results import SharedOutputs, sweep_dead
from tppc.errors import TppcError

if TYPE_CHECKING:
    from tppc.backends.torch_distributed import DistributedExecutor
    from tppc.backends.torch_local import Sink
    from tppc.calls.io import OutputAssembler
    from tppc.frontend.front_end import BoundCall
    from tppc.program.program import Program

__all__ = ["RankDelivery"]


class RankDelivery:
    """One call's delivery on one rank (a :class:`tppc.calls.call.Delivery`).

    Args:
        rank, world: this rank and the number of ranks.
        results: ``"rank0"`` or ``"all"``: who gets the outputs.
        device: this rank's device.
        comm: this rank's executor (its communication timeout, its failure records).
        collective: runs a communication, turning its failure into ``StageFailed``
            (``collective(op, what)``).
        timeout: the call's timeout in seconds (None: none); the deadline starts now.
    """

    def __init__(self, rank: int, world: int, results: str, device: torch.device,
                 comm: DistributedExecutor,
                 collective: Callable[[Callable[[], Any], str], Any],
                 timeout: float | None = None) -> None:
        self.rank, self.world, self.results = rank, world, results
        self.device, self.comm, self.collective = device, comm, collective
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.last = world - 1
        self.stream = False
        self.shared: SharedOutputs | None = None
        self.sender: ResultSender | None = None
        self.chunks: tuple[tuple[int, int], ...] = ()
        self.flushed = False

    def wait(self) -> timedelta:
        """The span the next wait for the results may last (``comm.span`` of the deadline)."""
        return self.comm.span(self.deadline)

    def bounded(self, op: Callable[[], Any], peer: int) -> Any:
        """``op()``, a wait for the results from or to ``peer``: past the call's deadline its
        failure is a StageTimeout naming ``peer``, otherwise a StageFailed."""
        try:
            return op()
        except TppcError:
            raise
        except Exception as exc:
            if self.comm.expired(self.deadline):
                raise self.comm.timed_out(self.timeout, "the results", peer=peer) from exc
            raise self.comm.failure(exc, "the results") from exc

    def outputs(self, program: Program, length: int) -> tuple[Any, ...]:
        axes = program.signature.output_axes
        self.chunks, self.last = program.chunks, program.leader
        self.stream = (self.last != 0 and self.results == "rank0"
                       and self.device.type == "cpu"
                       and streamable(axes, program.tail is not None))
        if self.rank != self.last:
            return ()
        stage = program.runners[self.rank]
        slots: list[Any] = [None] * len(axes)
        for slot in stage.out_slots:
            slots[slot.index] = slot
        specs = [(slot.full_shape(length), slot.dtype) for slot in slots if slot]
        if self.stream and len(specs) == len(slots) and SharedOutputs.possible(specs):
            self.shared = SharedOutputs(specs)  # written in place, mapped by rank 0
            return self.shared.tensors
        return new_outputs(stage, length, len(axes))

    def sink(self, assembler: OutputAssembler) -> Sink:
        if self.stream and self.rank == self.last and self.shared is None:
            self.sender = ResultSender(assembler, self.chunks, 0)
            return self.sender
        return assembler

    def flush(self) -> None:
        sender, shared = self.sender, self.shared
        if sender is not None:
            self.bounded(lambda: sender.finish(self.wait), 0)
        if shared is not None:
            self.bounded(lambda: shared.send(0, self.wait), 0)
        self.flushed = True

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
        if not self.flushed:  # the call failed: a killed peer's shared outputs go too
            sweep_dead()

    def leaves(self, program: Program, bound: BoundCall, leaves: list[Any]
               ) -> list[Any] | None:
        if self.stream:  # the outputs went to rank 0 chunk by chunk, overlapping the last stage
            if self.rank != 0:
                return None
            return list(self.bounded(lambda: receive_results(
                program.chunks, program.signature.output_axes, bound.length, self.last,
                self.device, self.wait), self.last))
        mine = with_tail(program, bound.flat, leaves) if self.rank == self.last else []
        return self._gather(mine)

    def _gather(self, leaves: list[Any]) -> list[Any] | None:
        """The last rank's ``leaves`` on rank 0 (or every rank), in the wire format."""
        last = self.last
        if self.results == "all":
            got = self.collective(lambda: wire.broadcast(leaves, last, self.device), "results")
            return [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in got]
        if last == 0:
            return leaves if self.rank == 0 else None
        if self.rank == last:
            self.collective(lambda: wire.send(leaves, 0, self.device), "results")
        elif self.rank == 0:
            return self.bounded(lambda: wire.recv(last, self.device, self.wait), last)
        return None
