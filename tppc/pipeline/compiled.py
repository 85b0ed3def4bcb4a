"""A model compiled into a token pipeline: :class:`CompiledPipeline` (call it like the model).

Terms:
    program cache: one :class:`tppc.program.program.Program` per (batch shape, sequence length)
        (:mod:`tppc.pipeline.programs`). A length tppc has not planned is re-planned (when
        tppc made the plan) or refused (when it was given).
    call state: each call takes its own K/V buffers from the pipeline's pool of its capture
        (:mod:`tppc.calls.states`), so concurrent calls of one pipeline are independent;
        a call that fails drops its state and leaves the pipeline as it was.

A drop-in for the model (as ``torch.compile``'s wrapper is: :mod:`tppc.pipeline.drop_in`): a
call's keywords ``timeout``, ``executor``, ``trace`` (``tppc.pipeline.captures.RUN_KEYWORDS``)
are the pipeline's own unless ``model.forward`` names them: they never reach its ``**kwargs``.

The pipeline holds what it is given: the example's capture and program, and the emitter
(:class:`tppc.driver.emit.Emitter`) of the programs of other lengths; its parts are the
captures (:mod:`tppc.pipeline.captures`), the programs (:mod:`tppc.pipeline.programs`), the
call states (:mod:`tppc.calls.states`) and the executors.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.backends.torch_local import LocalExecutor, Sink
from tppc.backends.torch_threads import ThreadsExecutor
from tppc.calls.call import Delivery, LocalDelivery, run_call
from tppc.calls.kv_cache import read_kv_cache
from tppc.calls.states import CallStates
from tppc.driver.emit import Emitter
from tppc.driver.options import CompileOptions, ExecutorName, check_executor, check_seconds
from tppc.errors import SpecError
from tppc.frontend.front_end import BoundCall, FrontEnd
from tppc.ir.context import PassRecord
from tppc.pipeline.captures import RUN_KEYWORDS, Captures, forward_parameters
from tppc.pipeline.conversions import check_weights, weights
from tppc.pipeline.drop_in import ModelStandIn
from tppc.pipeline.programs import Programs
from tppc.pipeline.rebalance import Rebalancing
from tppc.planner.plan import Plan, Workload
from tppc.program.program import Program
from tppc.program.state import Call, CallState
from tppc.validation.validate import validate_pipeline

__all__ = ["CompiledPipeline", "StageSummary"]


@dataclass(frozen=True)
class StageSummary:
    """One stage of a compiled pipeline.

    Attributes:
        index: stage number.
        device: where it runs.
        layers: names of its layers.
        module: its stage graph (``module.tppc_positional``: its positional program).
        param_count: parameter elements it holds (positional program included).
        param_bytes: bytes of its parameters and module buffers.
        kv_bytes: bytes of its K/V buffers at the planned length.
    """

    index: int
    device: torch.device
    layers: tuple[str, ...]
    module: fx.GraphModule
    param_count: int
    param_bytes: int
    kv_bytes: int


class CompiledPipeline(ModelStandIn, Rebalancing):
    """A model compiled into pipeline stages; call it like the model.

    Args:
        model: the compiled model.
        front: the example's capture.
        program: the program of the example's length (``program.plan``: :attr:`plan`).
        emitter: the programs of other lengths and captures (and its ``options``).
        seq_dims: the sequence axes given to compile (for captures of other batch shapes).

    Attributes:
        plan: the plan of the example's length.
        options: the validated compile options.
        context: the compile context of the example's capture.
        executor: the executor calls run on.
        captures: the captures of the model and the binding of a call's inputs.
        programs: the programs held, one per (capture, length), and their emitter.
        states: the call states (a pool per capture; the last call's, for :meth:`kv_cache`).
        last_trace: ``(stage, chunk, start, end)`` of the last ``threads`` call.
        validation: what ``tppc.compile`` checked (:class:`tppc.validation.validate.Validation`),
            or None (``verify=False``).
        example: ``(args, kwargs)`` of the compile (what ``tppc.export`` checks the artifact
            on), or None.
    """

    validation: Any = None
    example: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __init__(self, model: torch.nn.Module, front: FrontEnd, program: Program,
                 emitter: Emitter, *,
                 seq_dims: Mapping[str, int | tuple[int, ...]] | None = None) -> None:
        options = emitter.options
        self.model_name = type(model).__name__
        self._model, self._seq_dims = model, seq_dims
        self.options = options
        self._front = front
        self.captures = Captures(model, front, seq_dims=seq_dims, keep=options.program_cache,
                                 max_seq=options.max_seq)
        self.states = CallStates(options.keep_states, options.program_cache)
        self.programs = Programs(emitter, self._admit, options.program_cache)
        self._lock = threading.RLock()
        self._executors = {"local": LocalExecutor(),
                           "threads": ThreadsExecutor(options.threads_per_stage,
                                                      options.queue_depth)}
        self.executor: ExecutorName = options.executor
        generation = getattr(model, "generation_config", None)
        self.eos_token_id = getattr(generation, "eos_token_id", None)
        self.pad_token_id = getattr(generation, "pad_token_id", None)
        self.programs.hold(front, self._admit(program))
        self.plan = program.plan
        named = forward_parameters(model)
        self._run_keywords = tuple(k for k in RUN_KEYWORDS if k not in named)
        self.__module__ = type(model).__module__  # the model's (drop_in)
        self._weights = weights(model)

    # -- public --------------------------------------------------------------------------------
    @property
    def context(self) -> Any:
        """The compile context of the example's capture."""
        return self._front.ctx

    @property
    def model(self) -> torch.nn.Module:
        """The model this pipeline was compiled from."""
        return self._model

    @property
    def input_dtypes(self) -> dict[str, torch.dtype]:
        """The dtype of every tensor input of the example's capture, by name."""
        return {ph.name: ph.meta["val"].dtype for ph in self._front.placeholders
                if isinstance(ph.meta.get("val"), torch.Tensor)}

    @property
    def max_seq(self) -> int | None:
        """Longest sequence accepted (``None``: no limit)."""
        return self.options.max_seq

    @property
    def stages(self) -> tuple[StageSummary, ...]:
        """The stages of the planned length's program."""
        return tuple(_summary(st, self.plan.seq_len)
                     for st in self.program(self.plan.seq_len).stages)

    @property
    def history(self) -> list[PassRecord]:
        """The graph after each pass, in order (re-plans append their partition)."""
        return self._front.ctx.history

    @property
    def last_trace(self) -> list[tuple[int, int, float, float]]:
        """``(stage, chunk, start, end)`` of every job of the last ``threads`` call."""
        return self._executors["threads"].last_trace

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the pipeline; returns what the model returns.

        ``timeout``, ``executor`` and ``trace`` are :meth:`run`'s unless ``model.forward``
        names them (module docstring).

        Raises:
            RuntimeInputError: inputs that do not match the compiled model (before any stage
                runs), or a length that cannot be re-planned.
            StageTimeout: the call took longer than ``options.timeout``.
        """
        own = {k: kwargs.pop(k) for k in self._run_keywords if k in kwargs}
        return self.run(args, kwargs, **own)

    def run(self, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None, *,
            timeout: float | None = None, executor: ExecutorName | None = None,
            trace: list | None = None) -> Any:
        """``model(*args, **kwargs)`` through the pipeline, with a per-call ``timeout``, an
        executor other than the compiled one, and a ``trace`` list that receives
        ``(stage, chunk, start, end)`` (``time.perf_counter``) of every job."""
        if self.auto is not None:  # cp.auto_rebalance: traced, refitted every N calls
            return self.auto.run(self, tuple(args), kwargs or {}, timeout=timeout,
                                 executor=executor, trace=trace)
        return run_call(self, tuple(args), kwargs or {}, self._delivery(), timeout=timeout,
                        executor=executor, trace=trace)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, **kwargs: Any
                 ) -> torch.Tensor:
        """Pipelined prefill, then greedy decoding; see :func:`tppc.pipeline.generate` (a
        block-scan capture: :mod:`tppc.pipeline.block_generate`)."""
        from tppc.pipeline.block_generate import block_generate
        from tppc.pipeline.generate import greedy_generate

        block = self._front.ctx.block_size
        if block is not None:
            return block_generate(self, block, input_ids, max_new_tokens, **kwargs)
        return greedy_generate(self, input_ids, max_new_tokens, **kwargs)

    def denoise(self, latents: torch.Tensor, scheduler: Any,
                num_inference_steps: int | None = 20, *, warmup_steps: int | None = 1,
                patches: int | None = None, model_kwargs: Mapping[str, Any] | None = None,
                timestep_arg: str = "timestep",
                output_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                executor: ExecutorName | None = None, timesteps: Any = None,
                sigmas: Any = None, mu: float | None = None,
                timestep_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                quality: Any = None) -> torch.Tensor:
        """Denoise ``latents`` with PipeFusion (:mod:`tppc.pipefusion.denoise`): warm-up steps run
        the whole image, then patches (``None``: the plan's, :meth:`denoise_plan`) of
        consecutive steps flow through the stages with one-step-stale K/V.
        ``warmup_steps == num_inference_steps`` (or ``None``) equals the serial loop
        ``scale_model_input → model → output_transform → scheduler.step``. ``timesteps``,
        ``sigmas``, ``mu`` go to ``scheduler.set_timesteps`` (as diffusers'
        ``retrieve_timesteps`` passes them); ``timestep_transform`` maps ``t.expand(batch)``
        to the model's timestep (Flux: ``lambda t: t / 1000``); ``quality``: see
        :mod:`tppc.pipefusion.quality`."""
        from tppc.pipefusion.denoise import TimestepSchedule, denoise

        schedule = TimestepSchedule(timesteps=timesteps, sigmas=sigmas, mu=mu,
                                    timestep_transform=timestep_transform)
        return denoise(self, latents, scheduler, num_inference_steps,
                       warmup_steps=warmup_steps, patches=patches, model_kwargs=model_kwargs,
                       timestep_arg=timestep_arg, output_transform=output_transform,
                       executor=executor, schedule=schedule, quality=quality)

    def denoise_plan(self, num_inference_steps: int, warmup_steps: int,
                     length: int | None = None, front: FrontEnd | None = None,
                     max_patches: int | None = None) -> Plan:
        """The plan ``denoise(patches=None)`` runs: re-planned for
        ``Workload(kind="diffusion", steps, warmup_steps)`` at ``length`` patch rows (default:
        the example's) and cached; a given plan is used as is (its boundaries are the patches
        when its workload is ``diffusion``, else one patch per stage), ``max_patches`` at most."""
        front = front or self._front
        length = self.plan.seq_len if length is None else length
        planner = self.programs.emitter.planner
        if planner is None:
            return self.program(length, front).plan
        key = (front.key, length, num_inference_steps, warmup_steps, max_patches)
        with self._lock:
            cache = self.__dict__.setdefault("_denoise_plans", OrderedDict())
            if key not in cache:
                workload = Workload(kind="diffusion", steps=num_inference_steps,
                                    warmup_steps=min(warmup_steps, num_inference_steps),
                                    max_patches=max_patches)
                cache[key] = planner(front, length, workload=workload)
                while len(cache) > self.options.program_cache:
                    cache.popitem(last=False)
            return cache[key]

    def kv_cache(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every attention's (K, V) over the tokens of the last call, in layer order.

        K and V are as the model computes them before grouped-query repetition (HF's
        ``past_key_values`` layout for Llama and GPT-2: ``(batch, kv_heads, seq, head_dim)``).

        Raises:
            RuntimeInputError: no call has finished yet, or a later call reused its buffers.
        """
        return read_kv_cache(self.states.last)

    def with_plan(self, plan: Plan, *, executor: ExecutorName | None = None,
                  **options: Any) -> CompiledPipeline:
        """The same captured model emitted for another plan (no re-capture); other lengths
        are refused. ``options``: any :class:`CompileOptions` field. Validated like
        ``tppc.compile`` (on the compile's example, resized to the plan's length) unless
        ``verify`` is False.

        Raises:
            SoundnessError: the new program differs from the captured graph.
        """
        fields = {**self.options.__dict__, **options,
                  "executor": executor or self.executor, "chunks": None}
        ctx = dataclasses.replace(self._front.ctx,
                                  history=list(self._front.ctx.history[: self._front.passes]))
        front = dataclasses.replace(self._front, ctx=ctx)
        emitter = Emitter(CompileOptions(**fields), None, plan)
        emitter.check(front, plan)
        other = CompiledPipeline(self._model, front, emitter.emit(front, plan), emitter,
                                 seq_dims=self._seq_dims)
        other.captures.share(self.captures)  # captures of other batch shapes (immutable)
        other.example = self.example
        if other.options.verify and self.example is not None:  # SoundnessError on a mismatch
            other.validation = validate_pipeline(other, self._model, *self.example)
        return other

    # -- used by generate and the tests ---------------------------------------------------------
    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]:
        """The capture for these inputs and the bound call (:meth:`Captures.bind`).

        Raises:
            RuntimeInputError: naming the input, what it is, what was compiled, and the fix
                (and when the model's weights were converted after the compile).
        """
        check_weights(self._model, self._weights)
        return self.captures.bind(args, kwargs)

    def program(self, length: int, front: FrontEnd | None = None) -> Program:
        """The program for ``length`` tokens (re-planned and cached, or refused)."""
        return self.programs.get(front or self._front, length)

    def execute(self, program: Program, call: Call, state: CallState, sink: Sink | None = None,
                executor: ExecutorName | None = None, timeout: float | None = None,
                trace: list | None = None) -> list[tuple[Any, ...]]:
        """Run ``call`` on ``program`` with an executor (default: the compiled one)."""
        check_seconds("timeout", timeout)  # refused before any stage runs
        timeout = self.options.timeout if timeout is None else timeout
        return self._executor(executor).run(program, call, state, sink, timeout=timeout,
                                            trace=trace)

    def _executor(self, name: ExecutorName | None) -> Any:
        """The executor called ``name`` (default: the compiled one), or a named refusal."""
        name = name or self.executor
        found = self._executors.get(name)
        if found is None:
            check_executor(name)
            raise SpecError(f"executor={name!r} is not available in this pipeline (it has "
                            f"{sorted(self._executors)}). fix: use one of those, or compile "
                            "with backend='distributed' (one process per stage, torchrun)")
        return found

    def profile(self, *args: Any, **kwargs: Any) -> Any:
        """Run once untimed, then once with the ``threads`` executor timing every job against
        the plan's prediction; returns a :class:`tppc.pipeline.profile.Profile`."""
        from tppc.pipeline.profile import profile_call

        return profile_call(self, args, kwargs)

    # -- building ------------------------------------------------------------------------------
    def _delivery(self, timeout: float | None = None) -> Delivery:
        """How one call's outputs reach the caller (:mod:`tppc.calls.call`); ``timeout``:
        the call's (a job bounds its wait for the results by it)."""
        return LocalDelivery()

    def _admit(self, program: Program) -> Program:
        """An emitted program this pipeline will run: refused when its executor cannot."""
        reason = self._executors[self.executor].check(program)
        if reason is not None:
            raise SpecError(f"executor {self.executor!r} cannot run these stages: {reason}. "
                            "fix: use executor='local' or other devices")
        return program


def _summary(stage: Any, length: int) -> StageSummary:
    return StageSummary(index=stage.index, device=stage.device, layers=stage.layers,
                        module=stage.module, param_count=stage.param_count,
                        param_bytes=stage.param_bytes,
                        kv_bytes=sum(b.nbytes(length) for b in stage.buffers))
