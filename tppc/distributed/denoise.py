"""PipeFusion denoising over a multi-process pipeline (every rank steps the same loop).

Terms:
    shared call: rank 0's latents, model inputs and step counts are validated on rank 0 and
        broadcast (or its error, raised by every rank); every rank passes its own scheduler
        (only the last rank steps it; the others read its timesteps).
    warm-up step: the last rank computes the model input (``scale_model_input``, the step
        protocol of :mod:`tppc.pipefusion.schedulers`) and broadcasts it, the whole image runs
        as one chunk through the ranks, the last rank applies the scheduler step.
    pipelined step: job ``(i, m)`` (patch ``m`` of step ``i``) runs on every rank in the
        order of the patch program's action lists (as :mod:`tppc.pipefusion.denoise`), lowered
        with the feedback edge to the ranks that read the latents and dry-run; each rank
        follows its lowered list. The boundary values go rank to rank as in ``__call__``.
        When job ``(i, m)`` leaves the last rank it steps patch ``m`` and sends its next
        model input's rows to every earlier rank that reads the latents (stage 0), which
        receives them before job ``(i + 1, m)``: the same jobs in the same order per stage
        as the ``threads`` and ``local`` executors, so the latents are theirs.
    stages of several workers (tensor parallelism, a mesh: cfg, ring, ulysses): one rank per
        worker, each running its worker's lowered list (parts, collectives of its groups,
        sends to the workers the list names); the leader (the first worker of the last
        stage, whose outputs are the model's) steps the scheduler and sends each stepped
        patch back to every worker of stage 0. On one stage of several workers no list goes
        back (stage 0 is the last stage): the leader sends each stepped patch to the other
        workers aside, and each receives it before its patch of the next step.

The final latents are broadcast from the last rank; rank 0 returns them (every rank with
``results="all"``), the others None.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from tppc.backends.rank_transport import RankEnd, rank_deadline
from tppc.backends.torch_local import run_stage
from tppc.driver.emit import build_program
from tppc.errors import RuntimeInputError, SpecError
from tppc.passes.chunking.chunk_attention import REST_CHUNK
from tppc.passes.stages.hoist_consts import hoist_constants
from tppc.pipefusion.denoise import (
    DenoiseRun,
    TimestepSchedule,
    bind_steps,
    model_timesteps,
    schedule_steps,
)
from tppc.pipefusion.jobs import one_stage
from tppc.pipefusion.schedulers import (
    StepProtocol,
    check_elementwise,
    patch_protocols,
)
from tppc.program.actions import Action
from tppc.program.interpreter import Interpreter
from tppc.program.patches import PatchPrograms, cached_patch_programs, patch_bands
from tppc.program.program import Program, StageProgram
from tppc.program.schedule import DryRun, check_actions
from tppc.program.state import Call, next_epoch

if TYPE_CHECKING:
    from tppc.backends.torch_distributed import DistributedExecutor
    from tppc.calls.states import CallStates
    from tppc.driver.options import CompileOptions
    from tppc.frontend.front_end import BoundCall, FrontEnd

__all__ = ["DenoisingRank", "distributed_denoise", "patch_jobs", "rank_programs"]


class DenoisingRank(Protocol):
    """What :func:`distributed_denoise` needs of a rank (a ``DistributedPipeline``; the
    helpers of :mod:`tppc.pipefusion.denoise` it calls read ``program``,
    ``denoise_plan`` and ``executor`` too)."""

    rank: int
    world: int
    results: str
    device: torch.device
    comm: DistributedExecutor
    options: CompileOptions
    states: CallStates

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]: ...

    def execute(self, program: Program, call: Call, state: Any, sink: Any = None,
                executor: Any = None, timeout: float | None = None,
                trace: list | None = None) -> list[tuple[Any, ...]]: ...

    def share_inputs(self, what: str, value: Any, check: Any = None) -> Any: ...

    def collective(self, op: Callable[[], Any], what: str) -> Any: ...

    def materialise(self, program: Program) -> Program: ...


def distributed_denoise(cp: DenoisingRank, latents: torch.Tensor | None, scheduler: Any,
                        num_inference_steps: int | None = 20, *,
                        warmup_steps: int | None = 1, patches: int | None = None,
                        model_kwargs: Mapping[str, Any] | None = None,
                        timestep_arg: str = "timestep",
                        output_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                        timesteps: Any = None, sigmas: Any = None, mu: float | None = None,
                        timestep_transform: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> torch.Tensor | None:
    """``cp.denoise(...)`` through the job (collective; rank 0's latents and inputs).

    Same contract as :func:`tppc.pipefusion.denoise.denoise`; see the module docstring. Rank
    0's ``timesteps``, ``sigmas`` and ``mu`` are every rank's (the scheduler steps alike
    everywhere); ``timestep_transform`` and ``output_transform`` are each rank's own (give
    the same function on every rank, as the same script does).
    """
    def timing(shared: tuple[Any, ...]) -> TimestepSchedule:
        return TimestepSchedule(timesteps=shared[0], sigmas=shared[1], mu=shared[2])

    def check(value: tuple[Any, ...]) -> None:
        x, kwargs, steps, warm, _, arg, shared = value
        first = schedule_steps(scheduler, steps, warm, timing(shared))[0][0]
        if not isinstance(x, torch.Tensor):
            raise RuntimeInputError(f"latents of type {type(x).__name__}; pass a tensor")
        cp.bind((x,), {**kwargs, arg: model_timesteps(cp, arg, [first], len(x),
                                                       timestep_transform)[0]})

    plain = [None if v is None else [float(t) for t in v] for v in (timesteps, sigmas)]
    x, kwargs, steps_n, warmup_steps, patches, arg, shared = cp.share_inputs(
        "denoise", (latents, dict(model_kwargs or {}), num_inference_steps, warmup_steps,
                    patches, timestep_arg, (*plain, mu)), check)
    steps, warmup_steps = schedule_steps(scheduler, steps_n, warmup_steps, timing(shared))
    x = x.detach().clone().contiguous().to(cp.device)
    x_in = x.clone()  # the model's input (scale_model_input, on the last rank), broadcast
    b = bind_steps(cp, x_in, kwargs, steps, arg, warmup_steps, patches, timestep_transform)
    front, length, plan, bounds, flats = b.front, b.length, b.plan, b.bounds, b.flats
    programs = rank_programs(cp, front, plan, length, bounds)
    full, first = programs.full, programs.first
    stale = warmup_steps < len(steps)
    if programs.rest is not None and stale:  # every rank decides alike
        raise SpecError(
            f"{front.ctx.model_name}: stale patches of a joint-attention DiT (text tokens "
            "beside the image, a second program for the later patches) do not run on the "
            "distributed backend yet (a later patch's stage fails on the text rows). fix: "
            "warmup_steps=None (every step warm: exact), or the threads or local executor")
    axis, scale = b.axis, b.scale
    bands = patch_bands(itertools.pairwise(bounds), scale)
    if warmup_steps < len(steps):  # every rank checks alike (a seeded random latent)
        check_elementwise(scheduler, x, axis, bands)
    latent = next(j for j, v in enumerate(b.bound.flat) if v is x_in)
    epoch = next_epoch()
    state = cp.states.acquire(front, length)
    state.reset()
    run = DenoiseRun(cp, x, axis, scale, output_transform)
    last = full.leader  # its outputs are the model's: it steps the scheduler
    warm = min(warmup_steps, len(steps))
    got: dict[str, Any] = {}
    whole = StepProtocol(scheduler, x, x_in)
    for i in range(warm):
        if cp.rank == last:
            whole.model_input(steps[i])
        cp.collective(lambda: dist.broadcast(x_in, src=last), "model input broadcast")
        call = Call(tuple(flats[i]), ((0, length),), length, length, epoch)
        cp.execute(full, call, state, sink=lambda _, values: got.__setitem__("v", values))
        if cp.rank == last:
            out = run.model_output(full, call, 0, got["v"])
            whole.step(out, steps[i])
    pipelined = len(steps) - warm
    if pipelined:
        chunks = tuple(itertools.pairwise(bounds))
        calls = [Call(tuple(flats[warm + t]), chunks, length, length, epoch)
                 for t in range(pipelined)]
        scheds = patch_protocols(scheduler, x, x_in, axis, bands) if cp.rank == last else []
        for patch in scheds:
            patch.model_input(steps[warm])
        cp.collective(lambda: dist.broadcast(x_in, src=last), "model input broadcast")

        def rows(m: int) -> torch.Tensor:  # what the readers receive: the model input
            lo, hi = bands[m]
            return x_in.narrow(axis, lo, hi - lo)

        def finish(t: int, m: int, values: tuple[Any, ...]) -> None:
            lo, hi = bands[m]
            out = run.model_output(first, calls[t], m, values).narrow(axis, lo, hi - lo)
            i = warm + t
            scheds[m].step(out, steps[i])
            if i + 1 < len(steps):
                scheds[m].model_input(steps[i + 1])

        patch_jobs(cp, calls, state, programs, rows, warm, last, chunks, pipelined, finish,
                   latent)
    cp.collective(lambda: dist.broadcast(x, src=last), "latents broadcast")
    state.consts.clear()  # the text K/V are this request's
    cp.states.release(front, state)
    return x if cp.rank == 0 or cp.results == "all" else None


def patch_jobs(cp: DenoisingRank, calls: list[Call], state: Any, programs: PatchPrograms,
               rows: Callable[[int], torch.Tensor] | None, warm: int, leader: int,
               chunks: tuple[tuple[int, int], ...], steps: int,
               finish: Callable[[int, int, tuple[Any, ...]], None], latent: int = -1) -> None:
    """This rank's part of ``steps`` pipelined steps of ``chunks`` (``calls[t]``: step
    ``t``'s call): the dry run of the patch program's lists (the stepped patches going back
    to the workers that read flat input ``latent``, the model input's ``rows``), run by
    :class:`_Jobs`; ``finish(t, m, values)`` on the ``leader`` as each patch leaves."""
    dry = _dry_run(programs.first, chunks, steps, latent, programs.rest)
    _Jobs(cp, calls, state, programs.of_patch, rows, warm, leader).run(dry, finish)


class _Jobs:
    """This rank's pipelined jobs (see the module docstring); step ``t`` of the action
    lists is step ``warm + t`` of the call, ``leader`` the worker that steps the patches."""

    def __init__(self, cp: DenoisingRank, calls: list[Call], state: Any,
                 program_of: Callable[[int], Program],
                 rows: Callable[[int], torch.Tensor] | None,
                 warm: int, leader: int) -> None:
        self.cp, self.ex, self.calls, self.state = cp, cp.comm, calls, state
        self.program_of, self.rows, self.warm, self.leader = program_of, rows, warm, leader

    def run(self, dry: DryRun, finish: Callable[[int, int, tuple[Any, ...]], None]) -> None:
        """This rank's lowered list through THE interpreter over the process-group
        transport: receive (from the worker the action names, or a stepped patch back from
        the leader), compute (a part of this rank's worker; the leader then steps the
        patch), a collective of one of its groups, send (to the workers the action names,
        or the stepped patch back to the workers that read the latents)."""
        cp, ex = self.cp, self.ex
        rank = cp.rank
        deadline = rank_deadline(ex, cp.options.timeout)

        rows = self.rows or _no_rows

        def back(act: Action) -> None:  # a stepped patch comes back
            view = rows(act.chunk)
            buf = torch.empty_like(view, memory_format=torch.contiguous_format)
            ex.wait([dist.irecv(buf, act.peer)], act.peer, deadline.at)
            view.copy_(buf)

        def home(act: Action) -> tuple[Any, Any]:  # the stepped patch back to a reader
            out = rows(act.chunk).contiguous()
            return [dist.isend(out, act.peer)], out

        alone = one_stage(dry)  # one stage of several workers: the patches go back aside
        peers = [w for w in range(len(dry.actions)) if w != self.leader] if alone else []

        def output(act: Action, values: tuple[Any, ...]) -> None:
            if rank != self.leader:  # another worker of the last stage: the same values
                return
            finish(act.step, act.chunk, values)
            if peers and act.step + 1 < len(self.calls):
                out = rows(act.chunk).contiguous()
                transport.patches.append((peers[0], ([dist.isend(out, w) for w in peers],
                                                     out)))

        def before(_k: int, act: Action) -> None:  # alone: wait for the stepped patch
            if rank in peers and act.kind == "compute" and act.step and not act.part:
                back(dataclasses.replace(act, peer=self.leader))

        transport = RankEnd(
            ex, dry, deadline=deadline, feedback_recv=back, feedback_send=home,
            recv=lambda act: ex.recv_chunk(self.program_of(act.chunk), act.end - act.start,
                                           deadline.at, act.peer),
            send=lambda act, values: ex.send_chunk(self.program_of(act.chunk), values,
                                                   act.peer))
        Interpreter(dry, rank, lambda act, got: run_stage(
            self.program_of(act.chunk).runners[rank].part(act.part), self.calls[act.step],
            self.state, act.start, act.end, got), transport, output,
            who=f"{ex.who(rank)}, denoise (pipelined step t is step {self.warm} + t)",
            deadline=None, before=before).run()


def _no_rows(m: int) -> torch.Tensor:
    raise SpecError(f"patch {m} would go back to stage 0 in a call of one step (a list "
                    "lowered with the way back). fix: report this program")


def _dry_run(first: Program, chunks: tuple[tuple[int, int], ...], steps: int, latent: int,
             rest: Program | None) -> DryRun:
    """The checked lists of the pipelined steps: the stepped patches go back to the
    workers that read the latents (flat input ``latent``): the stages that read them, or
    every worker of stage 0 on a program of several workers per stage.

    Raises:
        SpecError: a program of several workers per stage whose later stages read the
            latents (its lists send the patches back to stage 0 only).
    """
    programs = [p for p in (first, rest) if p is not None]
    readers = tuple(sorted({w.index for p in programs for w in p.runners
                            if _reads(w, latent)}))
    if not first.workers:
        return check_actions(first.actions_for(chunks, steps), readers)
    if set(readers) - {0}:
        raise SpecError(
            f"stages {list(readers)} read the latents; on stages of several workers the "
            "stepped patches go back to stage 0 only. fix: warmup_steps=None (every step "
            "warm), or one worker per stage")
    return first.dry_run(chunks, steps, rest=rest)


def _reads(worker: StageProgram, latent: int) -> bool:
    """Whether ``worker`` (any of its parts) reads the values of flat input ``latent``; an
    input read for its shape alone (a mesh worker's narrow of it, then ``sym_size``: the
    last stage's unpatchify) is not read."""
    for graph in (worker.parts or (worker,)):
        holders = graph.module.graph.find_nodes(op="placeholder")
        for (_, spec), node in zip(graph.inputs, holders, strict=False):
            if spec.kind in ("token", "const", "full") and spec.index == latent \
                    and _values_used(node):
                return True
    return False


_VIEWS = {torch.ops.aten.narrow.default, torch.ops.aten.slice.Tensor,
          torch.ops.aten.view.default, torch.ops.aten.reshape.default,
          torch.ops.aten.alias.default}
"""Ops whose output is a view of their input (a use through them is the input's use)."""


def _values_used(node: Any) -> bool:
    """Whether any use of ``node`` (through views) reads its values, not only its shape."""
    for user in node.users:
        if user.target is torch.ops.aten.sym_size.int:
            continue
        if user.target in _VIEWS and user.args[0] is node:
            if _values_used(user):
                return True
            continue
        return True
    return False


def rank_programs(cp: DenoisingRank, front: Any, plan: Any, length: int,
              bounds: tuple[int, ...]) -> PatchPrograms:
    """Warm-up, patch and later-patch programs with this rank's worker loaded and its const
    sub-graphs hoisted (as :func:`tppc.pipefusion.denoise.patch_programs`), cached on ``cp``."""

    def make(gm: Any, chunks: tuple[tuple[int, int], ...]) -> Program:
        program = cp.materialise(build_program(gm, front.ctx, plan, chunks,
                                                cp.options.devices))
        return _hoisted(program, cp.rank)

    return cached_patch_programs(
        cp.__dict__.setdefault("_distributed_denoise_programs", {}), plan, front.batch,
        length, bounds, make, front.chunk, front.chunk.meta.get(REST_CHUNK))


def _hoisted(program: Program, rank: int) -> Program:
    """``program`` with worker ``rank``'s const sub-graphs hoisted (each part's, when it is
    cut into parts; :mod:`tppc.passes.stages.hoist_consts`)."""
    mine = program.runners[rank]
    mine = dataclasses.replace(mine, parts=tuple(hoist_constants(p) for p in mine.parts)) \
        if mine.parts else hoist_constants(mine)
    if not program.workers:
        stages = list(program.stages)
        stages[rank] = mine
        return dataclasses.replace(program, stages=tuple(stages))
    workers = list(program.workers)
    workers[rank] = mine
    stages = tuple(next(w for w in workers if w.index == s) for s in range(len(program.stages)))
    return dataclasses.replace(program, stages=stages, workers=tuple(workers))
