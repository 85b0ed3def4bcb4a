"""Diffusers schedulers under PipeFusion: which ones act element-wise, and one copy per patch.

Terms:
    element-wise scheduler: its ``step(model_output, t, sample)`` computes every element of
        ``prev_sample`` from the same elements of its inputs (and of its own history), so a
        patch can be stepped alone: DDIM (``eta = 0``), Euler, flow-matching Euler (dynamic
        shifting too), DPM-Solver multistep (its history of model outputs is kept per patch).
        Accepted by what it does, never by class name: :func:`check_elementwise` steps a
        random latent whole and patch by patch and compares.
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
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from tppc.errors import SpecError

__all__ = ["StepProtocol", "check_elementwise", "check_scheduler", "patch_protocols",
           "patch_scheduler", "start_timesteps"]

#: Steps of the element-wise check (enough for a multistep scheduler's higher orders).
CHECK_STEPS = 3


def check_scheduler(scheduler: Any) -> None:
    """Refuse an object without the step protocol (``set_timesteps``, ``timesteps``, ``step``).

    Raises:
        SpecError: a scheduler class (not an instance), or naming the missing method; and
            the fix.
    """
    if isinstance(scheduler, type):
        name = scheduler.__name__
        raise SpecError(f"scheduler={name} is a class, not a scheduler: denoise steps an "
                        f"instance (its timesteps and history are per call). fix: pass an "
                        f"instance: {name}() or {name}.from_config(pipe.scheduler.config)")
    for name in ("set_timesteps", "step"):
        if not callable(getattr(scheduler, name, None)):
            raise SpecError(f"scheduler {type(scheduler).__name__} has no {name}(): denoise "
                            "runs diffusers' step protocol. fix: pass a diffusers scheduler")


def check_elementwise(scheduler: Any, latents: torch.Tensor, axis: int,
                      bands: Sequence[tuple[int, int]]) -> None:
    """Refuse a scheduler whose step is not element-wise per latent position, by property:
    on a random latent and random model outputs, :data:`CHECK_STEPS` steps of the protocol
    on each band of rows (its :func:`patch_scheduler` copy) equal those rows of the whole
    latent's steps. ``scheduler`` has its timesteps set (:func:`start_timesteps`); it is
    not changed, and neither is the global random state.

    Raises:
        SpecError: naming the scheduler, the largest difference and the fix.
    """
    if len(bands) < 2:
        bands = [(0, latents.shape[axis] // 2), (latents.shape[axis] // 2, latents.shape[axis])]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand() -> torch.Tensor:
        return torch.randn(latents.shape, generator=gen).to(latents.device, latents.dtype)

    x = rand()
    outs = [rand() for _ in range(CHECK_STEPS)]
    try:
        worst = _patch_difference(scheduler, x, outs, axis, bands)
    except Exception as exc:  # a step of another signature (CogVideoXDPMScheduler's)
        raise SpecError(
            f"scheduler {type(scheduler).__name__} does not follow diffusers' step protocol "
            f"(scale_model_input(sample, t), step(model_output, t, sample).prev_sample): "
            f"{type(exc).__name__}: {exc}. fix: use a scheduler that does (e.g. "
            "DDIMScheduler.from_config(scheduler.config))") from exc
    if worst > 1e-5:
        raise SpecError(
            f"scheduler {type(scheduler).__name__}: its step is not element-wise per latent "
            f"position (stepping the rows of a patch alone differs from those rows of the "
            f"whole latent's step by up to {worst:.3g} on a random latent), so stale patches "
            "cannot be stepped one by one; schedulers that draw noise per step (DDPM, "
            "ancestral, SDE variants) or take statistics over the whole sample "
            "(thresholding) are not. fix: use an element-wise one (e.g. "
            "DDIMScheduler.from_config(scheduler.config)), or warmup_steps=num_inference_steps")


def _patch_difference(scheduler: Any, x: torch.Tensor, outs: list[torch.Tensor], axis: int,
                      bands: Sequence[tuple[int, int]]) -> float:
    """The largest relative difference of whole and per-band steps (:func:`check_elementwise`)."""
    steps = list(scheduler.timesteps)[:len(outs)]
    with torch.random.fork_rng(devices=[]):
        whole_x, whole_in = x.clone(), x.clone()
        whole = StepProtocol(copy.deepcopy(scheduler), whole_x, whole_in)
        part_x, part_in = x.clone(), x.clone()
        parts = patch_protocols(copy.deepcopy(scheduler), part_x, part_in, axis, bands)
        worst = 0.0
        for out, t in zip(outs, steps):
            whole.model_input(t)
            for part in parts:
                part.model_input(t)
            worst = max(worst, _difference(whole_in, part_in))
            whole.step(out, t)
            for part, (a, b) in zip(parts, bands):
                part.step(out.narrow(axis, a, b - a), t)
            worst = max(worst, _difference(whole_x, part_x))
    return worst


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference of ``a`` and ``b`` relative to their scale (inf where NaN)."""
    diff = (a.double() - b.double()).abs().max().item()
    scale = max(1.0, a.double().abs().max().item())
    return float("inf") if diff != diff else diff / scale


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


def start_timesteps(scheduler: Any, num_inference_steps: int | None, *,
                    timesteps: Sequence[Any] | None = None, sigmas: Sequence[float] | None = None,
                    **kwargs: Any) -> list[Any]:
    """``scheduler.set_timesteps`` as diffusers' ``retrieve_timesteps`` calls it (custom
    ``timesteps`` or ``sigmas``, else ``num_inference_steps``; ``kwargs`` such as ``mu``
    passed on), and the loop's start at the first timestep (``set_begin_index(0)`` where
    the scheduler has it); returns the timesteps.

    Raises:
        SpecError: both ``timesteps`` and ``sigmas``, or one the scheduler does not accept.
    """
    if timesteps is not None and sigmas is not None:
        raise SpecError("denoise got both timesteps= and sigmas=. fix: pass one of them")
    for name, value in (("timesteps", timesteps), ("sigmas", sigmas), *kwargs.items()):
        params = inspect.signature(scheduler.set_timesteps).parameters
        if value is not None and name not in params:
            raise SpecError(f"scheduler {type(scheduler).__name__}.set_timesteps takes no "
                            f"{name}= (it takes {', '.join(params)}). fix: drop {name}= or "
                            "use a scheduler that takes it")
    extra = {k: v for k, v in kwargs.items() if v is not None}
    if timesteps is not None:
        scheduler.set_timesteps(timesteps=list(timesteps), **extra)
    elif sigmas is not None:
        scheduler.set_timesteps(sigmas=list(sigmas), **extra)
    else:
        scheduler.set_timesteps(num_inference_steps, **extra)
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
