"""Converting a compiled model's weights (``pipe.to(dtype)`` after ``pipe.transformer =
tppc.compile(...)``): refused by name, never run with the old weights.

Terms:
    weights: the ``(dtype, device)`` of the model's first floating parameter (or buffer):
        ``nn.Module.to`` and its kin convert every floating tensor, so one stands for all.
    conversion: ``to``, ``half``, ``float``, ``double``, ``bfloat16``, ``cpu``, ``cuda`` on
        the compiled pipeline. The compiled program holds the weights it was compiled with,
        so a conversion that changes them would leave the model and the program apart (a
        call with the old dtype ran the old weights silently); a conversion that changes
        nothing (``pipe.to("cpu")`` on a CPU pipeline) reaches the model as before.

Example:
    >>> check_conversion(model, "to", (torch.float64,), {})   # doctest: +SKIP
    SpecError: DiTTransformer2DModel.to(torch.float64) after tppc.compile: ...
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tppc.errors import RuntimeInputError, SpecError

__all__ = ["check_conversion", "check_weights", "weights"]

Weights = tuple[torch.dtype, torch.device] | None

_METHODS: dict[str, tuple[torch.dtype | None, str | None]] = {
    "half": (torch.float16, None), "float": (torch.float32, None),
    "double": (torch.float64, None), "bfloat16": (torch.bfloat16, None),
    "cpu": (None, "cpu"), "cuda": (None, "cuda")}
"""The conversion methods besides ``to``: the dtype or device type each one sets."""

_FIX = ("fix: convert the model before compiling it (pipe.to(dtype) before pipe.transformer "
        "= tppc.compile(...) or tppc.diffusers.compile_pipeline(pipe)), or compile the "
        "converted model again: tppc.compile(model.to(...), ...)")


def weights(model: torch.nn.Module) -> Weights:
    """The model's weights' ``(dtype, device)`` (module docstring); None without any."""
    tensors = (t for ts in (model.parameters(), model.buffers()) for t in ts)
    first = next((t for t in tensors if t.is_floating_point()), None)
    return None if first is None else (first.dtype, first.device)


def check_conversion(model: torch.nn.Module, method: str, args: tuple[Any, ...],
                     kwargs: Mapping[str, Any]) -> None:
    """Refuse ``model.<method>(*args, **kwargs)`` on a compiled model when it would change
    its weights' dtype or device.

    Raises:
        SpecError: naming the model, the call, the compiled weights and the fix.
    """
    have = weights(model)
    if have is None:
        return
    if method == "to":
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    else:
        dtype, kind = _METHODS[method]
        device = None if kind is None else torch.device(kind, *args[:1]) \
            if kind == "cuda" else torch.device(kind)
    same_dtype = dtype is None or dtype == have[0]
    same_device = device is None or (device.type == have[1].type and device.index in (
        None, have[1].index))
    if same_dtype and same_device:
        return
    shown = ", ".join([*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    raise SpecError(
        f"{type(model).__name__}.{method}({shown}) after tppc.compile: the compiled program "
        f"keeps the weights it was compiled with ({have[0]} on {have[1]}), so the model and "
        f"the program would differ (a call would run the old weights). {_FIX}")


def check_weights(model: torch.nn.Module, compiled: Weights) -> None:
    """Refuse a call when the model's weights were converted after the compile (by
    ``model.to(...)`` itself, past the compiled pipeline).

    Raises:
        RuntimeInputError: naming both dtypes and devices and the fix.
    """
    now = weights(model)
    if now != compiled and compiled is not None and now is not None:
        raise RuntimeInputError(
            f"{type(model).__name__}'s weights are {now[0]} on {now[1]}, but it was compiled "
            f"with {compiled[0]} on {compiled[1]} and the compiled program keeps those "
            f"weights. {_FIX}, or convert the model back")
