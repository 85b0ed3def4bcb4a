"""Diffusers schedulers under PipeFusion: which ones act element-wise, and one copy per patch.

Terms:
    element-wise scheduler: its ``step(model_output, t, sample)`` computes every element of
        ``prev_sample`` from the same elements of its inputs (and of its own history), so a
        patch can be stepped alone: DDIM (``eta = 0``), Euler, flow-matching Euler, DPM-Solver
        multistep (its history of model outputs is kept per patch).
    patch scheduler: a copy of the scheduler for one patch, its per-sample history (tensors
        shaped like the latents) cut to the patch's rows; it is stepped once per step, so
        its step counter advances as the whole image's would.
    step protocol: what every diffusers pipeline's loop calls, per step ``t``:
        ``model_in = scheduler.scale_model_input(latents, t)`` before the model (Euler
        divides by ``sqrt(sigma² + 1)``; DDIM is the identity; a scheduler without it, e.g.
        flow-matching Euler, passes the latents through), then
        ``latents = scheduler.step(model_output, t, latents).prev_sample``. The loop starts
        at the first timestep (``set_begin_index(0)`` where the scheduler has it, as
        text-to-image pipelines do). :class:`StepProtocol` runs it on a band of rows: the
        whole latents (warm-up, the caller's scheduler) or one patch (its copy).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from tppc.errors import SpecError

__all__ = ["ELEMENTWISE_SCHEDULERS", "StepProtocol", "check_scheduler", "patch_protocols",
           "patch_scheduler", "start_timesteps"]

ELEMENTWISE_SCHEDULERS = ("DDIMScheduler", "EulerDiscreteScheduler",
                          "FlowMatchEulerDiscreteScheduler", "DPMSolverMultistepScheduler")
"""Scheduler classes whose step acts element-wise on the latents."""


def check_scheduler(scheduler: Any) -> None:
    """Refuse a scheduler whose step does not act element-wise (names why and the fix).

    Raises:
        SpecError: not one of :data:`ELEMENTWISE_SCHEDULERS`, or configured to mix elements
            (dynamic thresholding takes a quantile over the whole sample; DPM-Solver's SDE
            variants and DDIM with ``eta > 0`` draw noise, which a patch cannot reproduce).
    """
    name = type(scheduler).__name__
    if name not in ELEMENTWISE_SCHEDULERS:
        raise SpecError(
            f"scheduler {name} is not known to step element-wise (a patch of the latents is "
            "stepped alone, its neighbours still one step behind); tppc.denoise supports "
            f"{', '.join(ELEMENTWISE_SCHEDULERS)}. fix: use one of those (e.g. "
            f"DDIMScheduler.from_config(scheduler.config))")
    config = getattr(scheduler, "config", {})
    if config.get("thresholding"):
        raise SpecError(f"scheduler {name} has thresholding=True: dynamic thresholding takes a "
                        "quantile over the whole sample. fix: thresholding=False")
    if "sde" in str(config.get("algorithm_type", "")):
        raise SpecError(f"scheduler {name} has algorithm_type={config['algorithm_type']!r}, "
                        "which draws noise per step. fix: algorithm_type='dpmsolver++'")
    if config.get("stochastic_sampling"):
        raise SpecError(f"scheduler {name} has stochastic_sampling=True (draws noise). "
                        "fix: stochastic_sampling=False")


def patch_scheduler(scheduler: Any, shape: torch.Size, axis: int, start: int, rows: int
                    ) -> Any:
    """A copy of ``scheduler`` whose history tensors of the latents' ``shape`` are cut to
    the rows ``[start, start + rows)`` along ``axis`` (see the module docstring)."""
    patch = copy.deepcopy(scheduler)

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.shape == shape:
            return value.narrow(axis, start, rows).clone()
        if isinstance(value, list):
            return [cut(v) for v in value]
        if isinstance(value, tuple):
            return tuple(cut(v) for v in value)
        return value

    for key, value in vars(patch).items():
        setattr(patch, key, cut(value))
    return patch


def start_timesteps(scheduler: Any, num_inference_steps: int) -> list[Any]:
    """``scheduler.set_timesteps(n)`` and the loop's start at the first timestep
    (``set_begin_index(0)`` where the scheduler has it); returns the timesteps."""
    scheduler.set_timesteps(num_inference_steps)
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(0)
    return list(scheduler.timesteps)


class StepProtocol:
    """The step protocol (module docstring) of ``scheduler`` on the rows
    ``[start, start + rows)`` along ``axis`` of ``latents``; the model reads ``model_input``
    (same shape), whose rows :meth:`model_input` writes.

    Example:
        >>> whole = StepProtocol(scheduler, x, x_in)                       # doctest: +SKIP
        >>> whole.model_input(t); out = model(x_in, t); whole.step(out, t)
    """

    def __init__(self, scheduler: Any, latents: torch.Tensor, model_input: torch.Tensor,
                 axis: int = 0, start: int = 0, rows: int | None = None) -> None:
        rows = latents.shape[axis] - start if rows is None else rows
        self.scheduler = scheduler
        self.latents = latents.narrow(axis, start, rows)
        self.inputs = model_input.narrow(axis, start, rows)

    def model_input(self, t: Any) -> None:
        """The model input of step ``t``: ``scale_model_input`` of the rows, written into
        the model input's rows."""
        scale = getattr(self.scheduler, "scale_model_input", None)
        self.inputs.copy_(self.latents if scale is None else scale(self.latents, t))

    def step(self, model_output: torch.Tensor, t: Any) -> None:
        """``scheduler.step`` of the rows with the model's output for them."""
        self.latents.copy_(self.scheduler.step(model_output, t, self.latents).prev_sample)


def patch_protocols(scheduler: Any, latents: torch.Tensor, model_input: torch.Tensor,
                    axis: int, bands: Sequence[tuple[int, int]]) -> list[StepProtocol]:
    """One :class:`StepProtocol` per band ``[a, b)`` of rows, each with its own
    :func:`patch_scheduler` copy (taken now: its step counter continues the caller's)."""
    return [StepProtocol(patch_scheduler(scheduler, latents.shape, axis, a, b - a), latents,
                         model_input, axis, a, b - a) for a, b in bands]
