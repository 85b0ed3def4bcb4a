"""PipeFusion one call at a time: a pipeline's own denoising loop calls the model once per
step with the whole latent, and :class:`StepCalls` runs each call through the stages with
the K/V of the previous call kept.

Terms:
    stream: the calls of one denoising loop that see each other's K/V, e.g. the conditional
        calls of a true-CFG loop, which calls the model twice per step (named by the
        caller: diffusers' ``cache_context("cond")``). Each stream has its own call state
        and step count.
    warm call: the first ``warmup_steps`` calls of a stream: the whole latent as one chunk
        through every stage (in the calling thread, with the intra-op threads of all the
        stage workers), writing every K/V row; exact.
    stale call: a later call: the patches one after the other through the stages, patch
        ``m`` attending to this call's rows of patches ``≤ m`` and the previous call's rows of
        the others (one-step-stale K/V, as :mod:`tppc.pipefusion.denoise`). The loop steps
        the latent between calls, so the pipeline fills and drains once per call: with
        ``S`` stages and ``M`` patches a call takes ``M + S − 1`` patch times instead of
        the ``M`` of ``cp.denoise``, where patches of the next step enter as this step's
        leave. The fill and the drain run on the idle stages' intra-op threads too
        (:func:`tppc.pipefusion.jobs.idle_threads`), which shortens them.

Stages of several workers (tensor parallelism, or a mesh: cfg, ring, ulysses,
:mod:`tppc.program.mesh`) run a warm call with a thread per worker (:class:`ThreadsExecutor`),
and a stale call's patches through every worker of every stage (each worker its own K/V: a
CFG group keeps the stale K/V of its half of the batch).

:meth:`StepCalls.reset` starts a new loop (a diffusers pipeline call): the states go back,
and the next call of every stream is warm again.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping
from typing import Any

from tppc.backends.torch_local import LocalExecutor
from tppc.backends.torch_threads import ThreadsExecutor
from tppc.calls.call import with_tail
from tppc.calls.io import OutputAssembler, output_structure
from tppc.pipefusion.denoise import all_threads, choose_patches, intra_op_threads, patch_programs
from tppc.pipefusion.jobs import Jobs, run_pipelined, run_serial
from tppc.program.patches import PatchPrograms
from tppc.program.program import Program, StageProgram
from tppc.program.state import Call, CallState, next_epoch

__all__ = ["StepCalls"]


class StepCalls:
    """Calls of a compiled pipeline, one per denoising step (module docstring).

    Args:
        cp: the compiled pipeline (:class:`tppc.CompiledPipeline`).
        warmup_steps: warm calls per stream and loop (``None``: every call is warm: exact).
        patches: patches of a stale call (``None``: the diffusion plan's, priced for
            ``num_inference_steps``).
        num_inference_steps: steps of a loop, for the diffusion plan (``None``: 20).
        executor: ``"threads"`` or ``"local"`` (default: the pipeline's).

    Example:
        >>> calls = StepCalls(cp, warmup_steps=1, patches=2)               # doctest: +SKIP
        >>> for t in timesteps: out = calls((latents,), {"timestep": t}); ...
        >>> calls.reset()                                                  # the next loop
    """

    def __init__(self, cp: Any, *, warmup_steps: int | None = 1, patches: int | None = None,
                 num_inference_steps: int | None = None, executor: str | None = None) -> None:
        self.cp, self.warmup_steps, self.patches = cp, warmup_steps, patches
        self.num_inference_steps = num_inference_steps
        self.executor = executor
        self._lock = threading.Lock()
        self._streams: dict[Any, tuple[Any, CallState, int]] = {}  # key -> front, state, calls
        self._epoch = next_epoch()

    def reset(self) -> None:
        """Start a new loop: give the states back; every stream's next call is warm."""
        with self._lock:
            streams, self._streams = self._streams, {}
            self._epoch = next_epoch()
        for front, state, _ in streams.values():
            state.consts.clear()  # the text K/V are this loop's
            self.cp.states.release(front, state)

    def __call__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], stream: Any = None
                 ) -> Any:
        """One step's call of the model: warm or stale (module docstring); returns what the
        model returns."""
        cp = self.cp
        front, bound = cp.bind(tuple(args), kwargs)
        length = bound.length
        key = (stream, front.key, length)
        with self._lock:
            entry = self._streams.get(key)
            if entry is None:
                state = cp.states.acquire(front, length)
                state.reset()
                entry = (front, state, 0)
            front, state, done = entry
            self._streams[key] = (front, state, done + 1)
        warm = self.warmup_steps is None or done < self.warmup_steps
        steps = self.num_inference_steps or 20
        plan, bounds = choose_patches(cp, front, length, steps,
                                      steps if self.warmup_steps is None
                                      else min(self.warmup_steps, steps), self.patches)
        programs = self.programs(front, plan, length, bounds)
        if warm or len(bounds) == 2:
            call = Call(tuple(bound.flat), ((0, length),), length, length, self._epoch)
            return output_structure(programs.full, self.warm(programs.full, call, state))
        call = Call(tuple(bound.flat), tuple(itertools.pairwise(bounds)), length, length,
                    self._epoch)
        return output_structure(programs.first, self.stale(programs, call, state, done))

    def programs(self, front: Any, plan: Any, length: int, bounds: tuple[int, ...]
                 ) -> PatchPrograms:
        """The call's programs (:func:`tppc.pipefusion.denoise.patch_programs`)."""
        return patch_programs(self.cp, front, plan, length, bounds)

    def warm(self, full: Program, call: Call, state: CallState) -> list[Any]:
        """A warm call's output leaves (the whole latent as one chunk)."""
        cp = self.cp
        threaded = (self.executor or cp.executor) == "threads" and len(full.runners) > 1
        sink = OutputAssembler(full.signature.output_axes, call, full.signature.output_rows)
        if full.workers and (self.executor or cp.executor) == "threads":
            (values,) = ThreadsExecutor(cp.options.threads_per_stage).run(full, call, state)
        else:
            with intra_op_threads(all_threads(cp, full) if threaded else None):
                (values,) = LocalExecutor().run(full, call, state)
        sink(0, values)
        return with_tail(full, call.flat_inputs, sink.leaves)

    def stale(self, programs: PatchPrograms, call: Call, state: CallState, done: int
              ) -> list[Any]:
        """A stale call's output leaves: the patches through the stages (``done``: the
        stream's calls before this one)."""
        cp, first = self.cp, programs.first
        sink = OutputAssembler(first.signature.output_axes, call, first.signature.output_rows)

        def stage_of(m: int, w: int) -> StageProgram:
            return programs.of_patch(m).runners[w]

        def finish(_t: int, m: int, values: tuple[Any, ...]) -> None:
            sink(m, values)

        jobs = Jobs(first.dry_run(call.chunks, 1, rest=programs.rest), [call], state,
                    stage_of, finish, done, first.leader)
        if (self.executor or cp.executor) == "threads" and len(first.runners) > 1:
            run_pipelined(cp, jobs)
        else:
            run_serial(jobs)
        return with_tail(first, call.flat_inputs, sink.leaves)
