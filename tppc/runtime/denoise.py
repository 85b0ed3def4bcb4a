"""PipeFusion denoising: the patches of consecutive diffusion steps flow through the stages.

Terms:
    patch: a band of whole patch rows of the latent, ``[a, b)`` in units of the sequence
        symbol (patch rows; a specialised capture cuts the same contiguous token range).
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
        patch, :mod:`tppc.runtime.schedulers`), and stage 0 may start job ``(i + 1, m)``:
        the pipeline fills once per image, not once per step. Every stage sees its jobs in
        the same order as the serial reference (``executor="local"``, which does the
        computes in the dry run's order), so both give the same latents.

Buffers are zeroed at the start of every call; with ``warmup_steps == num_inference_steps``
the result is the serial loop's (see :func:`denoise`). The first call with patches checks
them against one chunk on one step (:mod:`tppc.runtime.denoise_check`; ``verify=False``
skips it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch

from tppc.backends.torch_local import LocalExecutor, run_stage
from tppc.driver.emit import build_program
from tppc.errors import ScheduleError, SpecError
from tppc.passes.chunk_attention import REST_CHUNK
from tppc.passes.hoist_consts import hoist_constants
from tppc.program.program import Program, StageProgram
from tppc.program.schedule import Action, DryRun, check_actions
from tppc.program.state import Call, CallState, next_epoch
from tppc.runtime.denoise_check import check_patches
from tppc.runtime.io import OutputAssembler
from tppc.runtime.schedulers import (
    StepProtocol,
    check_scheduler,
    patch_protocols,
    start_timesteps,
)

__all__ = ["check_steps", "denoise"]

_POLL = 0.05


def denoise(cp: Any, latents: torch.Tensor, scheduler: Any, num_inference_steps: int = 20, *,
            warmup_steps: int = 1, patches: int | None = None,
            model_kwargs: Mapping[str, Any] | None = None, timestep_arg: str = "timestep",
            output_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
            executor: str | None = None) -> torch.Tensor:
    """Denoise ``latents`` with PipeFusion; see ``CompiledPipeline.denoise`` for the contract.

    Equals, when ``warmup_steps == num_inference_steps``::

        scheduler.set_timesteps(num_inference_steps)  # and set_begin_index(0)
        for t in scheduler.timesteps:
            model_in = scheduler.scale_model_input(latents, t)
            out = model(model_in, **{timestep_arg: t.expand(len(latents))}, **model_kwargs)[0]
            out = output_transform(out) if output_transform else out
            latents = scheduler.step(out, t, latents).prev_sample

    (the step protocol of diffusers' pipelines, :mod:`tppc.runtime.schedulers`).
    """
    check_scheduler(scheduler)
    check_steps(num_inference_steps, warmup_steps)
    steps = start_timesteps(scheduler, num_inference_steps)
    x = latents.detach().clone()
    x_in = x.clone()  # the model's input: scale_model_input of the latents
    kwargs = dict(model_kwargs or {})
    b = bind_steps(cp, x_in, kwargs, steps, timestep_arg, warmup_steps, patches)
    front, length, plan, bounds, flats = b.front, b.length, b.plan, b.bounds, b.flats
    full, first, rest = _programs(cp, front, plan, length, bounds)
    if warmup_steps < len(steps):  # the patches against one chunk, once per shape
        check_patches(cp, front, flats[0], length, bounds, (full, first, rest))
    axis, scale = b.axis, b.scale
    epoch = next_epoch()
    state = front.pool.acquire(length)
    state.reset()
    run = DenoiseRun(cp, x, axis, scale, output_transform)
    warm = min(warmup_steps, len(steps))
    threaded = (executor or cp.executor) == "threads" and len(first.stages) > 1
    whole = StepProtocol(scheduler, x, x_in)
    with _intra_op_threads(_all_threads(cp, len(full.stages)) if threaded else None):
        for i in range(warm):  # synchronous: the stages' cores share each op instead
            whole.model_input(steps[i])
            call = Call(tuple(flats[i]), ((0, length),), length, length, epoch)
            (values,) = LocalExecutor().run(full, call, state)
            out = run.model_output(full, call, 0, values)
            whole.step(out, steps[i])
    pipelined = len(steps) - warm
    if pipelined:
        chunks = tuple(itertools.pairwise(bounds))
        calls = [Call(tuple(flats[warm + t]), chunks, length, length, epoch)
                 for t in range(pipelined)]
        scheds = patch_protocols(scheduler, x, x_in, axis,
                                 [(scale * a, scale * b) for a, b in chunks])
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

        jobs = _Jobs(check_actions(first.actions_for(chunks, pipelined)), calls, state,
                     stage_of, finish, warm)
        if threaded:
            _pipelined(cp, jobs)
        else:
            _serial(jobs)
    state.consts.clear()  # the text K/V are this request's
    front.pool.release(state)
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
        out = self.cp.assemble(program, leaves)
        out = out[0] if isinstance(out, tuple | list) else out
        out = getattr(out, "sample", out)
        return self.transform(out) if self.transform is not None else out


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


def _all_threads(cp: Any, n_stages: int) -> int | None:
    """The intra-op threads of all the stage workers together (``None``: torch's own)."""
    threads = cp.options.threads_per_stage
    if threads is None:
        return None
    return threads * n_stages if isinstance(threads, int) else sum(threads[:n_stages])


@contextlib.contextmanager
def _intra_op_threads(threads: int | None) -> Iterator[None]:
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
                warmup: int, patches: int | None) -> _Bound:
    """Bind every step's inputs (``x`` and ``kwargs`` with ``arg = t``) and choose the patches
    (every executor's denoise starts here)."""
    calls_in = [((x,), {**kwargs, arg: t.expand(len(x))}) for t in steps]
    front, bound = cp.bind(*calls_in[0])
    length = bound.length
    plan, bounds = _patches(cp, front, length, len(steps), warmup, patches)
    axis, scale = _latent_axis(front, bound.flat, x)
    flats = [cp.bind(a, k)[1].flat for a, k in calls_in]
    return _Bound(front, bound, length, plan, bounds, axis, scale, flats)


def _patches(cp: Any, front: Any, length: int, steps: int, warmup: int, patches: int | None
             ) -> tuple[Any, tuple[int, ...]]:
    """The plan (placement) and the patch boundaries: ``patches`` equal bands on the
    compiled plan, or (``None``) the diffusion plan's own split. Several patches with stale
    steps are refused for video latents of several frames (every executor calls this)."""
    if patches is not None:
        plan, bounds = cp.program(length, front).plan, _patch_bounds(patches, length)
    else:
        plan = cp.denoise_plan(steps, warmup, length, front)
        bounds = tuple(plan.boundaries) \
            if plan.workload.kind == "diffusion" and plan.seq_len == length \
            else _patch_bounds(len(plan.stages), length)
    if len(bounds) > 2 and warmup < steps:
        _check_bands_are_contiguous(front.ctx.patch_grid)
    return plan, bounds


def _check_bands_are_contiguous(grid: tuple[int, ...]) -> None:
    """Refuse video latents of several frames: their tokens are frame-major, so a band of
    latent rows (in every frame) is not the contiguous token range a patch's K/V rows and
    positions are."""
    if len(grid) == 3 and grid[0] > 1:
        raise SpecError(
            f"video latents of {grid[0]} frames (patch grid {grid}): a band of patch rows "
            "spans every frame, but the tokens are frame-major, so stale patches would write "
            "their K/V at another band's positions. fix: warmup_steps=num_inference_steps, "
            "patches=1, or a latent of one frame")


def _patch_bounds(patches: int, length: int) -> tuple[int, ...]:
    if not isinstance(patches, int) or not 1 <= patches <= length:
        raise SpecError(f"patches={patches!r}; the latent has {length} patch rows. fix: "
                        f"1 <= patches <= {length}")
    return tuple(round(i * length / patches) for i in range(patches + 1))


def _programs(cp: Any, front: Any, plan: Any, length: int, bounds: tuple[int, ...]
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
    computed once per set of input values and fed in (:mod:`tppc.passes.hoist_consts`)."""
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


class _Jobs(NamedTuple):
    """The pipelined steps of one call: the dry run of their lists (step ``t`` of the lists
    is step ``warm + t`` of the call), each step's call, the state, the stage of a patch
    (``stage_of(m, s)``) and what happens when a patch leaves the last stage (``finish``)."""

    dry: DryRun
    calls: list[Call]
    state: CallState
    stage_of: Callable[[int, int], StageProgram]
    finish: Callable[[int, int, tuple[Any, ...]], None]
    warm: int

    def compute(self, s: int, act: Action, received: tuple[Any, ...]) -> tuple[Any, ...]:
        """Compute action ``act`` of stage ``s``."""
        return run_stage(self.stage_of(act.chunk, s), self.calls[act.step], self.state,
                         act.start, act.end, received)

    def note(self, s: int, k: int) -> str:
        return (f"[tppc] denoise (pipelined step t is step {self.warm} + t): stage {s}, "
                f"{self.dry.describe(s, k)}")


def _serial(jobs: _Jobs) -> None:
    """The computes of the lists in the dry run's order, in the calling thread."""
    last = len(jobs.dry.actions) - 1
    sent: dict[tuple[int, tuple[int, int]], tuple[Any, ...]] = {}
    for s, act in jobs.dry.computes():
        values = jobs.compute(s, act, sent.pop((s - 1, act.job), ()))
        if s < last:
            sent[(s, act.job)] = values
        else:
            jobs.finish(act.step, act.chunk, values)


def _pipelined(cp: Any, jobs: _Jobs) -> None:
    """One worker per stage follows its lowered list; the calling thread steps each patch as
    it leaves the last stage, and that is the send back: a feedback stage's receive of
    patch ``m`` of step ``t`` waits until the calling thread has stepped it."""
    dry = jobs.dry
    last = len(dry.actions) - 1
    queues = [queue.Queue(cp.options.queue_depth) for _ in range(last + 2)]
    stop, errors = threading.Event(), []
    done: dict[int, int] = {}  # patch -> the last step the calling thread stepped it for
    cond = threading.Condition()
    threads = cp.options.threads_per_stage

    def back(t: int, m: int) -> None:
        with cond:
            while done.get(m, -1) < t:
                if stop.is_set():
                    raise _Stopped
                cond.wait(_POLL)

    def work(s: int) -> None:
        k = 0
        got: dict[tuple[int, int], tuple[Any, ...]] = {}  # received, not yet computed
        made: dict[tuple[int, int], tuple[Any, ...]] = {}  # computed, not yet sent
        try:
            t = threads if threads is None or isinstance(threads, int) else threads[s]
            if t is not None:
                torch.set_num_threads(t)
            for k, act in enumerate(dry.actions[s]):  # noqa: B007 (k names a failing action)
                if act.kind == "recv" and act.peer == last:  # back from the last stage
                    back(*act.job)
                elif act.kind == "recv":
                    job, values = _get(queues[s], stop)
                    if job != act.job:
                        raise ScheduleError(f"stage {s} expected {act}, got job {job}")
                    got[job] = values
                elif act.kind == "compute":
                    values = jobs.compute(s, act, got.pop(act.job, ()))
                    if s == last:  # to the calling thread
                        _put(queues[-1], (act.job, values), stop)
                    else:
                        made[act.job] = values
                elif act.peer == s + 1:  # (a send back is the calling thread's step)
                    _put(queues[s + 1], (act.job, made.pop(act.job)), stop)
        except _Stopped:
            return
        except BaseException as exc:  # re-raised in the calling thread
            exc.add_note(jobs.note(s, k))
            errors.append(exc)
            stop.set()

    workers = [threading.Thread(target=work, args=(s,), daemon=True, name=f"tppc-denoise-{s}")
               for s in range(last + 1)]
    for w in workers:
        w.start()
    try:
        for _ in range(sum(a.kind == "compute" for a in dry.actions[last])):
            (t, m), values = _get(queues[-1], stop)
            jobs.finish(t, m, values)
            with cond:
                done[m] = t
                cond.notify_all()
    except _Stopped:
        pass
    finally:
        stop.set()
        for w in workers:
            w.join()
    if errors:
        raise errors[0]


class _Stopped(Exception):
    """Another worker failed."""


def _get(q: queue.Queue, stop: threading.Event) -> Any:
    while True:
        try:
            return q.get(timeout=_POLL)
        except queue.Empty:
            if stop.is_set():
                raise _Stopped from None


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL)
            return
        except queue.Full:
            continue
    raise _Stopped
