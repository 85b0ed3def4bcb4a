"""A distributed call's outputs in shared memory, when rank 0 and the last rank share a machine.

Terms:
    shared outputs: the last rank creates one file in ``/dev/shm`` holding every full-length
        output (each at a 64-byte aligned offset), maps it and lets its stage write each
        chunk's rows in place (the same direct writes as the ``threads`` executor). After its
        last chunk it sends rank 0 a header (:mod:`tppc.backends.wire`: the file's path, each
        output's dtype, shape and offset); rank 0 maps the file, unlinks it and returns tensors over the mapping:
        no bytes cross a socket, and rank 0 has its outputs as soon as the last chunk is done.
        The last rank touches the file's pages when it creates it, at the start of the call
        while it waits for its first chunk, so its stage does not take the page faults. The last rank unlinks
        the file once rank 0 acknowledged the mapping, or when the call fails.
    owner lock: the file ``/dev/shm/tppc-<pid>-<n>`` is owned by the last rank
        (:mod:`tppc.processes.owned_files`: locked until it is unlinked, the lock dropped by
        the kernel however the rank dies). :func:`sweep_dead` removes the files of dead
        owners: a failed call's survivors, every rank joining a job and :func:`tppc.launch`
        call it, so a rank killed with SIGKILL leaves nothing once a tppc process looks
        again; a rank's signal handlers release its own (:mod:`tppc.processes.rank_exit`).
    one machine: every rank of the job runs on this node (``LOCAL_WORLD_SIZE ==
        WORLD_SIZE``, as torchrun and :func:`tppc.launch` set them), ``/dev/shm`` exists and
        has room for twice the outputs; otherwise the outputs are streamed over the process
        group (:mod:`tppc.distributed.result_stream`), and rank 0 tells the two apart from the
        header it receives.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tppc.backends import wire
from tppc.errors import StageFailed
from tppc.processes import owned_files

__all__ = ["SharedOutputs", "map_outputs", "sweep_dead"]

_ROOT = owned_files.SHM_ROOT
_ALIGN = 64
_PREFIX = owned_files.SHM_PREFIX


class SharedOutputs:
    """The last rank's full-length outputs in one shared-memory file (module docstring).

    Args:
        specs: ``(shape, dtype)`` of each output.
    """

    def __init__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> None:
        self.entries, offset = [], 0
        for shape, dtype in specs:
            nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
            self.entries.append({"dtype": str(dtype).removeprefix("torch."),
                                 "shape": list(shape), "offset": offset})
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = max(offset, _ALIGN)
        self.path = owned_files.create_file(_ROOT, _PREFIX)
        try:
            whole = torch.from_file(str(self.path), shared=True, size=self.nbytes,
                                    dtype=torch.uint8)
            whole.zero_()  # faults the pages in now, while this rank waits for its first chunk
        except BaseException:
            owned_files.release(self.path)
            raise
        self.tensors = tuple(_view(whole, e) for e in self.entries)

    @staticmethod
    def possible(specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> bool:
        """Whether this job can hand ``specs`` over in shared memory (module docstring)."""
        if os.environ.get("LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE", "?"):
            return False
        if os.environ.get("TPPC_SHARED_OUTPUTS", "1") == "0" or not _ROOT.is_dir():
            return False
        need = sum(_numel(s) * torch.empty((), dtype=d).element_size() for s, d in specs)
        stat = os.statvfs(_ROOT)
        return stat.f_bavail * stat.f_frsize > 2 * need + (64 << 20)

    def send(self, dst: int, wait: wire.Wait) -> None:
        """Tell ``dst`` (rank 0) where the outputs are and wait until it mapped them (each
        wait bounded by ``wait``)."""
        header = {"shared": str(self.path), "nbytes": self.nbytes, "outputs": self.entries}
        for work, _ in wire.post_header(header, dst):
            work.wait(wire.span(wait))
        ack = torch.zeros(1, dtype=torch.uint8)
        dist.irecv(ack, dst).wait(wire.span(wait))

    def close(self) -> None:
        """Unlink the file (rank 0 mapped it, or the call failed: nothing is left)."""
        owned_files.release(self.path)


def sweep_dead() -> list[Path]:
    """Remove the shared-output files of dead processes on this machine; returns them."""
    return owned_files.sweep(_ROOT, _PREFIX)


def map_outputs(header: dict[str, Any], src: int) -> list[torch.Tensor]:
    """Rank 0: the outputs a :class:`SharedOutputs` header names; acknowledges to ``src``
    (the last rank), which then unlinks the file."""
    path = header["shared"]
    if not (isinstance(path, str) and Path(path).parent == _ROOT
            and Path(path).name.startswith("tppc-")):
        raise StageFailed(f"the last rank named the shared outputs {path!r}, not a file "
                          f"{_ROOT}/tppc-*. fix: run the same tppc version on every rank")
    try:
        whole = torch.from_file(path, shared=True, size=header["nbytes"], dtype=torch.uint8)
    finally:
        Path(path).unlink(missing_ok=True)
    dist.send(torch.ones(1, dtype=torch.uint8), src)
    return [_view(whole, e) for e in header["outputs"]]


def _view(whole: torch.Tensor, entry: dict[str, Any]) -> torch.Tensor:
    dtype = wire.torch_dtype(entry["dtype"])
    nbytes = _numel(entry["shape"]) * torch.empty((), dtype=dtype).element_size()
    return whole.narrow(0, entry["offset"], nbytes).view(dtype).view(entry["shape"])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
