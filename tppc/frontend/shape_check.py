"""Does the model itself take a call's sizes? Its ``forward`` run on fake tensors, no data.

Terms:
    fake forward: ``model.forward`` on :class:`FakeTensorMode` copies of the call's inputs
        (shapes, dtypes and devices, no data; the weights read as fakes too), in the model's
        shadow tree with its state restored afterwards (:func:`tppc.frontend.isolation.isolated`),
        under ``torch.no_grad``. It computes no value and costs about one eager call's Python
        time, far less than a capture (torch.export runs the same forward on fake tensors, and
        much more).
    refusal: the exception the fake forward raises for the sizes themselves (a convolution's
        channel count, a linear's hidden size, a reshape the width does not divide): a
        ``RuntimeError``, ``ValueError``, ``IndexError`` or ``AssertionError`` raised by the
        model's code or an operator's shape check. What a fake tensor cannot do (read a value:
        ``.item()``, ``.tolist()``, ``nonzero``; an operator without a meta kernel) is no
        refusal: the model may take the sizes, and the capture decides.

Used by :mod:`tppc.pipeline.captures` before it captures a call's new batch shape (a wrong
channel count, hidden size or width is named before any capture runs, not as torch.export's
failure) and for a call whose sequence axis is no whole number of units (a latent's height
the patch size does not divide: the model's own answer, not a silently shortened call).
"""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from tppc.frontend.isolation import isolated

__all__ = ["fake_forward", "refusal_text"]

_REFUSALS = (RuntimeError, ValueError, IndexError, AssertionError)
"""Exception types a model's code or an operator's shape check raises for wrong sizes."""

_FAKE_ONLY = ("FakeTensor", "fake tensor", "data-dependent", "data dependent", "data pointer",
              "meta tensor", "DataDependent", "symbolic", "SymInt")
"""Texts of errors a fake tensor causes (a value read, no meta kernel), not the sizes."""


def fake_forward(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[BaseException | None, Any]:
    """Run ``model`` on fake copies of ``args``/``kwargs`` (module docstring).

    Returns:
        ``(refusal, None)`` when the model refuses these sizes (the exception), else
        ``(None, outputs)``: the fake outputs, or ``None`` when the fake forward could not
        tell (a value read, an operator without a meta kernel, a model on the meta device).
    """
    if any(p.device.type == "meta" for p in model.parameters()):
        return None, None
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor,
                                                  (tuple(args), dict(kwargs)))
    log = logging.getLogger("torch._subclasses.fake_tensor")  # logs each refusal as an error
    try:
        with isolated(model) as shadow, _quiet(log), mode, torch.no_grad():
            return None, shadow(*fake_args, **fake_kwargs)
    except _REFUSALS as exc:
        if isinstance(exc, NotImplementedError) or _fake_only(exc):
            return None, None
        return exc, None
    except Exception:  # anything else: the fake forward cannot tell
        return None, None


@contextlib.contextmanager
def _quiet(log: logging.Logger) -> Iterator[None]:
    """``log`` disabled meanwhile (under the capture lock: no capture logs through it then)."""
    was, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = was


def refusal_text(exc: BaseException) -> str:
    """``"RuntimeError: <first line>"`` of a refusal."""
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[0]}"


def _fake_only(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    if module.startswith(("torch._subclasses", "torch.fx.experimental", "torch._dynamo",
                          "torch._guards")):
        return True
    return any(text in str(exc) for text in _FAKE_ONLY) or _meta_dtype_check(exc)


def _meta_dtype_check(exc: BaseException) -> bool:
    """A meta kernel's dtype requirement, written for one device's kernel (``_grouped_mm``
    wants bfloat16 on CUDA; its CPU kernel takes float32: Qwen3-Next's experts): not the
    sizes, which is what the fake forward asks."""
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    return "dtype" in str(exc) and any(f.endswith("_meta_registrations.py") for f in frames)
