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
from tppc.backends.torch_threads import ThreadsExecutor
from tppc.calls.io import OutputAssembler, output_structure
from tppc.cost_models.cluster import cpu_device_count
from tppc.driver.emit import build_program
from tppc.errors import SpecError
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.passes.stages.hoist_consts import hoist_constants
from tppc.pipefusion.check import check_patches
from tppc.pipefusion.jobs import Jobs, run_pipelined, run_serial
from tppc.pipefusion.quality import quality_settings, warn_no_overlap
from tppc.pipefusion.schedulers import (
    StepProtocol,
    check_elementwise,
    check_scheduler,
    patch_protocols,
    start_timesteps,
)
from tppc.program.patches import (
    PatchPrograms,
    TimestepOps,
    cached_patch_programs,
    latent_axis,
    patch_bands,
    patch_bounds,
    rows_per_unit,
)
from tppc.program.patches import model_timestep as timestep_input
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, next_epoch

__all__ = [
    "TORCH_TIMESTEPS",
    "TimestepSchedule",
    "all_threads",
    "bind_steps",
    "check_steps",
    "choose_patches",
    "denoise",
    "intra_op_threads",
    "model_timestep",
    "model_timesteps",
    "patch_programs",
    "schedule_steps",
]

Transform = Callable[[torch.Tensor], torch.Tensor]

TORCH_TIMESTEPS = TimestepOps(
    convert=lambda value: value, is_array=lambda value: isinstance(value, torch.Tensor),
    dtype=lambda value: value.dtype, cast=lambda value, dtype: value.to(dtype),
    equal=torch.equal, first=lambda value: value.flatten()[0].item(),
    target="the pipeline's {arg} input was compiled as {want}",
    fix="compile with a {dtype} example {arg} (e.g. torch.tensor([1.0]))")
"""The timestep input's operations on torch tensors (:func:`model_timestep`)."""


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
    programs = patch_programs(cp, front, plan, length, bounds)
    full, first = programs.full, programs.first
    if warm < len(steps):  # the patches against one chunk, once per shape
        check_patches(cp, front, flats[0], length, bounds, programs)
    axis, scale = b.axis, b.scale
    chunks = tuple(itertools.pairwise(bounds))
    bands = patch_bands(chunks, scale)
    if warm < len(steps):
        check_elementwise(scheduler, x, axis, bands)
    epoch = next_epoch()
    state = cp.states.acquire(front, length)
    state.reset()
    run = DenoiseRun(cp, x, axis, scale, output_transform)
    threaded = (executor or cp.executor) == "threads" and len(first.runners) > 1
    whole = StepProtocol(scheduler, x, x_in)
    with intra_op_threads(all_threads(cp, full) if threaded else None):
        for i in range(warm):  # synchronous: the stages' cores share each op instead
            whole.model_input(steps[i])
            call = Call(tuple(flats[i]), ((0, length),), length, length, epoch)
            if full.workers and (executor or cp.executor) == "threads":  # a thread a worker
                (values,) = ThreadsExecutor(cp.options.threads_per_stage).run(full, call,
                                                                              state)
            else:
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
            lo, hi = bands[m]
            out = run.model_output(first, calls[t], m, values).narrow(axis, lo, hi - lo)
            i = warm + t
            scheds[m].step(out, steps[i])
            if i + 1 < len(steps):  # patch m's input of the next step
                scheds[m].model_input(steps[i + 1])

        def stage_of(m: int, w: int) -> StageProgram:
            return programs.of_patch(m).runners[w]

        jobs = Jobs(first.dry_run(chunks, pipelined, rest=programs.rest), calls, state,
                    stage_of, finish, warm, first.leader)
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


def all_threads(cp: Any, program: Program) -> int | None:
    """The intra-op threads of all of ``program``'s workers together (``threads_per_stage``
    where given, else each worker's device share, ``StageProgram.threads``; ``None``: a
    worker off the CPU, torch's own)."""
    threads = cp.options.threads_per_stage
    n = len(program.runners)
    if threads is not None:
        return threads * n if isinstance(threads, int) else sum(
            threads[w.index] for w in program.runners)
    own = [w.threads for w in program.runners]
    return None if None in own else sum(own)  # type: ignore[arg-type]


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
    calls_in = [((x,), {**kwargs, arg: t}) for t in model_timesteps(cp, arg, steps, len(x),
                                                                     transform)]
    front, bound = cp.bind(*calls_in[0])
    length = bound.length
    plan, bounds = choose_patches(cp, front, length, len(steps), warmup, patches, max_patches)
    axis, scale = _latent_axis(front, bound.flat, x)
    flats = [cp.bind(a, k)[1].flat for a, k in calls_in]
    return _Bound(front, bound, length, plan, bounds, axis, scale, flats)


