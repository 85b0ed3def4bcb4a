"""What the tests compare tppc against, written once: the eager references and their tolerance.

Terms:
    kernel tolerance: how far two float computations of the same function may differ when
        different kernels run them (ONNX Runtime against torch, chunked against whole
        attention, a pipelined run against the eager model): their sums run in another
        order, so they round differently, and by how much depends on the CPU.
    oracle: a result computed from the eager model and the scheduler alone (never from
        tppc), here the serial denoise loop and greedy decoding.
    two-stage plan: a compiled model's layers in two halves over two stages.

Comparisons that are exact by construction (bit-identical runs) use ``rtol=0, atol=0`` in
the tests themselves, never this tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tppc.planner.manual import manual_plan

if TYPE_CHECKING:
    from tppc import CompiledPipeline
    from tppc.planner.plan import Plan

__all__ = ["ULPS_PER_CALL", "assert_kernels_close", "greedy_reference", "kernel_tolerance",
           "serial_denoise", "two_stage_plan"]

ULPS_PER_CALL = 2048
"""Units of the dtype's epsilon, times the largest value, that one model call may drift by."""


def _tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))


def kernel_tolerance(want: Any, depth: int = 1, dtype: torch.dtype | None = None) -> float:
    """``ULPS_PER_CALL · eps(dtype) · depth · max(1, max|want|)``: the absolute difference
    allowed between two kernels' results of ``depth`` chained model calls (1 for one call,
    the step count for a denoise loop) whose reference is ``want`` (``dtype``: the coarser
    of the two results' float types, ``want``'s by default).

    Why this rule: reordering a sum of n terms changes it by up to about n·eps times the
    sum of the terms' magnitudes, not the result's, so the bound scales with the largest
    value (at least 1: the models normalise their activations to about 1, and an output
    near 0 is a difference of such values) rather than element by element; each chained
    call adds its own rounding, so it grows with the depth. 2^11 ulps per call covers the
    few reductions of width up to a few hundred that a test model's call runs (1.1e-4 was
    seen after 3 Flux steps of ONNX Runtime against torch on another 2-core CPU), and is at
    least the old fixed ``atol = rtol = 1e-4`` wherever a value reaches 1; yet in float32 it
    is 2.4e-4 of the largest value per call, well below what a wrong mask, a stale chunk or
    a dropped token moves (percents).
    """
    t = _tensor(want)
    scale = max(1.0, float(t.abs().max())) if t.numel() else 1.0
    return ULPS_PER_CALL * torch.finfo(dtype or t.dtype).eps * depth * scale


def assert_kernels_close(got: Any, want: Any, *, depth: int = 1) -> None:
    """``got`` equals the reference ``want`` to :func:`kernel_tolerance` (torch tensors or
    numpy arrays; the dtypes must agree when both are tensors)."""
    g, w = _tensor(got), _tensor(want)
    coarser = max(g.dtype, w.dtype, key=lambda d: torch.finfo(d).eps)
    both = isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)
    torch.testing.assert_close(g, w, rtol=0, atol=kernel_tolerance(w, depth, coarser),
                               check_dtype=both)


def serial_denoise(model: Callable[..., Any], x: torch.Tensor, scheduler: Any,
                   steps: int | None, *, timestep_arg: str = "timestep",
                   model_kwargs: Mapping[str, Any] | None = None,
                   output_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   timestep_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   **set_timesteps: Any) -> torch.Tensor:
    """diffusers' denoising loop on the eager model, without guidance: ``set_timesteps``
    (``steps``, or only the keywords such as ``sigmas=``, ``mu=``, ``timesteps=`` when
    ``steps`` is None), then per timestep ``scale_model_input`` (where the scheduler has
    it) → the model (the timestep expanded to the batch, then ``timestep_transform``; the
    first output of a tuple or model output, then ``output_transform``) → ``step``."""
    if steps is None:
        scheduler.set_timesteps(**set_timesteps)
    else:
        scheduler.set_timesteps(steps, **set_timesteps)
    scale = getattr(scheduler, "scale_model_input", lambda sample, t: sample)
    with torch.no_grad():
        for t in scheduler.timesteps:
            timestep = t.expand(len(x))
            timestep = timestep_transform(timestep) if timestep_transform else timestep
            out = model(scale(x, t), **{timestep_arg: timestep}, **(model_kwargs or {}))
            out = out if isinstance(out, torch.Tensor) else out[0]
            out = output_transform(out) if output_transform else out
            x = scheduler.step(out, t, x).prev_sample
    return x


def greedy_reference(model: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor,
                     new_tokens: int) -> torch.Tensor:
    """Greedy decoding by the eager model's forward over the whole sequence at every step
    (no cache, no end token): ``ids`` followed by ``new_tokens`` argmax tokens."""
    with torch.no_grad():
        for _ in range(new_tokens):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def two_stage_plan(one: CompiledPipeline) -> Plan:
    """A plan of ``one``'s (a compiled pipeline's) layers in two halves over two stages, its
    whole sequence in one chunk."""
    n, length = len(one.context.layers), one.plan.seq_len
    return manual_plan(n, length, cuts=(0, n // 2, n), boundaries=(0, length))
