"""PipeFusion denoising: the patches of consecutive diffusion steps flow through the stages.

Terms:
    patch: a band of whole patch rows of the latent, ``[a, b)`` in units of the sequence
        symbol (patch rows; a specialised capture cuts the same contiguous token range). In
        a video latent of several frames it is the band in every frame (one block of the
        frame-major tokens per frame, :mod:`tppc.passes.chunking.frame_rows`); captured along the
        frame axis, a band of whole frames.
    warm-up step: the whole image as one chunk through every stage, synchronously; it
        writes every row of every K/V buffer (the first step of a call always is one).
        With the ``threads`` executor the calling thread runs it with the intra-op threads
        of all the stage workers together, since they would otherwise wait.
    pipelined step: the patches one after the other. Patch ``m`` writes its K/V rows and
        attends to the whole buffer: rows of patches ``≤ m`` are this step's, the others
        the previous step's (PipeFusion's stale K/V). With joint attention (Flux) the first
        patch carries the text tokens, so only image K/V are stale.
    job ``(i, m)``: patch ``m`` of step ``i``. Each stage runs the jobs in the order of
        the patch program's action lists for the pipelined steps
        (``Program.actions_for(patches, steps)``, by default ``(i, 0), (i, 1), …,
        (i + 1, 0), …``, lowered with the feedback edge to stage 0 and dry-run,
        :mod:`tppc.program.schedule`); when job ``(i, m)`` leaves the last stage the
        calling thread applies the scheduler step to patch ``m`` (one scheduler copy per
        patch, :mod:`tppc.pipefusion.schedulers`), and stage 0 may start job ``(i + 1, m)``:
        the pipeline fills once per image, not once per step. Every stage sees its jobs in
        the same order as the serial reference (``executor="local"``, which does the
        computes in the dry run's order), so both give the same latents.

Buffers are zeroed at the start of every call; with ``warmup_steps == num_inference_steps``
the result is the serial loop's (see :func:`denoise`). The first call with patches checks
them against one chunk on one step (:mod:`tppc.pipefusion.check`; ``verify=False``
skips it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from tppc.backends.torch_local import LocalExecutor
from tppc.calls.io import OutputAssembler, output_structure
from tppc.driver.emit import build_program
from tppc.errors import SpecError
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.passes.stages.hoist_consts import hoist_constants
from tppc.pipefusion.check import check_patches
from tppc.pipefusion.jobs import Jobs, run_pipelined, run_serial
from tppc.pipefusion.quality import quality_settings
from tppc.pipefusion.schedulers import (
    StepProtocol,
    check_elementwise,
    check_scheduler,
    patch_protocols,
    start_timesteps,
)
from tppc.program.program import Program, StageProgram
from tppc.program.schedule import check_actions
from tppc.program.state import Call, next_epoch

__all__ = [
    "TimestepSchedule",
    "all_threads",
    "bind_steps",
    "check_steps",
    "choose_patches",
    "denoise",
    "intra_op_threads",
    "patch_programs",
    "schedule_steps",
]

Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclasses.dataclass(kw_only=True, frozen=True)
class TimestepSchedule:
    """What ``scheduler.set_timesteps`` gets and how a timestep reaches the model."""

    timesteps: Sequence[Any] | None = None
    """Custom timesteps (diffusers' ``retrieve_timesteps(timesteps=...)``)."""
    sigmas: Sequence[float] | None = None
    """Custom sigmas (Flux: ``np.linspace(1, 1 / n, n)``)."""
    mu: float | None = None
    """The shift of a scheduler with ``use_dynamic_shifting=True`` (Flux's ``calculate_shift``)."""
    timestep_transform: Transform | None = None
    """Applied to ``t.expand(batch)`` before the model (Flux, AuraFlow: ``t / 1000``)."""


def denoise(cp: Any, latents: torch.Tensor, scheduler: Any,
            num_inference_steps: int | None = 20, *, warmup_steps: int | None = 1,
            patches: int | None = None, model_kwargs: Mapping[str, Any] | None = None,
            timestep_arg: str = "timestep", output_transform: Transform | None = None,
            executor: str | None = None, schedule: TimestepSchedule | None = None,
            quality: Any = None) -> torch.Tensor:
    """Denoise ``latents`` with PipeFusion; see ``CompiledPipeline.denoise`` for the contract.

    Equals, when ``warmup_steps == num_inference_steps`` (``None``: every step)::

        scheduler.set_timesteps(num_inference_steps, mu=mu)  # or timesteps= / sigmas=
        scheduler.set_begin_index(0)
        for t in scheduler.timesteps:
            model_in = scheduler.scale_model_input(latents, t)
            timestep = timestep_transform(t.expand(len(latents)))  # the scheduler's dtype
            out = model(model_in, **{timestep_arg: timestep}, **model_kwargs)[0]
            out = output_transform(out) if output_transform else out
            latents = scheduler.step(out, t, latents).prev_sample

    (the step protocol of diffusers' pipelines, :mod:`tppc.pipefusion.schedulers`; a scheduler
    whose step is not element-wise is refused when stale patches would need it).
    ``quality`` raises the warm-up and caps the patches (:func:`quality_settings`).
    """
    schedule = schedule or TimestepSchedule()
    steps, warm = schedule_steps(scheduler, num_inference_steps, warmup_steps, schedule)
    warm, cap = quality_settings(quality, len(steps), warm, patches)
    x = latents.detach().clone()
    x_in = x.clone()  # the model's input: scale_model_input of the latents
    kwargs = dict(model_kwargs or {})
    b = bind_steps(cp, x_in, kwargs, steps, timestep_arg, warm, patches,
                   schedule.timestep_transform, max_patches=cap)
    front, length, plan, bounds, flats = b.front, b.length, b.plan, b.bounds, b.flats
    full, first, rest = patch_programs(cp, front, plan, length, bounds)
    if warm < len(steps):  # the patches against one chunk, once per shape
        check_patches(cp, front, flats[0], length, bounds, (full, first, rest))
    axis, scale = b.axis, b.scale
    chunks = tuple(itertools.pairwise(bounds))
    bands = [(scale * a, scale * b) for a, b in chunks]
    if warm < len(steps):
        check_elementwise(scheduler, x, axis, bands)
    epoch = next_epoch()
    state = cp.states.acquire(front, length)
    state.reset()
    run = DenoiseRun(cp, x, axis, scale, output_transform)
    threaded = (executor or cp.executor) == "threads" and len(first.stages) > 1
    whole = StepProtocol(scheduler, x, x_in)
    with intra_op_threads(all_threads(cp, len(full.stages)) if threaded else None):
        for i in range(warm):  # synchronous: the stages' cores share each op instead
            whole.model_input(steps[i])
            call = Call(tuple(flats[i]), ((0, length),), length, length, epoch)
            (values,) = LocalExecutor().run(full, call, state)
            out = run.model_output(full, call, 0, values)
            whole.step(out, steps[i])
    pipelined = len(steps) - warm
    if pipelined:
        calls = [Call(tuple(flats[warm + t]), chunks, length, length, epoch)
                 for t in range(pipelined)]
        scheds = patch_protocols(scheduler, x, x_in, axis, bands)
        for patch in scheds:
            patch.model_input(steps[warm])

        def finish(t: int, m: int, values: tuple[Any, ...]) -> None:
            a, b = chunks[m]
            out = run.model_output(first, calls[t], m, values).narrow(axis, scale * a,
                                                                      scale * (b - a))
            i = warm + t
            scheds[m].step(out, steps[i])
            if i + 1 < len(steps):  # patch m's input of the next step
                scheds[m].model_input(steps[i + 1])

        def stage_of(m: int, s: int) -> StageProgram:
            return (first if m == 0 or rest is None else rest).stages[s]

        jobs = Jobs(check_actions(first.actions_for(chunks, pipelined)), calls, state,
                    stage_of, finish, warm)
        if threaded:
            run_pipelined(cp, jobs)
        else:
            run_serial(jobs)
    state.consts.clear()  # the text K/V are this request's
    cp.states.release(front, state)
    return x


class DenoiseRun:
    """The model's output of a chunk: its rows written into full-length outputs (kept across
    steps), the ``global`` tail applied, the output transform applied."""

    def __init__(self, cp: Any, x: torch.Tensor, axis: int, scale: int,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.cp, self.x, self.axis, self.scale, self.transform = cp, x, axis, scale, transform
        self.leaves: list[Any] | None = None

    def model_output(self, program: Program, call: Call, index: int,
                     values: tuple[Any, ...]) -> torch.Tensor:
        sink = OutputAssembler(program.signature.output_axes, call,
                               program.signature.output_rows)
        if self.leaves is not None:
            sink.leaves = self.leaves
        sink(index, values)
        self.leaves = sink.leaves
        leaves = sink.leaves
        if program.tail is not None:
            with torch.no_grad():
                leaves = list(program.tail(*call.flat_inputs, *leaves))
        out = output_structure(program, leaves)
        out = out[0] if isinstance(out, tuple | list) else out
        out = getattr(out, "sample", out)
        return self.transform(out) if self.transform is not None else out


def schedule_steps(scheduler: Any, num_inference_steps: int | None, warmup_steps: int | None,
                   schedule: TimestepSchedule) -> tuple[list[Any], int]:
    """Check the scheduler and the step counts, set the scheduler's timesteps; returns them
    and the warm-up steps (``None``: every step). Every denoise entry point starts here.

    Raises:
        SpecError: a scheduler, step count or schedule that cannot run, naming the fix.
    """
    check_scheduler(scheduler)
    if num_inference_steps is None and schedule.timesteps is None and schedule.sigmas is None:
        raise SpecError("num_inference_steps=None without timesteps= or sigmas=. fix: pass "
                        "the number of steps")
    check_steps(1 if num_inference_steps is None else num_inference_steps,
                1 if warmup_steps is None else warmup_steps)
    steps = start_timesteps(scheduler, num_inference_steps, timesteps=schedule.timesteps,
                            sigmas=schedule.sigmas, mu=schedule.mu)
    return steps, len(steps) if warmup_steps is None else min(warmup_steps, len(steps))


def check_steps(num_inference_steps: Any, warmup_steps: Any) -> None:
    """Refuse step counts that are not ints ≥ 1 (before the scheduler sees them).

    Raises:
        SpecError: naming the argument, its value and the fix.
    """
    for name, value in (("num_inference_steps", num_inference_steps),
                        ("warmup_steps", warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            why = "the first step must fill the K/V buffers" if name == "warmup_steps" \
                else "a denoising call runs at least one step"
            raise SpecError(f"{name}={value!r}; {why}. fix: pass an integer {name} >= 1")


def all_threads(cp: Any, n_stages: int) -> int | None:
    """The intra-op threads of all the stage workers together (``None``: torch's own)."""
    threads = cp.options.threads_per_stage
    if threads is None:
        return None
    return threads * n_stages if isinstance(threads, int) else sum(threads[:n_stages])


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """The calling thread's intra-op threads set to ``threads`` for the block, then restored."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Bound(NamedTuple):
    """One denoising call bound to the pipeline: its front end, length, plan and patch
    boundaries, the latents' token axis and scale, and every step's flat inputs."""

    front: Any
    bound: Any
    length: int
    plan: Any
    bounds: tuple[int, ...]
    axis: int
    scale: int
    flats: list


def bind_steps(cp: Any, x: torch.Tensor, kwargs: Mapping[str, Any], steps: list, arg: str,
               warmup: int, patches: int | None, transform: Transform | None = None, *,
               max_patches: int | None = None) -> _Bound:
    """Bind every step's inputs (``x`` and ``kwargs`` with ``arg`` = the step's timestep,
    :func:`model_timestep`) and choose the patches (every executor's denoise starts here)."""
    calls_in = [((x,), {**kwargs, arg: model_timestep(cp, arg, t, len(x), transform)})
                for t in steps]
    front, bound = cp.bind(*calls_in[0])
    length = bound.length
    plan, bounds = choose_patches(cp, front, length, len(steps), warmup, patches, max_patches)
    axis, scale = _latent_axis(front, bound.flat, x)
    flats = [cp.bind(a, k)[1].flat for a, k in calls_in]
    return _Bound(front, bound, length, plan, bounds, axis, scale, flats)


def model_timestep(cp: Any, arg: str, t: torch.Tensor, batch: int,
                   transform: Transform | None) -> torch.Tensor:
    """The model's timestep input of step ``t``: ``transform(t.expand(batch))`` in the
    scheduler's dtype, cast to the compiled input's dtype where that keeps every value (an
    int64 ``999`` is a float ``999.0``: the model computes the same).

    Raises:
        SpecError: the cast would change a value (a fractional timestep into an integer
            input), naming both dtypes and the fix.
    """
    value = t.expand(batch) if t.dim() == 0 else t
    value = transform(value) if transform is not None else value
    want = cp.input_dtypes.get(arg) if hasattr(cp, "input_dtypes") else None
    if want is None or not isinstance(value, torch.Tensor) or value.dtype == want:
        return value
    cast = value.to(want)
    if not torch.equal(cast.to(value.dtype), value):
        raise SpecError(
            f"the scheduler's timesteps are {value.dtype} ({value.flatten()[0].item()!r}), the "
            f"pipeline's {arg!r} input was compiled as {want}, which cannot hold them. fix: "
            f"compile with a {value.dtype} example {arg} (e.g. torch.tensor([1.0]))")
    return cast


def choose_patches(cp: Any, front: Any, length: int, steps: int, warmup: int, patches: int | None,
                   max_patches: int | None = None) -> tuple[Any, tuple[int, ...]]:
    """The plan (placement) and the patch boundaries: ``patches`` equal bands on the
    compiled plan, or (``None``) the diffusion plan's own split, at most ``max_patches``
    (a given plan's split above it: that many equal bands; every executor calls this)."""
    if patches is not None:
        plan, bounds = cp.program(length, front).plan, _patch_bounds(patches, length)
    else:
        plan = cp.denoise_plan(steps, warmup, length, front, max_patches)
        bounds = tuple(plan.boundaries) \
            if plan.workload.kind == "diffusion" and plan.seq_len == length \
            else _patch_bounds(len(plan.stages), length)
        if max_patches is not None and len(bounds) - 1 > max_patches:
            bounds = _patch_bounds(max_patches, length)
    return plan, bounds


def _patch_bounds(patches: int, length: int) -> tuple[int, ...]:
    if not isinstance(patches, int) or not 1 <= patches <= length:
        raise SpecError(f"patches={patches!r}; the latent has {length} patch rows. fix: "
                        f"1 <= patches <= {length}")
    return tuple(round(i * length / patches) for i in range(patches + 1))


def patch_programs(cp: Any, front: Any, plan: Any, length: int, bounds: tuple[int, ...]
              ) -> tuple[Program, Program, Program | None]:
    """Warm-up program (one chunk), patch program, and the later patches' program (joint
    attention: no text tokens), cached on the pipeline per (batch, length, patches)."""
    cache = cp.__dict__.setdefault("_denoise_programs", {})
    placement = tuple((st.layer_start, st.layer_end, st.device_index) for st in plan.stages)
    key = (front.batch, length, bounds, placement)
    if key not in cache:
        devices = cp.options.devices
        chunks = tuple(itertools.pairwise(bounds))
        full = _hoist(build_program(front.chunk, front.ctx, plan, ((0, length),), devices))
        first = _hoist(build_program(front.chunk, front.ctx, plan, chunks, devices))
        rest_gm = front.chunk.meta.get(REST_CHUNK)
        rest = (_hoist(build_program(rest_gm, front.ctx, plan, chunks, devices)) if rest_gm
                else None)
        cache[key] = (full, first, rest)
    return cache[key]


def _hoist(program: Program) -> Program:
    """``program`` with every stage's const sub-graphs (text K/V, timestep embedding)
    computed once per set of input values and fed in (:mod:`tppc.passes.stages.hoist_consts`)."""
    return dataclasses.replace(program, stages=tuple(hoist_constants(st)
                                                     for st in program.stages))


def _latent_axis(front: Any, flat: list[Any], x: torch.Tensor) -> tuple[int, int]:
    """The latent's sequence axis and its positions per unit (the patch size)."""
    for ph, value in zip(front.placeholders, flat):
        if value is x and ph.name in front.ctx.seq_inputs:
            axis = front.ctx.seq_inputs[ph.name][0]
            size = ph.meta["val"].shape[axis]
            expr = size.node.expr if isinstance(size, torch.SymInt) else None
            coeff = expr.as_coeff_Mul()[0] if expr is not None else 1
            return axis, int(coeff) if expr is not None and expr.is_Mul else 1
    raise SpecError("the latents are not a sequence input of the compiled model. fix: pass "
                    "the latents as the model's first argument, as in the compile example")
