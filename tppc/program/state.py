"""Per-call state of a pipeline: K/V buffers, positional values, fill level; and a pool.

Terms:
    call: one run of a program on one sequence (:class:`Call`): the flat user inputs, the
        chunks, the sequence length, the length positional values are evaluated at, and the
        full-length outputs the last stage writes into.
    call state: what a call mutates (:class:`CallState`): one K/V buffer per (buffer name,
        device) with room for ``capacity`` units of the sequence (a unit: a token; a block
        of ``k`` tokens in a block capture, :mod:`tppc.frontend.block_capture`), each stage's
        positional values, and how many tokens the buffers hold. Each call owns its state while it runs, so concurrent
        calls of one pipeline never share buffers.
    pool: idle states kept for reuse (:class:`StatePool`); a call takes one (or a new one),
        grows it to the units it needs, and gives it back when it ends without error.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tppc.program.program import BufferSpec, StageProgram

__all__ = ["Call", "CallState", "StatePool"]

_EPOCHS = itertools.count()


def next_epoch() -> int:
    """A fresh key for positional values (see :class:`Call`)."""
    return next(_EPOCHS)


@dataclass(frozen=True)
class Call:
    """One run of a program (see the module docstring).

    Attributes:
        flat_inputs: the model's flat user inputs (full sequence).
        chunks: ``(start, end)`` token ranges, in order.
        seq_len: tokens in the sequence.
        pos_len: length the positional values are evaluated at (``≥`` every chunk's end).
        epoch: calls with the same ``(epoch, pos_len)`` reuse the positional values
            (``generate`` evaluates them once for all its steps).
        outputs: full-length model outputs (by flat output index, ``None`` where absent)
            that the last stage writes its out slots into; empty: fresh tensors per chunk.
    """

    flat_inputs: tuple[Any, ...]
    chunks: tuple[tuple[int, int], ...]
    seq_len: int
    pos_len: int
    epoch: int
    outputs: tuple[Any, ...] = ()


class CallState:
    """K/V buffers, positional values and fill level of one call (see the module docstring).

    Attributes:
        capacity: units of the sequence every buffer holds (a block capture's unit: a block).
        filled: tokens the buffers hold valid K/V for (after the call: its length in tokens,
            not units: a block capture's K/V buffer holds ``k`` rows per block).
        uses: how many calls have used this state (``kv_cache`` checks it was not reused).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.filled = 0
        self.uses = 0
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._specs: dict[tuple[str, str], BufferSpec] = {}
        self._positional: dict[int, tuple[Any, tuple[Any, ...]]] = {}
        self.consts: dict[Any, Any] = {}  # hoisted const values (tppc.passes.stages.hoist_consts)

    def reserve(self, capacity: int) -> None:
        """Hold at least ``capacity`` units of the sequence (tokens; blocks of ``k`` tokens
        in a block capture); growing keeps the buffers' contents."""
        if capacity <= self.capacity:
            return
        for key, old in list(self._buffers.items()):
            axis = self._specs[key].axis
            if axis is None:  # a recurrent node's state: not sized by the length
                continue
            shape = list(old.shape)
            shape[axis] = self._specs[key].rows(capacity)
            with torch.inference_mode(False):  # reusable by calls outside inference mode
                new = old.new_zeros(shape)
            new.narrow(axis, 0, old.shape[axis]).copy_(old)
            self._buffers[key] = new
        self.capacity = capacity

    def buffers(self, stage: StageProgram) -> dict[str, torch.Tensor]:
        """The stage's K/V buffers by placeholder name (allocated on first use)."""
        return {b.name: self._buffer(b, stage.device) for b in stage.buffers}

    def buffer(self, name: str) -> torch.Tensor:
        """The buffer named ``name`` (on whichever device holds it).

        Raises:
            KeyError: no stage has used that buffer in this state.
        """
        found = [t for (n, _), t in self._buffers.items() if n == name]
        if not found:
            raise KeyError(f"no K/V buffer {name!r} in this call state")
        return found[0]

    def positional(self, stage: StageProgram, key: Any) -> tuple[Any, ...] | None:
        """The stage's positional values computed under ``key``, or None."""
        entry = self._positional.get(id(stage.positional))  # shared by a stage's parts
        return entry[1] if entry is not None and entry[0] == key else None

    def set_positional(self, stage: StageProgram, key: Any, values: tuple[Any, ...]) -> None:
        """Remember the stage's positional values computed under ``key``."""
        self._positional[id(stage.positional)] = (key, values)

    def reset(self) -> None:
        """Zero every K/V buffer (a new generation must not see the last one's K/V)."""
        for tensor in self._buffers.values():
            tensor.zero_()
        self.consts.clear()
        self.filled = 0

    def nbytes(self) -> int:
        """Bytes of the K/V buffers it holds."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _buffer(self, spec: BufferSpec, device: torch.device) -> torch.Tensor:
        key = (spec.name, str(device))
        if key not in self._buffers or self._specs[key] != spec:  # new, or another shape
            with torch.inference_mode(False):  # reusable by calls outside inference mode
                self._buffers[key] = spec.allocate(self.capacity, device)
            self._specs[key] = spec
        return self._buffers[key]


class StatePool:
    """Idle call states kept for reuse; thread-safe.

    Args:
        keep: idle states kept at most (each holds every K/V buffer at its capacity); more
            concurrent calls allocate more states, and the extra ones are freed as they end.
    """

    def __init__(self, keep: int = 1) -> None:
        self.keep = keep
        self._idle: list[CallState] = []
        self._lock = threading.Lock()

    def acquire(self, capacity: int) -> CallState:
        """A state holding at least ``capacity`` units of the sequence (tokens; blocks of
        ``k`` tokens in a block capture), owned by the caller until released."""
        with self._lock:
            state = self._idle.pop() if self._idle else None
        if state is None:
            state = CallState(capacity)
        state.reserve(capacity)
        state.uses += 1
        state.filled = 0
        return state

    def release(self, state: CallState) -> None:
        """Give ``state`` back (the most recent is reused first)."""
        with self._lock:
            self._idle.append(state)
            del self._idle[: max(0, len(self._idle) - self.keep)]

    def idle(self) -> Sequence[CallState]:
        """The idle states (for memory reports)."""
        with self._lock:
            return tuple(self._idle)
