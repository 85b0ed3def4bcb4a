"""The one wire format between the ranks of a job: a JSON header, then raw tensor bytes.

Terms:
    tree: what a message carries: None, bools, ints, floats, strings, lists, tuples, dicts
        (string or int keys), torch tensors and numpy arrays, nested.
    header: the tree as JSON (UTF-8). A tensor is written ``{"tensor": [dtype, shape,
        device type]}``, a numpy array ``{"array": [dtype, shape]}``, a tuple
        ``{"tuple": [...]}``, a dict ``{"dict": [[key, value], ...]}``; every other value is
        itself. Decoded, each tensor or array is a :class:`TensorSpec`.
    payload: the bytes of the tree's tensors and arrays, in tree order, each as one flat
        ``uint8`` view of its memory (so any dtype crosses gloo or NCCL, bools included); one
        without elements sends nothing.
    message: the header's length (one int64), the header, then the payload. A handshake
        (:mod:`tppc.backends.torch_distributed`) and the result stream send a header alone:
        it describes tensors whose bytes follow later, chunk by chunk.

No pickle: a rank parses JSON, allocates only the buffers a header names (numeric and bool
dtypes, checked) and receives bytes into them; nothing it receives is executed.

Example (no process group needed to encode and decode):
    >>> header, payload = encode({"ids": torch.zeros(2, 3, dtype=torch.int64), "n": None})
    >>> header
    b'{"dict": [["ids", {"tensor": ["int64", [2, 3], "cpu"]}], ["n", null]]}'
    >>> decode(header)["ids"]
    TensorSpec(kind='tensor', dtype='int64', shape=(2, 3), device='cpu')
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist

from tppc.errors import RuntimeInputError, StageFailed

__all__ = ["TensorSpec", "Wait", "allocate", "broadcast", "byte_view", "decode", "encode",
           "post_header", "recv", "recv_header", "send", "send_header", "span", "torch_dtype"]

Wait = timedelta | Callable[[], timedelta]
"""How long one receive may wait: a fixed span, or a function giving the span left now (a
call's deadline: each wait of a message ends by it, not one span after the previous one)."""


def span(wait: Wait) -> timedelta:
    """The span the next wait may last (``wait()`` when it is a function)."""
    return wait() if callable(wait) else wait

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: d for name, d in vars(torch).items() if isinstance(d, torch.dtype)}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor (or numpy array) as a header describes it: what a receiver allocates."""

    kind: Literal["tensor", "array"]
    dtype: str
    shape: tuple[int, ...]
    device: str = "cpu"

    def empty(self, device: torch.device | str | None = None) -> Any:
        """An uninitialised tensor (on ``device``, default: CPU) or array of this spec."""
        if self.kind == "array":
            return np.empty(self.shape, dtype=_numpy_dtype(self.dtype))
        return torch.empty(self.shape, dtype=torch_dtype(self.dtype), device=device or "cpu")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a header names (``"float32"``, ``"bool"``...).

    Raises:
        StageFailed: the name is no torch dtype.
    """
    dtype = _TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise StageFailed(f"a wire header names the dtype {name!r}, which is no torch dtype. "
                          "fix: run the same tppc and torch versions on every rank")
    return dtype


def _numpy_dtype(name: str) -> np.dtype:
    try:
        dtype = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "biufc" or dtype.name != name:
        raise StageFailed(f"a wire header names the array dtype {name!r}; only numeric and "
                          "bool arrays travel. fix: run the same tppc version on every rank")
    return dtype


# -- header -------------------------------------------------------------------------------------
def encode(tree: Any) -> tuple[bytes, list[Any]]:
    """The header of ``tree`` and its payload (its tensors and arrays in tree order, made
    contiguous; keep them alive until their sends complete).

    Raises:
        RuntimeInputError: a value that has no wire form, naming where it sits in ``tree``.
    """
    payload: list[Any] = []
    return json.dumps(_encode(tree, payload, "value")).encode(), payload


