"""Stream a distributed call's outputs to rank 0 chunk by chunk, while later chunks compute.

Terms:
    stream: the last rank posts an asynchronous send (``isend``) of every chunk's outputs as
        soon as it has them; rank 0, once its own stage is done, receives them in chunk order
        into full-length outputs. The transfer of chunk ``i`` overlaps the last stage's work on
        chunks ``i + 1 …`` instead of following the whole call (logits are the largest value
        a causal LM returns: ``L × vocab``).
    header: sent once per call before the first chunk's tensors, in the wire format
        (:mod:`tppc.backends.wire`, no pickle): the first chunk's size and each output's
        dtype and shape for it.

Streaming is used when every output has a token axis and there is no global epilogue; the
ranks decide that from the same program, so they agree without a message. When rank 0 and
the last rank share a machine the outputs go through shared memory instead
(:mod:`tppc.distributed.shared_results`); the header tells rank 0 which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tppc.backends import wire
from tppc.distributed.shared_results import map_outputs

__all__ = ["ResultSender", "receive_results", "streamable"]


def streamable(output_axes: tuple[int | None, ...], has_tail: bool) -> bool:
    """Whether a call's outputs can be streamed (every output a token value, no tail)."""
    return bool(output_axes) and not has_tail and all(a is not None for a in output_axes)


class ResultSender:
    """The last rank's sink: assembles locally and sends each chunk's outputs to ``dst``.

    Args:
        assembler: the local sink (keeps the last rank's full outputs consistent).
        chunks: the call's chunks.
        dst: rank 0.
    """

    def __init__(self, assembler: Callable[[int, tuple[Any, ...]], None],
                 chunks: tuple[tuple[int, int], ...], dst: int) -> None:
        self.assembler, self.chunks, self.dst = assembler, chunks, dst
        self._pending: list[tuple[Any, Any]] = []

    def __call__(self, index: int, values: tuple[Any, ...]) -> None:
        self.assembler(index, values)
        tensors = [v.detach().contiguous() for v in values]
        if index == 0:
            start, end = self.chunks[0]
            self._pending += wire.post_header({"size": end - start, "outputs": tensors},
                                              self.dst)
        for t in tensors:  # each tensor stays alive until its send completed
            self._pending.append((dist.isend(t, self.dst), t))

    def finish(self, wait: wire.Wait) -> None:
        """Wait until rank 0 has received every chunk (each send bounded by ``wait``)."""
        for work, _ in self._pending:
            work.wait(wire.span(wait))
        self._pending.clear()


def receive_results(chunks: tuple[tuple[int, int], ...], axes: tuple[int | None, ...],
                    length: int, src: int, device: torch.device, wait: wire.Wait
                    ) -> list[torch.Tensor]:
    """Rank 0: receive what :class:`ResultSender` sent into full-length outputs (or map
    those a :class:`tppc.distributed.shared_results.SharedOutputs` header names); each receive
    bounded by ``wait``."""
    header = wire.recv_header(src, "cpu", wait)
    if "shared" in header:  # the last rank wrote them into shared memory
        return map_outputs(header, src)
    first = header["size"]
    specs = [(wire.torch_dtype(o.dtype), list(o.shape)) for o in header["outputs"]]
    full = []
    for (dtype, shape), axis in zip(specs, axes):
        rows = shape[axis] // first
        whole = list(shape)
        whole[axis] = rows * length
        full.append(torch.empty(whole, dtype=dtype, device=device))
    for start, end in chunks:
        for (dtype, shape), axis, out in zip(specs, axes, full):
            rows = shape[axis] // first
            part = list(shape)
            part[axis] = rows * (end - start)
            view = out.narrow(axis, rows * start, rows * (end - start))
            buf = view if view.is_contiguous() else torch.empty(part, dtype=dtype,
                                                                 device=device)
            dist.irecv(buf, src).wait(wire.span(wait))
            if buf is not view:
                view.copy_(buf)
    return full
