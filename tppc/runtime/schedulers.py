"""Diffusers schedulers under PipeFusion: which ones act element-wise, and one copy per patch.

Terms:
    element-wise scheduler: its ``step(model_output, t, sample)`` computes every element of
        ``prev_sample`` from the same elements of its inputs (and of its own history), so a
        patch can be stepped alone: DDIM (``eta = 0``), Euler, flow-matching Euler, DPM-Solver
        multistep (its history of model outputs is kept per patch).
    patch scheduler: a copy of the scheduler for one patch, its per-sample history (tensors
        shaped like the latents) cut to the patch's rows; it is stepped once per step, so
        its step counter advances as the whole image's would.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tppc.errors import SpecError

__all__ = ["ELEMENTWISE_SCHEDULERS", "check_scheduler", "patch_scheduler"]

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
