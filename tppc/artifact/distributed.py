"""An exported artifact run as a torch.distributed job: rank ``r`` loads and runs stage ``r``.

Terms:
    rank runner: :class:`DistributedArtifact`, a :class:`tppc.artifact.loaded.LoadedPipeline` holding
        one ORT stage (its session with its own intra-op threads, its K/V buffers). It
        verifies ``plan.json`` and only its own stage's files (size, sha256), so a rank never
        reads another stage's weights.
    transport: boundary values are numpy arrays handed to torch.distributed point to point
        through ``torch.from_numpy`` (no copies; gloo on CPU); a receive fills a numpy
        array in place. The send of chunk ``i`` (``isend``) overlaps the compute of chunk
        ``i + 1``; ``queue_depth`` sends are in flight at most. The first chunk of a rank's
        life carries a JSON header (dtype, shape of each value); later chunks send bare
        arrays, whose token axis (``plan.json``'s ``boundary_axes``) holds ``k × chunk
        size`` rows. No pickle: inputs, headers and outputs travel as JSON + arrays.
    collective call: as :mod:`tppc.runtime.distributed`: every rank calls together, rank 0's
        inputs are validated on rank 0 (``bind``) and broadcast (or its error); the outputs
        come back on rank 0 (``results="rank0"``) or on every rank (``"all"``).
    failure: as :mod:`tppc.backends.torch_distributed` (whose executor records and names the
        failed stage, and whose ``TPPC_FAULT`` injection this runner honours).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tppc.artifact.load import verify
from tppc.artifact.loaded import Assembler, LoadedPipeline, unflatten
from tppc.backends.onnxruntime import OrtCall, default_threads
from tppc.backends.torch_distributed import DistributedExecutor, recv_bytes, send_bytes
from tppc.errors import RuntimeInputError, SpecError, StageFailed, StageTimeout, TppcError
from tppc.generation import DEFAULT, check_max_new_tokens, stop_tokens

__all__ = ["DistributedArtifact", "load_distributed"]


def load_distributed(path: str | Path, *, threads_per_stage: int | None = None,
                     results: str = "rank0", comm_timeout: float = 60.0,
                     queue_depth: int = 2) -> DistributedArtifact:
    """Join the job (torchrun's environment) and load this rank's stage of an artifact.

    Args:
        path: the directory :func:`tppc.export` wrote (on every node).
        threads_per_stage: intra-op threads of this rank's session (default: the
            machine's cores / the ranks on this node).
        results: ``"rank0"`` or ``"all"``: who gets the outputs.
        comm_timeout: seconds a rank waits for a peer before it fails.
        queue_depth: sends in flight at most.

    Raises:
        SpecError: the job's size is not the artifact's number of stages.
        ArtifactError: plan.json or this rank's files are damaged (nothing is loaded).
    """
    from tppc.runtime.distributed import init_distributed

    if results not in ("rank0", "all"):
        raise SpecError(f"results={results!r}; use 'rank0' or 'all'")
    rank, world, _ = init_distributed(comm_timeout, "cpu")
    doc = verify(path, stage=min(rank, world - 1))
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

    # -- calls ----------------------------------------------------------------------------------
    def run(self, args: Sequence[Any], inputs: dict[str, Any] | None = None, *,
            timeout: float | None = None) -> Any:
        """``model(*args, **inputs)`` through the job (collective; rank 0's inputs).

        Raises:
            RuntimeInputError: rank 0 refused the inputs (raised on every rank).
            StageTimeout: the call outlived ``timeout`` seconds (naming the stage awaited).
            StageFailed: a stage raised or died (naming it).
        """
        flat, length = self._share(lambda: self.bind(args, inputs or {}))
        call = self._call(flat, self.chunks(length), length, length)
        leaves = Assembler(self.signature["outputs"], length)
        self._pipeline(call, leaves, timeout)
        out = self._results(leaves.leaves)
        return None if out is None else unflatten(self.signature["out_spec"], iter(out))

    def generate(self, input_ids: Any, max_new_tokens: int = 20, *,
                 eos_token_id: Any = DEFAULT, pad_token_id: Any = DEFAULT
                 ) -> np.ndarray | None:
        """Greedy decoding through the job (collective; rank 0's ``input_ids``): the prompt's
        chunks pipelined, then one-token steps; the last rank broadcasts each token."""
        gen = self.signature["generate"]
        token, logits_at = gen.get("token_input"), gen.get("logits_output")

        def check() -> tuple[list[Any], int]:
            if token is None or logits_at is None:
                raise RuntimeInputError("generate needs one token-id input and a per-token "
                                        "output (logits); this artifact has neither")
            check_max_new_tokens(max_new_tokens)
            return self.bind((), {self.signature["inputs"][token]["name"]: input_ids})

        (flat, prompt), new = self._share(check, extra=max_new_tokens)
        eos_ids, pad = stop_tokens(eos_token_id, pad_token_id, model_eos=self.eos_token_id,
                                   model_pad=self.pad_token_id)
        total = prompt + new
        ids = np.zeros((flat[token].shape[0], total), dtype=flat[token].dtype)
        ids[:, :prompt] = flat[token]
        flat[token] = ids
        call = self._call(flat, self.chunks(prompt), total, total)
        last: dict[int, list[np.ndarray]] = {}
        sink = lambda i, out: last.update({0: out})  # noqa: E731
        self._pipeline(call, sink, None)
        unfinished = np.ones(ids.shape[0], dtype=bool)
        length = prompt
        while True:
            pick = np.zeros(ids.shape[0], dtype=np.int64)
            if 0 in last:  # the last rank
                pick[:] = last.pop(0)[logits_at][:, -1].astype(np.float32).argmax(axis=-1)
            self._guard(lambda p=pick: dist.broadcast(torch.from_numpy(p), self.world - 1),
                        "token broadcast")
            if pad is not None:
                pick = np.where(unfinished, pick, pad)
            ids[:, length] = pick
            length += 1
            if eos_ids:
                unfinished &= ~np.isin(pick, eos_ids)
            if length == total or not unfinished.any():
                break
            call.chunks = ((length - 1, length),)
            self._pipeline(call, sink, None)
        if self.results == "rank0" and self.rank != 0:
            return None
        return ids[:, :length].copy()

    # -- the pipeline ---------------------------------------------------------------------------
    def _pipeline(self, call: OrtCall, sink: Callable[[int, list[np.ndarray]], None],
                  timeout: float | None) -> None:
        """This rank's stage over every chunk of ``call`` (receive, run, send)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending: list[tuple[list[Any], list[np.ndarray]]] = []
        self.last_trace = []
        i, start, end = 0, 0, 0
        try:
            for i, (start, end) in enumerate(call.chunks):
                received = self._recv(end - start, deadline) if self.rank else []
                self._comm._inject(i)
                t0 = time.perf_counter()
                out = self.stage.step(call, start, end, received)
                self.last_trace.append((self.rank, i, t0, time.perf_counter()))
                if self.rank + 1 < self.world:
                    pending.append(self._send(out))
                    while len(pending) > self._comm.queue_depth:
                        self._wait(pending.pop(0)[0], self.rank + 1, deadline)
                else:
                    sink(i, out)
            for works, _ in pending:
                self._wait(works, self.rank + 1, deadline)
        except (StageFailed, StageTimeout):
            raise
        except Exception as exc:
            where = f"stage {self.rank}, chunk {i} [{start}, {end})"
            if deadline is not None and time.monotonic() >= deadline:
                raise self._comm.timed_out(timeout, where) from exc
            raise self._comm.failure(exc, where) from exc

    def _send(self, values: list[np.ndarray]) -> tuple[list[Any], list[np.ndarray]]:
        dst = self.rank + 1
        self._comm._peer = dst
        arrays = [np.ascontiguousarray(v) for v in values]
        axes = self.plan["stages"][self.rank].get("boundary_axes") or [None] * len(arrays)
        if not self._header_sent or None in axes:
            header = [[str(a.dtype), list(a.shape)] for a in arrays]
            send_bytes(json.dumps(header).encode(), dst, None)
            self._header_sent = True
        return [dist.isend(torch.from_numpy(a), dst) for a in arrays], arrays

    def _recv(self, size: int, deadline: float | None) -> list[np.ndarray]:
        src = self.rank - 1
        self._comm._peer = src
        if self._templates is None or None in [t[2] for t in self._templates]:
            header = json.loads(recv_bytes(src, torch.device("cpu"), self._comm.span(deadline)))
            axes = self._axes_in or [None] * len(header)
            self._templates = [(d, s, a, s[a] // size if a is not None else 0)
                               for (d, s), a in zip(header, axes)]
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
        """Rank 0's bound inputs on every rank (validated there first; its error everywhere).
        Returns ``(flat, length)``, or ``((flat, length), extra)`` when ``extra`` is given."""
        flat: list[Any] = []
        meta: dict[str, Any] = {}
        if self.rank == 0:
            try:
                flat, length = bind()
                meta = {"length": length, "extra": extra, "arrays": [
                    [str(v.dtype), list(v.shape)] if isinstance(v, np.ndarray) else None
                    for v in flat]}
            except TppcError as exc:
                meta = {"error": f"{type(exc).__name__}: {exc}"}
                self._guard(lambda: _broadcast_bytes(json.dumps(meta).encode(), 0), "inputs")
                raise
        meta = json.loads(self._guard(lambda: _broadcast_bytes(
            json.dumps(meta).encode() if self.rank == 0 else None, 0), "inputs"))
        if "error" in meta:
            raise RuntimeInputError(f"rank 0 refused the inputs: {meta['error']}")
        if self.rank:
            specs = self.signature["inputs"]
            flat = [np.empty(a[1], dtype=np.dtype(a[0])) if a is not None
                    else specs[j].get("value") for j, a in enumerate(meta["arrays"])]
        for value in flat:
            if isinstance(value, np.ndarray):
                self._guard(lambda v=value: dist.broadcast(_tensor(v), 0), "inputs")
        shared = (flat, meta["length"])
        return shared if extra is None else (shared, meta["extra"])

    def _results(self, leaves: list[Any]) -> list[Any] | None:
        """The last rank's output leaves on rank 0 (or every rank)."""
        last = self.world - 1
        if last == 0:
            return leaves
        everyone = self.results == "all"
        if not everyone and self.rank not in (0, last):
            return None
        header = json.dumps([[str(v.dtype), list(v.shape)] for v in leaves]).encode() \
            if self.rank == last else None
        if everyone:
            header = self._guard(lambda: _broadcast_bytes(header, last), "results")
        elif self.rank == last:
            self._guard(lambda: send_bytes(header, 0, None), "results")
        else:
            header = self._guard(lambda: recv_bytes(last, torch.device("cpu"),
                                                     timedelta(seconds=self.comm_timeout)),
                                 "results")
        if self.rank != last:
            leaves = [np.empty(s, dtype=np.dtype(d)) for d, s in json.loads(header)]
        for v in leaves:
            t = _tensor(v)
            op = (lambda t=t: dist.broadcast(t, last)) if everyone else \
                (lambda t=t: dist.send(t, 0)) if self.rank == last else \
                (lambda t=t: dist.irecv(t, last).wait(timedelta(seconds=self.comm_timeout)))
            self._guard(op, "results")
        return leaves

    def _guard(self, op: Callable[[], Any], what: str) -> Any:
        try:
            return op()
        except TppcError:
            raise
        except Exception as exc:
            raise self._comm.failure(exc, f"the {what}") from exc


def _tensor(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor sharing its memory (bools as bytes: gloo has no bool)."""
    if not array.flags.c_contiguous:
        raise StageFailed("a non-contiguous array reached the transport. fix: report this")
    return torch.from_numpy(array.view(np.uint8) if array.dtype == np.bool_ else array)


def _broadcast_bytes(data: bytes | None, src: int) -> bytes:
    size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src)
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    if data is not None:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src)
    return buf.numpy().tobytes()