def _encode(value: Any, payload: list[Any], where: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.Tensor):
        payload.append(value.detach().contiguous())
        return {"tensor": [str(value.dtype).removeprefix("torch."), list(value.shape),
                           value.device.type]}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        payload.append(np.ascontiguousarray(value))
        return {"array": [value.dtype.name, list(value.shape)]}
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return value.item()
    if isinstance(value, list):
        return [_encode(v, payload, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"tuple": [_encode(v, payload, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict) and all(isinstance(k, str | int) and not isinstance(k, bool)
                                       for k in value):
        return {"dict": [[k, _encode(v, payload, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise RuntimeInputError(
        f"{where} is a {type(value).__name__}, which cannot travel between ranks (tppc sends "
        "tensors, numeric arrays, numbers, strings, None, lists, tuples and dicts with "
        "string keys as JSON + raw bytes, never pickle). fix: pass it as one of those")


def decode(header: bytes) -> Any:
    """The tree of a header, each tensor or array as a :class:`TensorSpec`.

    Raises:
        StageFailed: the header is not one :func:`encode` writes.
    """
    try:
        return _decode(json.loads(header.decode()))
    except (ValueError, TypeError, KeyError) as exc:
        raise StageFailed(f"a wire header could not be read ({exc}): {header[:120]!r}. "
                          "fix: run the same tppc version on every rank") from exc


def _decode(node: Any) -> Any:
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if not isinstance(node, dict):
        return node
    (tag, body), = node.items()
    if tag == "tuple":
        return tuple(_decode(v) for v in body)
    if tag == "dict":
        return {k: _decode(v) for k, v in body}
    if tag in ("tensor", "array"):
        dtype, shape = body[0], tuple(body[1])
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise ValueError(f"bad shape {list(shape)}")
        device = body[2] if tag == "tensor" else "cpu"
        if tag == "tensor":
            torch_dtype(dtype)
        else:
            _numpy_dtype(dtype)
        if device not in ("cpu", "cuda"):
            raise ValueError(f"bad device type {device!r}")
        return TensorSpec(tag, dtype, shape, device)
    raise ValueError(f"unknown tag {tag!r}")


def allocate(tree: Any, device: torch.device | str | None = None) -> tuple[Any, list[Any]]:
    """``tree`` with each :class:`TensorSpec` an empty tensor (on ``device``) or array, and
    those buffers in tree order (what the payload fills)."""
    buffers: list[Any] = []

    def fill(node: Any) -> Any:
        if isinstance(node, TensorSpec):
            buffers.append(node.empty(device))
            return buffers[-1]
        if isinstance(node, list | tuple):
            return type(node)(fill(v) for v in node)
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        return node

    return fill(tree), buffers


def byte_view(value: Any) -> torch.Tensor:
    """A flat ``uint8`` tensor over the memory of a contiguous tensor or array (no copy)."""
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.reshape(-1).view(np.uint8))
    return value.reshape(-1).view(torch.uint8)


# -- transport ----------------------------------------------------------------------------------
def _on(device: torch.device | str | None) -> torch.device:
    """The transport's device: ``device``, else this rank's CUDA device under NCCL, else CPU."""
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def send_header(tree: Any, dst: int, device: torch.device | str | None = None) -> None:
    """Send ``tree``'s header alone to ``dst`` (blocking): a handshake."""
    _send_bytes(encode(tree)[0], dst, _on(device))


def _send_bytes(header: bytes, dst: int, on: torch.device) -> None:
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(on)
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64, device=on), dst)
    dist.send(payload, dst)


def post_header(tree: Any, dst: int) -> list[tuple[Any, torch.Tensor]]:
    """Post the sends of ``tree``'s header to ``dst`` (CPU); returns ``(work, tensor)`` pairs
    to wait on (the tensors stay alive until then)."""
    header, _ = encode(tree)
    payload = torch.frombuffer(bytearray(header), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [(dist.isend(size, dst), size), (dist.isend(payload, dst), payload)]


def recv_header(src: int, device: torch.device | str | None, wait: Wait) -> Any:
    """A header from ``src``, decoded (tensors as :class:`TensorSpec`)."""
    on = _on(device)
    size = torch.empty(1, dtype=torch.int64, device=on)
    dist.irecv(size, src).wait(span(wait))
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=on)
    dist.irecv(payload, src).wait(span(wait))
    return decode(payload.cpu().numpy().tobytes())


def send(tree: Any, dst: int, device: torch.device | str | None = None) -> None:
    """Send ``tree`` to ``dst`` (blocking): its header, then its payload."""
    on = _on(device)
    header, payload = encode(tree)
    _send_bytes(header, dst, on)
    for value in payload:
        if _numel(value):
            dist.send(byte_view(_to(value, on)), dst)


def recv(src: int, device: torch.device | str | None, wait: Wait) -> Any:
    """What :func:`send` sent from ``src``; tensors on ``device`` (CPU ones on the CPU)."""
    on = _on(device)
    tree = recv_header(src, on, wait)
    filled, buffers = allocate(tree, on)
    for buf in buffers:
        if _numel(buf):
            dist.irecv(byte_view(buf), src).wait(span(wait))
    return _home(tree, filled)


def broadcast(tree: Any, src: int, device: torch.device | str | None = None) -> Any:
    """``tree`` of rank ``src`` on every rank (the others pass anything, e.g. None); ``src``
    gets its own ``tree`` back, the others tensors on ``device`` (CPU ones on the CPU)."""
    on = _on(device)
    mine = dist.get_rank() == src
    header, payload = encode(tree) if mine else (b"", [])
    size = torch.tensor([len(header)], dtype=torch.int64, device=on)
    dist.broadcast(size, src)
    data = torch.empty(int(size.item()), dtype=torch.uint8, device=on)
    if mine:
        data.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    dist.broadcast(data, src)
    if mine:
        for value in payload:
            if _numel(value):
                dist.broadcast(byte_view(_to(value, on)), src)
        return tree
    spec = decode(data.cpu().numpy().tobytes())
    filled, buffers = allocate(spec, on)
    for buf in buffers:
        if _numel(buf):
            dist.broadcast(byte_view(buf), src)
    return _home(spec, filled)


def _numel(value: Any) -> int:
    return int(value.size if isinstance(value, np.ndarray) else value.numel())


def _to(value: Any, device: torch.device) -> Any:
    """A tensor on the transport's device (arrays travel as they are: gloo, CPU)."""
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device)
    return value


def _home(spec: Any, filled: Any) -> Any:
    """``filled`` with each tensor moved to the device type its spec names (a CPU tensor sent
    over NCCL comes back to the CPU)."""
    if isinstance(spec, TensorSpec):
        return filled.cpu() if spec.device == "cpu" and isinstance(filled, torch.Tensor) \
            else filled
    if isinstance(spec, list | tuple):
        return type(spec)(_home(s, f) for s, f in zip(spec, filled))
    if isinstance(spec, dict):
        return {k: _home(spec[k], filled[k]) for k in spec}
    return filled

