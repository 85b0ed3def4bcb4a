"""THE call algorithm of a compiled pipeline, in one process or on one rank of a job.

    bind the inputs -> the program of their length -> a call state from the pool
    -> full-length outputs -> run the chunks -> give the state back
    -> the epilogue (``program.tail``) -> the model's output structure

Terms:
    delivery: the one part that differs between a pipeline in one process and a rank of a
        job: where the full-length outputs live, which sink the last stage feeds, and how the
        outputs reach the caller. :class:`LocalDelivery` keeps them in the process (the last
        stage writes them in place); :class:`tppc.distributed.rank_delivery.RankDelivery` leaves
        them on the last rank, in shared memory, or streams or gathers them to rank 0.
    epilogue: ``program.tail``, the part of the model after the last per-token value (a
        final norm over the whole sequence...), run once on the assembled outputs.

A failed call raises out of :func:`run_call` before its state is given back: the state is
dropped and the pipeline is as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tppc.calls.io import OutputAssembler, output_structure
from tppc.program.state import Call, next_epoch

if TYPE_CHECKING:
    from tppc.backends.torch_local import Sink
    from tppc.calls.states import CallStates
    from tppc.frontend.front_end import BoundCall, FrontEnd
    from tppc.program.program import Program, StageProgram
    from tppc.program.state import CallState

__all__ = ["Calling", "Delivery", "LocalDelivery", "new_outputs", "run_call", "with_tail"]


class Calling(Protocol):
    """What :func:`run_call` needs of a pipeline (a :class:`tppc.CompiledPipeline`)."""

    states: CallStates

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]: ...

    def program(self, length: int, front: FrontEnd | None = None) -> Program: ...

    def execute(self, program: Program, call: Call, state: CallState, sink: Sink | None = None,
                executor: Any = None, timeout: float | None = None,
                trace: list | None = None) -> list[tuple[Any, ...]]: ...



class Delivery(Protocol):
    """How one call's outputs reach the caller (module docstring); used once per call."""

    def outputs(self, program: Program, length: int) -> tuple[Any, ...]:
        """Full-length outputs the last stage writes in place (``()``: none here)."""
        ...

    def sink(self, assembler: OutputAssembler) -> Sink:
        """What the last stage hands each chunk's outputs to."""
        ...

    def flush(self) -> None:
        """After the chunks ran: send what must leave this process."""
        ...

    def close(self) -> None:
        """After the chunks ran or failed: release what :meth:`outputs` took."""
        ...

    def leaves(self, program: Program, bound: BoundCall, leaves: list[Any]
               ) -> list[Any] | None:
        """The flat outputs the caller gets (None: this rank returns nothing)."""
        ...


def run_call(pipe: Calling, args: tuple[Any, ...], kwargs: Mapping[str, Any],
             delivery: Delivery, *, timeout: float | None = None, executor: Any = None,
             trace: list | None = None) -> Any:
    """``model(*args, **kwargs)`` through ``pipe``: the algorithm of the module docstring.

    Returns:
        The model's output structure, or None where ``delivery`` returns no leaves.
    """
    front, bound = pipe.bind(args, kwargs)
    program = pipe.program(bound.length, front)
    state = pipe.states.acquire(front, bound.length)
    try:  # a failure drops the state; the delivery releases what it took, however it ends
        call = Call(tuple(bound.flat), program.chunks, bound.length, bound.length,
                    next_epoch(), delivery.outputs(program, bound.length))
        assembler = OutputAssembler(program.signature.output_axes, call,
                                    program.signature.output_rows)
        pipe.execute(program, call, state, delivery.sink(assembler), executor, timeout,
                     trace=trace)
        delivery.flush()
    finally:
        delivery.close()
    pipe.states.finish(front, state, bound.length * (front.ctx.block_size or 1))  # tokens
    leaves = delivery.leaves(program, bound, assembler.leaves)
    return None if leaves is None else output_structure(program, leaves)


class LocalDelivery:
    """Outputs in this process: written in place by the last stage, then the epilogue."""

    def outputs(self, program: Program, length: int) -> tuple[Any, ...]:
        return new_outputs(program.stages[-1], length, len(program.signature.output_axes))

    def sink(self, assembler: OutputAssembler) -> Sink:
        return assembler

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None

    def leaves(self, program: Program, bound: BoundCall, leaves: list[Any]) -> list[Any]:
        return with_tail(program, bound.flat, leaves)


def new_outputs(stage: StageProgram, length: int, count: int) -> tuple[Any, ...]:
    """Empty full-length outputs for ``stage``'s out slots, by flat index (None elsewhere)."""
    outputs: list[Any] = [None] * count
    for slot in stage.out_slots:
        outputs[slot.index] = torch.empty(slot.full_shape(length), dtype=slot.dtype,
                                          device=stage.device)
    return tuple(outputs)


def with_tail(program: Program, flat: Sequence[Any], leaves: list[Any]) -> list[Any]:
    """``leaves`` after the program's epilogue (run on the last stage's device), if any."""
    if program.tail is None:
        return leaves
    device = program.stages[-1].device
    with torch.no_grad():
        return list(program.tail(*(x.to(device) if isinstance(x, torch.Tensor) else x
                                   for x in flat), *leaves))
