"""Runtime edges of a compiled pipeline: checking inputs, placing stages, assembling outputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from tppc.backends.torch_local import Call
from tppc.errors import RuntimeInputError, SpecError
from tppc.planner.plan import StagePlan

__all__ = ["OutputAssembler", "check_input", "device_for"]


class OutputAssembler:
    """Writes each chunk's outputs into full-length outputs as the chunk arrives (a sink).

    Outputs the last stage already wrote in place (``call.outputs``) are not copied.
    """

    def __init__(self, axes: tuple[int | None, ...], call: Call) -> None:
        self.axes, self.call = axes, call
        self.leaves: list[Any] = list(call.outputs) if call.outputs else [None] * len(axes)

    def __call__(self, index: int, values: tuple[Any, ...]) -> None:
        start, end = self.call.chunks[index]
        for j, (axis, value) in enumerate(zip(self.axes, values)):
            if axis is None:
                self.leaves[j] = value
                continue
            if self.leaves[j] is None:
                shape = list(value.shape)
                shape[axis] = self.call.seq_len
                self.leaves[j] = value.new_empty(shape)
            target = self.leaves[j].narrow(axis, start, end - start)
            if not _same_view(target, value):
                target.copy_(value)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def check_input(ph: fx.Node, value: Any) -> None:
    """Check one flat input against its captured placeholder (type, dtype, rank, sizes).

    Raises:
        RuntimeInputError: naming the input, what it is, what was compiled, and the fix.
    """
    val = ph.meta.get("val")
    if not isinstance(val, torch.Tensor):
        if val is not None and value != val:
            raise RuntimeInputError(f"input {ph.name!r} is {value!r}, compiled with {val!r}. "
                                    f"fix: pass {ph.name}={val!r}")
        return
    if not isinstance(value, torch.Tensor):
        raise RuntimeInputError(f"input {ph.name!r} must be a tensor, got {type(value).__name__}")
    if value.dtype != val.dtype or value.dim() != val.dim():
        raise RuntimeInputError(
            f"input {ph.name!r} is {value.dtype} of rank {value.dim()}, compiled for "
            f"{val.dtype} of rank {val.dim()}. fix: pass a {val.dtype} tensor of rank "
            f"{val.dim()}")
    for axis, (got, want) in enumerate(zip(value.shape, val.shape)):
        if not isinstance(want, torch.SymInt) and got != int(want):
            raise RuntimeInputError(
                f"input {ph.name!r} has size {got} on axis {axis} (shape "
                f"{tuple(value.shape)}), compiled for {int(want)} (a batch size the plan was "
                f"not made for?). fix: compile with an example of that shape")


def device_for(stage: StagePlan, s: int, devices: Sequence[str | torch.device] | None
                ) -> torch.device:
    """The torch device of stage ``s``: ``devices[s]``, ``cpu`` for CPU presets, else CUDA."""
    if devices is not None:
        if len(devices) < s + 1:
            raise SpecError(f"devices={list(devices)} names {len(devices)} devices, the plan "
                            f"has more stages. fix: give one device per stage")
        return torch.device(devices[s])
    if stage.device_name == "cpu":
        return torch.device("cpu")
    if torch.cuda.is_available() and torch.cuda.device_count() > stage.device_index:
        return torch.device("cuda", stage.device_index)
    raise SpecError(
        f"stage {s} is planned for a {stage.device_name}, but cuda:{stage.device_index} is not "
        f"available here. fix: pass devices=['cpu', ...] to run the stages on this machine")
