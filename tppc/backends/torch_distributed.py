"""The ``distributed`` executor: one process per worker, point-to-point over torch.distributed.

Rank ``r`` runs worker ``r`` only (``program.runners[r]``: stage ``r`` without tensor
parallelism, else a shard of a stage; the other workers are never materialised). It runs
worker ``r``'s lowered action list (``program.actions`` with their sends and receives
written out and dry-run, :meth:`tppc.program.program.Program.dry_run`) through THE
interpreter over the process-group transport (:mod:`tppc.backends.rank_transport`): a receive
takes the boundary values from the rank the action names (rank ``r - 1`` in a plain
pipeline), a compute runs the chunk, or one part of a shard
(:func:`tppc.backends.torch_local.run_stage`, the same code every executor runs), a
collective runs over the stage's process group, a send posts an asynchronous send
(``isend``) to the rank the action names, which proceeds while it computes the next chunk;
at most ``queue_depth`` sends are in flight. Only the leader (the first worker of the last
stage) hands outputs on; the other shards of the last stage hold the same values.

Terms:
    handshake: the first chunk of a program to or from each peer carries a small header (dtype, shape and token
        axis of every boundary value, in the wire format of :mod:`tppc.backends.wire`);
        later chunks, and the one-token steps of ``generate``, send bare tensors whose
        shapes the receiver derives from the chunk sizes (the token axis holds ``a × chunk size
        + b`` rows, read off the sending stage's graph: ``b`` a text segment riding with the
        chunk, ``a`` a DiT's patch columns). A
        value without a token axis makes every chunk carry a header.
    failure record, fault injection: how every rank's error names the stage that failed,
        and the ``TPPC_FAULT`` drill (:mod:`tppc.backends.rank_failure`).

Every blocking operation is bounded by the process group's timeout (gloo raises at once on a
dead peer; NCCL needs the timeout and ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, set by
:func:`tppc.distributed.job.init_distributed`).
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tppc.backends import wire
from tppc.backends.rank_failure import (
    FAILURE_KEY,
    Fault,
    first_line,
    is_comm_error,
    read_failure,
    write_failure,
)
from tppc.backends.rank_transport import RankEnd, rank_deadline
from tppc.backends.torch_local import Sink, run_stage
from tppc.errors import StageFailed, StageTimeout, TppcError
from tppc.program.actions import Action
from tppc.program.interpreter import Interpreter
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, CallState

__all__ = ["FAILURE_KEY", "DistributedExecutor", "read_failure", "token_axes"]

_ROUNDING = 0.01
"""Seconds a wait bounded by the call's deadline may end before it (see ``expired``)."""