def model_timesteps(cp: Any, arg: str, steps: list, batch: int, transform: Transform | None
                    ) -> list[torch.Tensor]:
    """Every step's timestep input (:func:`model_timestep`), all in one dtype: the compiled
    one where it holds every step's value, else the scheduler's own (a flow-matching
    scheduler's float timesteps into a model compiled with an integer one: the pipeline
    captures the model again for that dtype, :mod:`tppc.pipeline.captures`)."""
    try:
        return [model_timestep(cp, arg, t, batch, transform) for t in steps]
    except SpecError:
        return [timestep_input(t, batch, transform, None, TORCH_TIMESTEPS, arg) for t in steps]


def model_timestep(cp: Any, arg: str, t: torch.Tensor, batch: int,
                   transform: Transform | None) -> torch.Tensor:
    """The model's timestep input of step ``t`` (:func:`tppc.program.patches.model_timestep`),
    in the dtype ``cp`` compiled its ``arg`` input with.

    Raises:
        SpecError: the cast would change a value, naming both dtypes and the fix.
    """
    want = cp.input_dtypes.get(arg) if hasattr(cp, "input_dtypes") else None
    return timestep_input(t, batch, transform, want, TORCH_TIMESTEPS, arg)


def choose_patches(cp: Any, front: Any, length: int, steps: int, warmup: int, patches: int | None,
                   max_patches: int | None = None) -> tuple[Any, tuple[int, ...]]:
    """The plan (placement) and the patch boundaries: ``patches`` equal bands on the
    compiled plan, or (``None``) the diffusion plan's own split, at most ``max_patches``
    (a given plan's split above it: that many equal bands; every executor calls this)."""
    if patches is not None:
        plan, bounds = cp.program(length, front).plan, patch_bounds(patches, length)
    else:
        plan = cp.denoise_plan(steps, warmup, length, front, max_patches)
        bounds = tuple(plan.boundaries) \
            if plan.workload.kind == "diffusion" and plan.seq_len == length \
            else patch_bounds(len(plan.stages), length)
        if max_patches is not None and len(bounds) - 1 > max_patches:
            bounds = patch_bounds(max_patches, length)
    warn_no_overlap(len(plan.stages), len(bounds) - 1, length, steps - min(warmup, steps))
    return plan, bounds


_STALE_RING = ("PipeFusion patches: the whole-image warm-up step and the patches cut the "
              "tokens into different sub-chunks, so a worker's own K/V block would not hold "
              "the same rows from step to step")
"""Why a ring's attentions take the gather form in the programs of stale patches."""


def patch_programs(cp: Any, front: Any, plan: Any, length: int, bounds: tuple[int, ...]
                   ) -> PatchPrograms:
    """Warm-up program (one chunk), patch program, and the later patches' program (joint
    attention: no text tokens), their constants hoisted, cached on the pipeline
    (:func:`tppc.program.patches.cached_patch_programs`). With more than one patch a ring
    runs its attentions in the gather form (:data:`_STALE_RING`)."""
    devices = cp.options.devices

    gather = _STALE_RING if len(bounds) > 2 else ""

    def build(gm: Any, chunks: tuple[tuple[int, int], ...]) -> Program:
        return _hoist(build_program(gm, front.ctx, plan, chunks, devices, ring_gather=gather,
                                    cpu_devices=cpu_device_count(cp.options.cluster)))

    return cached_patch_programs(cp.__dict__.setdefault("_denoise_programs", {}), plan,
                                 front.batch, length, bounds, build, front.chunk,
                                 front.chunk.meta.get(REST_CHUNK))


def _hoist(program: Program) -> Program:
    """``program`` with every worker's const sub-graphs (text K/V, timestep embedding)
    computed once per set of input values and fed in (:mod:`tppc.passes.stages.hoist_consts`;
    a worker cut into parts: each part's)."""
    def hoisted(worker: StageProgram) -> StageProgram:
        if worker.parts:
            return dataclasses.replace(worker, parts=tuple(hoist_constants(p)
                                                           for p in worker.parts))
        return hoist_constants(worker)

    workers = tuple(hoisted(w) for w in program.workers)
    stages = tuple(next(w for w in workers if w.index == s) for s in range(len(
        program.stages))) if workers else tuple(hoisted(st) for st in program.stages)
    return dataclasses.replace(program, stages=stages, workers=workers)


def _latent_axis(front: Any, flat: list[Any], x: torch.Tensor) -> tuple[int, int]:
    """The latent axis and its positions per unit (:func:`tppc.program.patches.latent_axis`)
    of the input that is ``x``."""
    ph = next((ph for ph, value in zip(front.placeholders, flat) if value is x), None)
    axes = () if ph is None else front.ctx.seq_inputs.get(ph.name, ())
    what = "the latents" if ph is None else f"the compiled model's input {ph.name!r} (latents)"
    return latent_axis(what, axes, [rows_per_unit(ph.meta["val"].shape[a]) for a in axes])
