"""A model compiled into a token pipeline: :class:`CompiledPipeline` (call it like the model).

Terms:
    program cache: one :class:`tppc.program.program.Program` per (batch shape, sequence length),
        least recently used first out (``CompileOptions.program_cache``). A length tppc has
        not planned is re-planned (when tppc made the plan) or refused (when it was given).
    call state: each call takes its own K/V buffers from the front end's pool
        (:mod:`tppc.program.state`), so concurrent calls of one pipeline are independent;
        a call that fails drops its state and leaves the pipeline as it was.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc.backends.torch_local import LocalExecutor, Sink
from tppc.backends.torch_threads import ThreadsExecutor
from tppc.calls.call import Delivery, LocalDelivery, run_call
from tppc.calls.kv_cache import read_kv_cache
from tppc.driver.emit import build_program
from tppc.driver.options import (
    CompileOptions,
    ExecutorName,
    check_executor,
    check_seconds,
    chunk_bounds,
)
from tppc.driver.planning import Planner
from tppc.errors import CaptureError, RuntimeInputError, SpecError
from tppc.frontend.front_end import (
    BoundCall,
    FrontEnd,
    bind,
    capture_front_end,
    read_inputs,
)
from tppc.ir.context import PassRecord
from tppc.pipeline.rebalance import Rebalancing
from tppc.planner.plan import Plan, Workload
from tppc.program.program import Program
from tppc.program.state import Call, CallState, StatePool
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


_ANY_BATCH = object()
"""First item of a front-end key that matches any batch shape of an input structure."""


class CompiledPipeline(Rebalancing):
    """A model compiled into pipeline stages; call it like the model.

    Attributes:
        plan: the plan of the example's length.
        options: the validated compile options.
        context: the compile context of the example's capture.
        executor: the executor calls run on.
        last_trace: ``(stage, chunk, start, end)`` of the last ``threads`` call.
        validation: what ``tppc.compile`` checked (:class:`tppc.validation.validate.Validation`),
            or None (``verify=False``).
        example: ``(args, kwargs)`` of the compile (what ``tppc.export`` checks the artifact
            on), or None.
    """

    validation: Any = None
    example: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __init__(self, model: torch.nn.Module, front: FrontEnd, plan: Plan, *,
                 planner: Planner | None, options: CompileOptions,
                 seq_dims: Mapping[str, int | tuple[int, ...]] | None = None) -> None:
        self.model_name = type(model).__name__
        self._model, self._seq_dims = model, seq_dims
        self.options, self._planner, self._given = options, planner, plan
        self._front = front
        self._fronts: OrderedDict[Any, FrontEnd] = OrderedDict({front.key: front})
        self._programs: OrderedDict[tuple[Any, int], Program] = OrderedDict()
        self._lock = threading.RLock()
        self._pending: dict[Any, Future[FrontEnd]] = {}  # captures in flight, by front key
        self._executors = {"local": LocalExecutor(),
                           "threads": ThreadsExecutor(options.threads_per_stage,
                                                      options.queue_depth)}
        self.executor: ExecutorName = options.executor
        self._last: tuple[CallState, int, FrontEnd] | None = None
        generation = getattr(model, "generation_config", None)
        self.eos_token_id = getattr(generation, "eos_token_id", None)
        self.pad_token_id = getattr(generation, "pad_token_id", None)
        self._captured_history = len(front.ctx.history)
        self._check_bidirectional(plan)
        self._programs[front.key, plan.seq_len] = self._build(front, plan)
        self.plan = plan

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

        Raises:
            RuntimeInputError: inputs that do not match the compiled model (before any stage
                runs), or a length that cannot be re-planned.
            StageTimeout: the call took longer than ``options.timeout``.
        """
        return self.run(args, kwargs)

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
        """Pipelined prefill, then greedy decoding; see :func:`tppc.pipeline.generate`."""
        from tppc.pipeline.generate import greedy_generate

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
        if self._planner is None:
            return self.program(length, front).plan
        key = (front.key, length, num_inference_steps, warmup_steps, max_patches)
        with self._lock:
            cache = self.__dict__.setdefault("_denoise_plans", OrderedDict())
            if key not in cache:
                workload = Workload(kind="diffusion", steps=num_inference_steps,
                                    warmup_steps=min(warmup_steps, num_inference_steps),
                                    max_patches=max_patches)
                cache[key] = self._planner(front, length, workload=workload)
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
        with self._lock:
            last = self._last
        return read_kv_cache(last)

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
                                  history=list(self._front.ctx.history[: self._captured_history]))
        front = dataclasses.replace(self._front, ctx=ctx,
                                    pool=StatePool(self.options.keep_states))
        other = CompiledPipeline(self._model, front, plan, planner=None,
                                 options=CompileOptions(**fields), seq_dims=self._seq_dims)
        with self._lock:  # captures of other batch shapes are shared (they are immutable)
            other._fronts.update((k, f) for k, f in self._fronts.items() if k != front.key)
        other.example = self.example
        if other.options.verify and self.example is not None:  # SoundnessError on a mismatch
            other.validation = validate_pipeline(other, self._model, *self.example)
        return other

    # -- used by generate and the tests ---------------------------------------------------------
    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
             ) -> tuple[FrontEnd, BoundCall]:
        """The front end for these inputs (captured for a new batch size) and the bound call.

        Raises:
            RuntimeInputError: naming the input, what it is, what was compiled, and the fix.
        """
        inputs = read_inputs(self._model, args, kwargs)  # bound once per call
        structure = inputs.structure
        base = self._front_for((_ANY_BATCH, structure),  # other keyword inputs: capture them
                               lambda: self._capture(args, kwargs, None))
        bound = bind(base, self._model, inputs)
        if self.options.max_seq is not None and bound.length > self.options.max_seq:
            raise RuntimeInputError(
                f"the sequence has {bound.length} tokens, max_seq={self.options.max_seq}. "
                f"fix: compile with max_seq={bound.length} (or more), or max_seq=None")
        with self._lock:  # a dynamic capture serves many sizes, a specialised one its own
            front = next((f for f in reversed(self._fronts.values())
                          if f.serves(structure, bound)), None)
        front = front or self._front_for((structure, bound.batch),
                                         lambda: self._capture(args, kwargs, bound))
        return front, dataclasses.replace(bound, batch=front.batch)

    def _front_for(self, key: tuple[Any, Any], capture: Callable[[], FrontEnd]) -> FrontEnd:
        """The cached front end for ``key`` (``(_ANY_BATCH, structure)``: the latest of any
        batch shape), else ``capture()``'s, run once for concurrent callers: the first
        captures (the process runs one capture at a time, :mod:`tppc.frontend.isolation`),
        the others wait for it and share its front end or its error."""
        with self._lock:
            front = (self._fronts.get(key) if key[0] is not _ANY_BATCH else
                     next((f for f in reversed(self._fronts.values()) if f.key[0] == key[1]),
                          None))
            if front is not None:
                if key[0] is not _ANY_BATCH:
                    self._fronts.move_to_end(key)
                return front
            pending = self._pending.get(key)
            if pending is None:
                pending = self._pending[key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            front = capture()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            self._fronts[front.key] = front
            while len(self._fronts) > self.options.program_cache:
                self._fronts.popitem(last=False)
            del self._pending[key]
        pending.set_result(front)
        return front

    def program(self, length: int, front: FrontEnd | None = None) -> Program:
        """The program for ``length`` tokens (re-planned and cached, or refused)."""
        front = front or self._front
        key = (front.key, length)
        with self._lock:
            if key in self._programs:
                self._programs.move_to_end(key)
                return self._programs[key]
            if self._planner is None and length != self._given.seq_len:
                raise RuntimeInputError(
                    f"the sequence has {length} tokens; the given plan is for "
                    f"{self._given.seq_len}. fix: call with {self._given.seq_len} tokens, or "
                    "compile with plan=None so that tppc re-plans per length")
            plan = self._given if self._planner is None else self._planner(front, length)
            program = self._build(front, plan)
            self._programs[key] = program
            while len(self._programs) > self.options.program_cache:
                self._programs.popitem(last=False)
            return program

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

    def finish(self, front: FrontEnd, state: CallState, filled: int) -> None:
        """Record a successful call's state (for :meth:`kv_cache`) and give it back."""
        state.filled = filled
        with self._lock:
            self._last = (state, state.uses, front)
        front.pool.release(state)

    def assemble(self, program: Program, leaves: list[Any]) -> Any:
        """The model's output structure from its flat outputs."""
        if program.signature.out_spec is None:
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        return pytree.tree_unflatten(leaves, program.signature.out_spec)

    # -- building ------------------------------------------------------------------------------
    def _delivery(self, timeout: float | None = None) -> Delivery:
        """How one call's outputs reach the caller (:mod:`tppc.calls.call`); ``timeout``:
        the call's (a job bounds its wait for the results by it)."""
        return LocalDelivery()

    def _capture(self, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 bound: BoundCall | None) -> FrontEnd:
        if bound is not None and bound.length < 2:
            raise RuntimeInputError(
                f"a call with batch shape {bound.batch} needs a new capture, and a "
                f"{bound.length}-token call cannot be captured. fix: call once with at least "
                "2 tokens at this batch size")
        what = f"inputs {sorted(kwargs)}" if bound is None else f"batch shape {bound.batch}"
        try:
            return capture_front_end(self._model, tuple(args), kwargs, seq_dims=self._seq_dims,
                                     keep_states=self.options.keep_states)
        except CaptureError as exc:
            raise RuntimeInputError(f"re-capturing {self.model_name} for {what} failed: "
                                    f"{exc}") from exc

    def _check_bidirectional(self, plan: Plan) -> None:
        chunks = self.options.chunks
        many = (chunks is not None and (chunks != 1 if isinstance(chunks, int)
                                        else len(chunks) > 2))
        given_many = (self._planner is None and len(plan.boundaries) > 2
                      and plan.workload.kind != "diffusion")  # diffusion: denoise's patches
        if self._front.bidirectional and (many or given_many):
            raise SpecError(
                f"{self.model_name} has bidirectional attention or buffered mixing ("
                f"{self._front.bidirectional[0]}): a chunk would read stale rows of later "
                "chunks, so tppc runs each call as one chunk (exact). fix: drop chunks= / give "
                "a plan with one chunk (cp.denoise pipelines the patches)")

    def _build(self, front: FrontEnd, plan: Plan) -> Program:
        chunks = plan.chunks
        if front.bidirectional:  # a barrier at every layer: one chunk, exact
            chunks = ((0, plan.seq_len),)
        elif self.options.chunks is not None and self._planner is None:
            bounds = chunk_bounds(self.options.chunks, plan.seq_len)
            chunks = tuple(itertools.pairwise(bounds))
        program = build_program(front.chunk, front.ctx, plan, chunks, self.options.devices)
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