@dataclass(frozen=True)
class _Template:
    """What the receiver knows of one boundary value after the handshake."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    axis: int | None
    rows: tuple[int, int]  # the token axis holds rows[0] × chunk size + rows[1] rows


class DistributedExecutor:
    """Runs this rank's stage of each program (see the module docstring).

    Args:
        rank: this process's rank (= its worker; its stage without tensor parallelism).
        world: number of ranks (= workers).
        queue_depth: sends in flight at most.
        timeout: seconds any receive or send may wait (the group's own timeout also holds).
    """

    name = "distributed"

    def __init__(self, rank: int, world: int, queue_depth: int = 2,
                 timeout: float = 60.0) -> None:
        self.rank, self.world = rank, world
        self.queue_depth, self.timeout = queue_depth, timeout
        self.last_trace: list[tuple[int, int, float, float]] = []
        self._sent: OrderedDict[int, tuple[Program, dict[int, tuple[int | None, ...]]]] = \
            OrderedDict()
        self._received: OrderedDict[int, tuple[Program, dict[int, list[_Template]]]] = \
            OrderedDict()
        self._peer: int | None = None
        self._stage_of: tuple[int, ...] = ()
        self._fault = Fault.parse(os.environ.get("TPPC_FAULT", ""))

    def check(self, program: Program) -> str | None:
        """None when the program has one worker per rank."""
        workers = len(program.runners)
        if workers != self.world:
            return (f"the program has {workers} workers ({len(program.stages)} stages) and "
                    f"the job {self.world} ranks; launch one process per worker "
                    f"(--nproc-per-node {workers})")
        return None

    def who(self, rank: int | str) -> str:
        """``stage S (rank R)``: rank ``rank``'s stage in the last program run."""
        stage = self._stage_of[rank] if isinstance(rank, int) and rank < len(
            self._stage_of) else rank
        return f"stage {stage} (rank {rank})"

    def run(self, program: Program, call: Call, state: CallState, sink: Sink | None = None,
            timeout: float | None = None, trace: list | None = None) -> list[tuple[Any, ...]]:
        """This rank's stage over every chunk of ``call``.

        Returns, on the last rank, the outputs per chunk (or ``[]`` when they go to
        ``sink``); ``[]`` on the other ranks.

        Raises:
            StageFailed: this stage raised, or a peer failed (naming the failed stage).
            StageTimeout: ``timeout`` seconds (the whole call) passed while this rank waited
                for a peer (naming it); the failure record names it for the other ranks.
        """
        stage = program.runners[self.rank]
        self._stage_of = tuple(w.index for w in program.runners)
        dry = program.dry_run(call.chunks)
        deadline = rank_deadline(self, timeout)
        results: list[tuple[Any, ...]] = []
        jobs: list[tuple[int, int, float, float]] = []
        leader = self.rank == program.leader

        def output(act: Action, values: tuple[Any, ...]) -> None:
            if not leader:  # another shard of the last stage: the same values
                return
            if sink is None:
                results.append(values)
            else:
                sink(act.chunk, values)

        transport = RankEnd(
            self, dry, deadline=deadline,
            recv=lambda act: self._recv(program, act.peer, act.end - act.start, deadline.at),
            send=lambda act, values: self._send(program, stage, act.peer, values))
        Interpreter(dry, self.rank, lambda act, got: run_stage(
            stage.part(act.part), call, state, act.start, act.end, got),
                    transport, output, deadline=deadline, trace=jobs,
                    before=self.before).run()
        self.last_trace = jobs
        if trace is not None:
            trace.extend(jobs)
        return results

    def before(self, k: int, act: Action) -> None:
        """Before action ``k``: the fault drill of ``TPPC_FAULT`` at a compute."""
        if act.kind == "compute" and self._fault is not None:
            self._fault.inject(self.rank, act.chunk)

    # -- failure ------------------------------------------------------------------------------
    def guard(self, op: Callable[[], Any], what: str) -> Any:
        """``op()``, a communication of ``what`` outside the action lists (a broadcast of the
        inputs or results): its failure raised as :meth:`failure`'s ``StageFailed``."""
        try:
            return op()
        except TppcError:
            raise
        except Exception as exc:
            raise self.failure(exc, f"the {what}") from exc

    def failure(self, exc: BaseException, where: str, detail: str = "") -> StageFailed:
        """A :class:`StageFailed` naming the failed stage; records it first when it is ours.
        ``detail`` (the action grid) follows on the next lines of this rank's message."""
        if is_comm_error(exc):
            root = read_failure(wait=3.0)
            if root is None:
                peer = self._peer if self._peer is not None else "?"
                root = f"{self.who(peer)} stopped answering {where}: {first_line(exc)}"
                write_failure(root)
        else:
            root = f"{self.who(self.rank)} raised in {where}: " \
                   f"{type(exc).__name__}: {first_line(exc)}"
            write_failure(root)
            root = read_failure(wait=0.0) or root
        return StageFailed(f"{root}. fix: see the log of that rank; the other ranks stopped "
                           f"(this is rank {self.rank}){_lines(detail)}")

    def timed_out(self, timeout: float | None, where: str, detail: str = "",
                  peer: int | None = None) -> StageTimeout:
        """A :class:`StageTimeout` naming ``peer`` (default: the peer this rank last waited
        for), recorded first."""
        peer = peer if peer is not None else self._peer if self._peer is not None else "?"
        write_failure(f"{self.who(peer)} did not answer within the call's timeout "
                       f"of {timeout} s (seen by rank {self.rank} in {where})")
        return StageTimeout(f"the distributed call did not finish in {timeout} s: rank "
                            f"{self.rank} waited for {self.who(peer)} in {where}. "
                            f"fix: raise timeout, or see that rank's log{_lines(detail)}")

    def check_deadline(self, deadline: float | None, timeout: float | None,
                       chunk: int) -> None:
        """After a compute: a call past its ``deadline`` stops here, at most one chunk
        late, with a StageTimeout naming this stage (recorded for the other ranks).

        Raises:
            StageTimeout: the deadline (``time.monotonic``) has passed.
        """
        if deadline is None or time.monotonic() <= deadline:
            return
        raise self.late(timeout, chunk)

    def late(self, timeout: float | None, chunk: int) -> StageTimeout:
        """The StageTimeout of a compute of ``chunk`` that ended past the call's deadline
        (recorded first, naming this stage)."""
        write_failure(f"{self.who(self.rank)} was still computing (chunk "
                       f"{chunk}) when the call's timeout of {timeout} s passed")
        return StageTimeout(f"the distributed call did not finish in {timeout} s: "
                            f"{self.who(self.rank)} ended chunk {chunk} after it. "
                            "fix: raise timeout, or see why that stage is slow")

    def expired(self, deadline: float | None) -> bool:
        """Whether the call's ``deadline`` (``time.monotonic``) has passed, within
        :data:`_ROUNDING`: a wait bounded by the deadline (:meth:`span`) may end that much
        before it, its timeout rounded down to whole milliseconds."""
        return deadline is not None and time.monotonic() >= deadline - _ROUNDING

    def span(self, deadline: float | None) -> timedelta:
        """How long the next wait may last: the communication timeout, or less when the
        call's ``deadline`` (``time.monotonic``) comes first."""
        left = self.timeout if deadline is None else min(
            self.timeout, max(0.001, deadline - time.monotonic()))
        return timedelta(seconds=left)

    # -- point to point -------------------------------------------------------------------------
    def send_chunk(self, program: Program, values: tuple[Any, ...], peer: int | None = None
                   ) -> tuple[Any, Any]:
        """Post the sends of this rank's boundary ``values`` to ``peer`` (default: the next
        rank); returns ``(works, tensors)`` to wait on (the tensors stay alive until then)."""
        return self._send(program, program.runners[self.rank],
                          self.rank + 1 if peer is None else peer, values)

    def recv_chunk(self, program: Program, size: int, deadline: float | None,
                   peer: int | None = None) -> tuple[Any, ...]:
        """The boundary values of a ``size``-token chunk of ``program`` from ``peer``
        (default: the previous rank)."""
        return self._recv(program, self.rank - 1 if peer is None else peer, size, deadline)

    def wait(self, works: Sequence[Any], peer: int, deadline: float | None) -> None:
        """Wait for ``works`` (operations with ``peer``), each bounded by :meth:`span`."""
        self._wait(works, peer, deadline)

    def _send(self, program: Program, stage: StageProgram, dst: int, values: tuple[Any, ...]
              ) -> tuple[Any, tuple[Any, ...]]:
        per_peer = _remember(self._sent, id(program), program, dict)
        first = dst not in per_peer
        if first:
            per_peer[dst] = _wire_axes(stage)
        axes = per_peer[dst]
        self._peer = dst
        tensors = tuple(_tensor(v, stage, j).contiguous() for j, v in enumerate(values))
        if first or None in axes:  # the handshake (the wire format's header alone)
            wire.send_header({"values": list(tensors), "axes": list(axes)}, dst,
                             tensors[0].device if tensors else None)
        work = [dist.isend(t, dst) for t in tensors]
        return work, tensors  # the tensors stay alive until the send completes

    def _recv(self, program: Program, src: int, size: int, deadline: float | None
              ) -> tuple[Any, ...]:
        self._peer = src
        device = program.runners[self.rank].device
        per_peer = _remember(self._received, id(program), program, dict)
        templates = per_peer.get(src)
        if templates is None or any(t.axis is None for t in templates):
            header = wire.recv_header(src, device, self.span(deadline))
            rows = boundary_rows(program.runners[src])
            templates = [_Template(wire.torch_dtype(v.dtype), v.shape, a, r or (0, 0))
                         for v, a, r in zip(header["values"], header["axes"], rows)]
            per_peer[src] = templates
        out = []
        for t in templates:
            shape = list(t.shape)
            if t.axis is not None:
                shape[t.axis] = t.rows[0] * size + t.rows[1]
            buf = torch.empty(shape, dtype=t.dtype, device=device)
            self._wait([dist.irecv(buf, src)], src, deadline)
            out.append(buf)
        return tuple(out)

    def _wait(self, works: Sequence[Any], peer: int, deadline: float | None) -> None:
        self._peer = peer
        for work in works:
            work.wait(self.span(deadline))


def _remember(table: OrderedDict, key: int, program: Program, make: Any) -> Any:
    """The entry of ``program`` (created by ``make``: what is known per peer); keeps the 32
    latest programs alive so that their ids stay unique (both ranks evict in the same
    order)."""
    if key not in table:
        table[key] = (program, make())
        while len(table) > 32:
            table.popitem(last=False)
    return table[key][1]


def token_axes(stage: StageProgram) -> tuple[int | None, ...]:
    """The token axis of each boundary value the stage sends (from its output's shapes)."""
    out = next(iter(stage.module.graph.find_nodes(op="output")))
    leaves = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    axes = []
    for leaf in leaves:
        val = leaf.meta.get("val") if hasattr(leaf, "meta") else None
        shape = getattr(val, "shape", ())
        axes.append(next((i for i, s in enumerate(shape) if isinstance(s, torch.SymInt)), None))
    return tuple(axes)


def boundary_rows(stage: StageProgram) -> tuple[tuple[int, int] | None, ...]:
    """Rows of each boundary value's token axis as ``(a, b)``: ``a × units + b`` for a chunk
    of that many units (``b``: a joint-attention text segment that rides with the chunk;
    ``a``: a DiT's patch columns); None where the size is not affine in the chunk's units."""
    out = next(iter(stage.module.graph.find_nodes(op="output")))
    leaves = out.args[0] if isinstance(out.args[0], tuple | list) else (out.args[0],)
    found: list[tuple[int, int] | None] = []
    for leaf in leaves:
        val = leaf.meta.get("val") if hasattr(leaf, "meta") else None
        size = next((s for s in getattr(val, "shape", ()) if isinstance(s, torch.SymInt)), None)
        expr = size.node.expr if size is not None else None
        symbols = expr.free_symbols if expr is not None else set()
        if len(symbols) != 1:
            found.append(None)
            continue
        sym = next(iter(symbols))
        a, b = expr.coeff(sym, 1), expr.subs(sym, 0)
        affine = a.is_Integer and b.is_Integer and (expr - a * sym - b).expand() == 0
        found.append((int(a), int(b)) if affine else None)
    return tuple(found)


def _wire_axes(stage: StageProgram) -> tuple[int | None, ...]:
    """:func:`token_axes`, None where the rows are not affine in the chunk size (such a
    value carries its own header with every chunk)."""
    return tuple(None if r is None else a
                 for a, r in zip(token_axes(stage), boundary_rows(stage), strict=True))


def _tensor(value: Any, stage: StageProgram, j: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise StageFailed(f"stage {stage.index} sends boundary value {j} "
                          f"({stage.boundary_out[j]}) of type {type(value).__name__}; only "
                          "tensors cross stage boundaries. fix: report this model")
    return value


def _lines(detail: str) -> str:
    """``detail`` on lines of its own after a one-line message (empty: nothing)."""
    return f"\nthis rank was at {detail}" if detail else ""
