"""PipeFusion denoising on a loaded artifact: ``runner.denoise`` mirrors ``cp.denoise``.

Terms:
    warm-up step: the whole latent as one chunk through every ORT stage; it writes every
        row of every K/V buffer.
    pipelined step: the patches (bands of patch rows) one after the other through the
        stages. A stage's K/V buffers keep their rows across the steps of a call, so patch
        ``m`` attends to this step's rows of patches ``≤ m`` and the previous step's rows of
        the others (PipeFusion's stale K/V), as the torch program does.
    model output of a patch: the last stage's rows of the patch written into full-length
        outputs kept across steps (``Assembler`` with chunks), the epilogue applied
        (``tail.onnx``: an unpatchify over the whole latent), the patch's band of latent rows.

Each stage sees the jobs in the order of the torch program's serial reference (step by step,
patch by patch), so with ``warmup_steps == num_inference_steps`` the result is the serial
loop's and with stale patches the torch program's ``cp.denoise``. The scheduler is diffusers'
(torch), driven by the protocol of :mod:`tppc.pipefusion.schedulers`; so this module imports
torch, and :meth:`tppc.artifact.core.loaded.LoadedPipeline.denoise` imports it only when called
(loading and plain calls stay torch-free).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tppc.artifact.core.assemble import Assembler, unflatten
from tppc.backends.onnxruntime import OrtCall
from tppc.errors import SpecError
from tppc.pipefusion.denoise import TimestepSchedule, schedule_steps
from tppc.pipefusion.schedulers import (
    StepProtocol,
    check_elementwise,
    patch_protocols,
)
from tppc.program.patches import (
    PatchPrograms,
    TimestepOps,
    latent_axis,
    model_timestep,
    patch_bands,
    patch_bounds,
)

__all__ = ["denoise_loaded"]

Transform = Callable[[torch.Tensor], torch.Tensor]

NUMPY_TIMESTEPS = TimestepOps(
    convert=lambda value: np.array(value.detach().cpu().numpy())
    if isinstance(value, torch.Tensor) else value,
    is_array=lambda value: isinstance(value, np.ndarray), dtype=lambda array: array.dtype,
    cast=lambda array, dtype: array.astype(dtype), equal=np.array_equal,
    first=lambda array: array.flat[0].item(),
    target="the artifact's {arg} input is {want}",
    fix="export with a {dtype} example {arg}")
"""The timestep input's operations on numpy arrays (a copy of the scheduler's tensor)."""


def denoise_loaded(runner: Any, latents: torch.Tensor, scheduler: Any,
                   num_inference_steps: int | None = 20, *, warmup_steps: int | None = 1,
                   patches: int | None = None, model_kwargs: Mapping[str, Any] | None = None,
                   timestep_arg: str = "timestep", output_transform: Transform | None = None,
                   schedule: TimestepSchedule | None = None) -> torch.Tensor:
    """Denoise ``latents`` through ``runner``'s ORT stages (see the module docstring and
    ``CompiledPipeline.denoise`` for the contract; ``patches=None``: the chunks the plan
    recorded for the latent's length)."""
    schedule = schedule or TimestepSchedule()
    steps, warm = schedule_steps(scheduler, num_inference_steps, warmup_steps, schedule)
    x = latents.detach().clone()
    x_in = x.clone()  # the model's input: scale_model_input of the latents
    kwargs = {k: _array(v) for k, v in (model_kwargs or {}).items()}
    flats, length = [], 0
    spec = next((e for e in runner.signature["inputs"] if e["name"] == timestep_arg), {})
    want = np.dtype(spec["dtype"]) if "dtype" in spec else None
    for t in steps:  # x_in's array shares its memory: each chunk reads its rows when it runs
        flat, length = runner.bind((x_in.numpy(),), {
            **kwargs, timestep_arg: model_timestep(t, len(x), schedule.timestep_transform,
                                                   want, NUMPY_TIMESTEPS, timestep_arg)})
        flats.append(flat)
    first = runner.signature["inputs"][0]
    axis, per_unit = latent_axis(f"the artifact's first input {first['name']!r}",
                                 first.get("seq_axes") or (), first.get("seq_rows"))
    chunks = _patches(runner, length, patches)
    bands = patch_bands(chunks, per_unit)
    if warm < len(steps) and len(chunks) > 1:
        _check_patches(runner, x, chunks)
        check_elementwise(scheduler, x, axis, bands)
    call = OrtCall(flat=flats[0], chunks=((0, length),), seq_len=length, pos_len=length)
    for stage in runner.stages:  # K/V buffers zeroed per call, kept across its steps
        stage.allocate(call, length)
    outputs = _ModelOutput(runner, length, output_transform,
                           PatchPrograms(runner.stages, runner.stages, runner.rest_stages))
    whole = StepProtocol(scheduler, x, x_in)
    for i in range(warm):
        whole.model_input(steps[i])
        whole.step(outputs.of(call, flats[i], ((0, length),), 0), steps[i])
    if warm < len(steps):
        scheds = patch_protocols(scheduler, x, x_in, axis, bands)
        for patch in scheds:
            patch.model_input(steps[warm])
        for i in range(warm, len(steps)):
            for m, (lo, hi) in enumerate(bands):
                out = outputs.of(call, flats[i], chunks, m)
                scheds[m].step(out.narrow(axis, lo, hi - lo), steps[i])
                if i + 1 < len(steps):  # patch m's input of the next step
                    scheds[m].model_input(steps[i + 1])
    return x


