"""An exported artifact run as a torch.distributed job: rank ``r`` loads and runs stage ``r``.

Terms:
    rank runner: :class:`DistributedArtifact`, a
        :class:`tppc.artifact.core.loaded.LoadedPipeline` holding one ORT stage (its session
        with its own intra-op threads, its K/V buffers). It verifies ``plan.json`` and only
        its own stage's files (size, sha256), so a rank never reads another stage's weights.
    actions: the rank follows its stage's lowered action list (receive, compute, send) of
        the compute lists the loaded runner derives from ``plan.json``'s chunks
        (:meth:`tppc.artifact.core.loaded.LoadedPipeline.actions_for`), dry-run first.
    transport: boundary values are numpy arrays handed to torch.distributed point to point
        through ``torch.from_numpy`` (no copies; gloo on CPU); a receive fills a numpy
        array in place. The send of chunk ``i`` (``isend``) overlaps the compute of chunk
        ``i + 1``; ``queue_depth`` sends are in flight at most. The first chunk of a rank's
        life carries a JSON header (dtype, shape of each value); later chunks send bare
        arrays, whose token axis (``plan.json``'s ``boundary_axes``) holds ``k × chunk
        size`` rows. No pickle: inputs, headers and outputs travel as JSON + arrays.
    collective call: as :mod:`tppc.distributed.pipeline`: every rank calls together, rank 0's
        inputs are validated on rank 0 (``bind``) and broadcast (or its error); the outputs
        come back on rank 0 (``results="rank0"``) or on every rank (``"all"``).
    failure: as :mod:`tppc.backends.torch_distributed` (whose executor records and names the
        failed stage, and whose ``TPPC_FAULT`` injection this runner honours).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tppc.artifact.core.load import verify
from tppc.artifact.core.loaded import LoadedPipeline
from tppc.backends import wire
from tppc.backends.onnxruntime import OrtCall, default_threads
from tppc.backends.rank_transport import RankEnd, numpy_arrays, rank_deadline
from tppc.backends.torch_distributed import DistributedExecutor
from tppc.errors import RuntimeInputError, SpecError, TppcError
from tppc.program.dry_run import check_actions
from tppc.program.interpreter import Deadline, Interpreter

__all__ = ["DistributedArtifact", "load_distributed"]


def load_distributed(path: str | Path, *, threads_per_stage: int | None = None,
                     results: str = "rank0", comm_timeout: float = 60.0,
                     queue_depth: int = 2,
                     expected_sha256: str | None = None) -> DistributedArtifact:
    """Join the job (torchrun's environment) and load this rank's stage of an artifact.

    Args:
        path: the directory :func:`tppc.export` wrote (on every node).
        threads_per_stage: intra-op threads of this rank's session (default: the
            machine's cores / the ranks on this node).
        results: ``"rank0"`` or ``"all"``: who gets the outputs.
        comm_timeout: seconds a rank waits for a peer before it fails.
        queue_depth: sends in flight at most.
        expected_sha256: the digest of ``plan.json`` the export reported (every rank refuses
            another artifact: :func:`tppc.artifact.core.load.verify`).

    Raises:
        SpecError: the job's size is not the artifact's number of stages.
        ArtifactError: plan.json or this rank's files are damaged (nothing is loaded).
    """
    from tppc.distributed.job import init_distributed

    if results not in ("rank0", "all"):
        raise SpecError(f"results={results!r}; use 'rank0' or 'all'")
    rank, world, _ = init_distributed(comm_timeout, "cpu")
    doc = verify(path, stage=min(rank, world - 1), expected_sha256=expected_sha256)
    stages = len(doc["stages"])
    if stages != world:
        raise SpecError(f"{path} has {stages} stages and the job {world} ranks. fix: launch "
                        f"one process per stage (--nproc-per-node {stages})")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = threads_per_stage or default_threads(local)
    return DistributedArtifact(doc, Path(path), threads=threads, rank=rank, world=world,
                               results=results, comm_timeout=comm_timeout,
                               queue_depth=queue_depth)


class DistributedArtifact(LoadedPipeline):
    """This rank's stage of an artifact; call it on every rank together (module docstring).

    Attributes:
        rank, world: this process's rank (= its stage) and the number of ranks.
        stage: this rank's :class:`tppc.backends.onnxruntime.OrtStage`.
        weights_bytes: bytes of this rank's stage files.
    """

    def __init__(self, doc: dict[str, Any], root: Path, *, threads: int, rank: int,
                 world: int, results: str, comm_timeout: float, queue_depth: int) -> None:
        super().__init__(doc, root, providers=None, threads=threads, only=rank)
        self.rank, self.world, self.results = rank, world, results
        self.stage = self.stages[0]
        self.comm_timeout = comm_timeout
        self.weights_bytes = sum(doc["files"][f]["size"] for f in doc["stages"][rank]["files"])
        self._comm = DistributedExecutor(rank, world, queue_depth, comm_timeout)
        self._axes_in = list(doc["stages"][rank - 1].get("boundary_axes", [])) if rank else []
        self._templates: list[tuple[str, list[int], int | None, int]] | None = None
        self._header_sent = False
        self._timeout: float | None = None
        self._deadline: float | None = None

    # -- the call algorithm's hooks (LoadedPipeline.run and .generate) -------------------------
    def _execute(self, call: OrtCall, sink: Callable[[int, list[np.ndarray]], None],
                 timeout: float | None, *, step: bool = False) -> None:
        """This rank's stage over every chunk of ``call`` (a decoding step too).

        Raises:
            StageTimeout: the call outlived ``timeout`` seconds (naming the stage awaited).
            StageFailed: a stage raised or died (naming it).
        """
        self._timeout = timeout  # the results' wait on rank 0 (_gather) ends by it too
        deadline = rank_deadline(self._comm, timeout)
        self._deadline = deadline.at
        self._pipeline(call, sink, deadline)

    def _token_share(self, ids: np.ndarray) -> Callable[[Any], Any]:
        """The last rank's token on every rank."""
        def share(token: np.ndarray | None) -> np.ndarray:
            pick = np.zeros(ids.shape[0], dtype=np.int64)
            if token is not None:  # the last rank
                pick[:] = token
            self._guard(lambda: dist.broadcast(torch.from_numpy(pick), self.world - 1),
                        "token broadcast")
            return pick

        return share

    def _keeps_results(self) -> bool:
        return self.results == "all" or self.rank == 0

    # -- the pipeline ---------------------------------------------------------------------------
    def _pipeline(self, call: OrtCall, sink: Callable[[int, list[np.ndarray]], None],
                  deadline: Deadline) -> None:
        """This rank's lowered action list of ``call`` through THE interpreter over the
        process-group transport (receive, compute, send)."""
        dry = check_actions(self.actions_for(call.chunks))
        self.last_trace = []
        transport = RankEnd(self._comm, dry, deadline=deadline, arrays=numpy_arrays(),
                            recv=lambda act: self._recv(act.end - act.start, deadline.at),
                            send=lambda act, values: self._send(values))
        Interpreter(dry, self.rank, lambda act, got: self.stage.step(
            call, act.start, act.end, list(got)), transport,
            lambda act, values: sink(act.chunk, values), deadline=deadline,
            trace=self.last_trace, before=self._comm.before).run()

    def _send(self, values: list[np.ndarray]) -> tuple[list[Any], list[np.ndarray]]:
        dst = self.rank + 1
        self._comm._peer = dst
        arrays = [np.ascontiguousarray(v) for v in values]
        axes = self.plan["stages"][self.rank].get("boundary_axes") or [None] * len(arrays)
        if not self._header_sent or None in axes:  # the handshake (the wire format's header)
            wire.send_header(arrays, dst, "cpu")
            self._header_sent = True
        return [dist.isend(torch.from_numpy(a), dst) for a in arrays], arrays

    def _recv(self, size: int, deadline: float | None) -> list[np.ndarray]:
        src = self.rank - 1
        self._comm._peer = src
        if self._templates is None or None in [t[2] for t in self._templates]:
            header = wire.recv_header(src, "cpu", self._comm.span(deadline))
            axes = self._axes_in or [None] * len(header)
            self._templates = [(v.dtype, list(v.shape), a, v.shape[a] // size
                                if a is not None else 0) for v, a in zip(header, axes)]
        out = []
        for dtype, shape, axis, rows in self._templates:
            shape = list(shape)
            if axis is not None:
                shape[axis] = rows * size
            array = np.empty(shape, dtype=np.dtype(dtype))
            self._wait([dist.irecv(torch.from_numpy(array), src)], src, deadline)
            out.append(array)
        return out

    def _wait(self, works: Sequence[Any], peer: int, deadline: float | None) -> None:
        self._comm._peer = peer
        for work in works:
            work.wait(self._comm.span(deadline))

    # -- collectives ----------------------------------------------------------------------------
    def _share(self, bind: Callable[[], tuple[list[Any], int]], extra: Any = None) -> Any:
        """Rank 0's bound inputs on every rank (validated there first; its error everywhere),
        in the wire format. Returns ``(flat, length)``, or ``((flat, length), extra)`` when
        ``extra`` is given."""
        message: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                flat, length = bind()
                message = {"flat": flat, "length": length, "extra": extra}
                wire.encode(message)  # refuses what cannot travel, before anything is sent
            except TppcError as exc:
                message = {"error": f"{type(exc).__name__}: {exc}"}
                self._guard(lambda: wire.broadcast(message, 0, "cpu"), "inputs")
                raise
        message = self._guard(lambda: wire.broadcast(message, 0, "cpu"), "inputs")
        if "error" in message:
            raise RuntimeInputError(f"rank 0 refused the inputs: {message['error']}")
        shared = (list(message["flat"]), message["length"])
        return shared if extra is None else (shared, message["extra"])

    def _gather(self, leaves: list[Any]) -> list[Any] | None:
        """The last rank's output leaves on rank 0 (or every rank), in the wire format."""
        last = self.world - 1
        if last == 0:
            return leaves
        if self.results == "all":
            return self._guard(lambda: wire.broadcast(leaves, last, "cpu"), "results")
        if self.rank == last:
            self._guard(lambda: wire.send(leaves, 0, "cpu"), "results")
        elif self.rank == 0:
            try:  # bounded by the call's deadline: a hung last stage is its StageTimeout
                return wire.recv(last, "cpu", lambda: self._comm.span(self._deadline))
            except TppcError:
                raise
            except Exception as exc:
                if self._comm.expired(self._deadline):
                    raise self._comm.timed_out(self._timeout, "the results",
                                               peer=last) from exc
                raise self._comm.failure(exc, "the results") from exc
        return None

    def _guard(self, op: Callable[[], Any], what: str) -> Any:
        return self._comm.guard(op, what)