class _ModelOutput:
    """The model output of one chunk of a step: every stage in order, the chunk's rows kept
    in full-length outputs across steps, the epilogue, the output transform."""

    def __init__(self, runner: Any, length: int, transform: Transform | None,
                 stages: PatchPrograms) -> None:
        self.runner, self.transform, self.stages = runner, transform, stages
        self.sink = Assembler(runner.signature["outputs"], length, ())

    def of(self, call: OrtCall, flat: list[Any], chunks: Sequence[tuple[int, int]],
           m: int) -> torch.Tensor:
        call.flat = flat
        a, b = chunks[m]
        values: list[np.ndarray] = []
        for stage in self.stages.of_patch(m):
            values = stage.step(call, a, b, values)
        self.sink.chunks = chunks
        self.sink(m, values)
        leaves = self.sink.leaves
        if self.runner.tail is not None:
            leaves = self.runner.tail(flat, leaves)
        out = unflatten(self.runner.signature["out_spec"], iter(leaves))
        if isinstance(out, dict):
            out = out.get("sample", next(iter(out.values())))
        out = out[0] if isinstance(out, tuple | list) else out
        out = torch.from_numpy(np.array(out))
        return self.transform(out) if self.transform is not None else out


def _array(value: Any) -> Any:
    """A tensor as numpy, in a dict, tuple or list too (``added_cond_kwargs``)."""
    if isinstance(value, dict):
        return {k: _array(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_array(v) for v in value)
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value


def _patches(runner: Any, length: int, patches: int | None) -> tuple[tuple[int, int], ...]:
    if patches is None:
        return runner.chunks(length)
    return tuple(itertools.pairwise(patch_bounds(patches, length)))


def _check_patches(runner: Any, x: torch.Tensor, chunks: Sequence[tuple[int, int]]) -> None:
    """Refuse stale patches the exported stages cannot run: joint attention's text prefix
    without the stages of the later patches (``stage_<s>.rest.onnx``: an artifact of an
    older tppc) and video latents of several frames."""
    if runner.rest_stages is None and any(int(b.get("prefix", 0)) for st in runner.stages
                                          for b in st.buffers):
        raise SpecError("the artifact's attention has an unsplit text prefix (joint "
                        "attention): its stale patches need the stages of the later "
                        "patches, which this artifact does not hold. fix: export it again "
                        "with this tppc, or warmup_steps=num_inference_steps, or patches=1")
    if x.dim() == 5 and min(x.shape[1], x.shape[2]) > 1:
        raise SpecError(f"video latents of shape {tuple(x.shape)}: a band of patch rows spans "
                        "every frame, but the tokens are frame-major. fix: warmup_steps="
                        "num_inference_steps, or patches=1")
