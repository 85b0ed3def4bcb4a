"""Compile a model into a token pipeline and run it: :func:`compile_pipeline`.

Terms:
    program: the stage graphs of one plan, on their devices, with their runners.
    planned length: the sequence length a plan was made for; another length is re-planned
        (cached per length) when tppc made the plan, and refused when the plan was given.
    buffer capacity (``max_seq``): tokens the K/V buffers hold; longer inputs are refused.

Example:
    >>> cp = compile_pipeline(model, (input_ids,), plan=manual_plan(6, 16, cuts=(0, 3, 6),
    ...                       boundaries=(0, 8, 16)), executor="local")  # doctest: +SKIP
    >>> cp(input_ids).logits.shape
    torch.Size([1, 16, 128])
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import fx
from torch.utils import _pytree as pytree

from tppc._pipeline_io import OutputAssembler, check_input, device_for
from tppc.backends.torch_local import Call, LocalExecutor, Sink, StageRunner
from tppc.backends.torch_threads import ThreadsExecutor
from tppc.capture import bind_inputs, capture
from tppc.context import CompileContext, PassRecord
from tppc.errors import CaptureError, RuntimeInputError, SpecError
from tppc.ir import CHUNK_SIGNATURE, STAGE_INFO
from tppc.passes.annotate_seq_dims import annotate_seq_dims_pass
from tppc.passes.chunk_attention import ChunkSignature, chunk_attention_pass
from tppc.passes.group_layers import group_layers_pass
from tppc.passes.partition_stages import partition_stages
from tppc.passes.runner import run_passes
from tppc.planner.plan import Plan, SolverInfo, StagePlan, Workload
from tppc.planning import default_granularity

__all__ = ["CompiledPipeline", "ExecutorName", "StageSummary", "compile_pipeline",
           "manual_plan"]

ExecutorName = Literal["local", "threads"]


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
        kv_bytes: bytes of its K/V buffers.
    """

    index: int
    device: torch.device
    layers: tuple[str, ...]
    module: fx.GraphModule
    param_count: int
    param_bytes: int
    kv_bytes: int


@dataclass(frozen=True)
class _Program:
    plan: Plan
    graph: fx.GraphModule
    runners: tuple[StageRunner, ...]


def manual_plan(layers: int | Sequence[str], seq_len: int, *, cuts: Sequence[int],
                boundaries: Sequence[int], device_name: str = "cpu") -> Plan:
    """A :class:`Plan` with a given placement and split and no predicted times (tests, demos).

    Args:
        layers: number of layers (``ctx.layers``, prologue and epilogue included) or names.
        seq_len: tokens in the sequence.
        cuts: ``(0, e_1, ..., N)``: stage ``s`` runs layers ``[cuts[s], cuts[s+1])``.
        boundaries: ``(0, ..., seq_len)``: token offsets of the chunks.
        device_name: device preset of every stage.
    """
    names = [f"layer{i}" for i in range(layers)] if isinstance(layers, int) else list(layers)
    stages = tuple(
        StagePlan(index=s, layer_start=lo, layer_end=hi, device_index=s,
                  device_name=device_name, memory_bytes=0, capacity_bytes=0,
                  layer_names=tuple(names[lo:hi]))
        for s, (lo, hi) in enumerate(itertools.pairwise(cuts)))
    zeros = tuple(tuple(0.0 for _ in range(len(boundaries) - 1)) for _ in stages)
    return Plan(workload=Workload(), seq_len=seq_len, granularity=1,
                boundaries=tuple(boundaries), stages=stages, start=zeros, end=zeros,
                latency=0.0, warmup_seconds=0.0, lower_bound=0.0, lower_bound_work=0.0,
                lower_bound_path=0.0,
                solver=SolverInfo(solver="given", status="given", objective=0.0, bound=0.0,
                                  gap=0.0, seconds=0.0))


class CompiledPipeline:
    """A model compiled into pipeline stages; call it like the model.

    Attributes:
        plan: the plan of the planned length.
        stages: one :class:`StageSummary` per stage.
        history: the graph after each pass (:class:`tppc.context.PassRecord`).
        context: the compile context.
    """

    def __init__(self, model: torch.nn.Module, annotated: fx.GraphModule, chunk: fx.GraphModule,
                 ctx: CompileContext, plan: Plan, *, planner: Callable[[int], Plan] | None,
                 executor: ExecutorName, devices: Sequence[str | torch.device] | None,
                 max_seq: int | None, threads_per_stage: int | Sequence[int] | None,
                 queue_depth: int) -> None:
        self.model_name = type(model).__name__
        self._model = model
        self._options = {"devices": devices, "max_seq": max_seq,
                         "threads_per_stage": threads_per_stage, "queue_depth": queue_depth}
        self._annotated, self._chunk, self.context = annotated, chunk, ctx
        self._signature: ChunkSignature = chunk.meta[CHUNK_SIGNATURE]
        self._placeholders = list(annotated.graph.find_nodes(op="placeholder"))
        self._planner = planner
        self._devices = devices
        self.max_seq = max(max_seq or plan.seq_len, plan.seq_len)
        self._executors = {"local": LocalExecutor(),
                           "threads": ThreadsExecutor(threads_per_stage, queue_depth)}
        if executor not in self._executors:
            raise SpecError(f"executor={executor!r}; use one of {sorted(self._executors)}")
        self.executor = executor
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._programs: dict[int, _Program] = {}
        self._epoch = itertools.count()
        self._filled = 0
        generation = getattr(model, "generation_config", None)
        self.eos_token_id = getattr(generation, "eos_token_id", None)
        self.pad_token_id = getattr(generation, "pad_token_id", None)
        self._captured_history = len(ctx.history)
        self._programs[plan.seq_len] = self._build(plan)
        self.plan = plan

    # -- public --------------------------------------------------------------------------------
    @property
    def stages(self) -> tuple[StageSummary, ...]:
        """The stages of the planned length's program."""
        return tuple(_summary(r) for r in self._programs[self.plan.seq_len].runners)

    @property
    def history(self) -> list[PassRecord]:
        """The graph after each pass, in order (re-plans append their partition)."""
        return self.context.history

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the pipeline; returns what the model returns.

        Raises:
            RuntimeInputError: inputs that do not match the compiled model (before any stage
                runs), or a length that cannot be re-planned.
        """
        flat, length = self.flatten_inputs(args, kwargs)
        program = self.program(length)
        full = program.runners[-1].new_outputs(length, len(self._signature.output_axes))
        call = Call(tuple(flat), program.plan.chunks, length, length, next(self._epoch), full)
        outputs = OutputAssembler(self._signature.output_axes, call)
        self._executors[self.executor].run(program.runners, call, outputs)
        self._filled = length
        leaves = outputs.leaves
        if self._signature.tail:
            device = program.runners[-1].device
            tail = self._chunk.tppc_tail.to(device)
            with torch.no_grad():
                leaves = list(tail(*(x.to(device) if isinstance(x, torch.Tensor) else x
                                     for x in flat), *leaves))
        return self.assemble(leaves)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, **kwargs: Any
                 ) -> torch.Tensor:
        """Pipelined prefill, then greedy decoding; see :func:`tppc.generate.greedy_generate`."""
        from tppc.generate import greedy_generate

        return greedy_generate(self, input_ids, max_new_tokens, **kwargs)

    def kv_cache(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Every attention's (K, V) over the tokens of the last call, in layer order.

        K and V are as the model computes them before grouped-query repetition (HF's
        ``past_key_values`` layout for Llama and GPT-2: ``(batch, kv_heads, seq, head_dim)``).
        """
        if not self._filled:
            raise RuntimeInputError("kv_cache() is empty: run a prefill (cp(input_ids)) first")
        out = []
        for attn in self._signature.attention:
            pair = []
            for which in ("key", "value"):
                buf = next(b for b in self._signature.buffers
                           if b.spec.source == attn and b.spec.kind == which)
                tensor = next(t for (name, _), t in self._buffers.items() if name == buf.name)
                pair.append(tensor.narrow(buf.spec.axis, 0, self._filled).clone())
            out.append((pair[0], pair[1]))
        return tuple(out)

    def with_plan(self, plan: Plan, *, executor: ExecutorName | None = None,
                  **options: Any) -> CompiledPipeline:
        """The same captured model emitted for another plan (no re-capture); other lengths
        are refused. ``options``: ``devices``, ``max_seq``, ``threads_per_stage``,
        ``queue_depth``."""
        history = list(self.context.history[: self._captured_history])
        ctx = dataclasses.replace(self.context, history=history)
        return CompiledPipeline(self._model, self._annotated, self._chunk, ctx, plan,
                                planner=None, executor=executor or self.executor,
                                **{**self._options, **options})

    # -- used by generate ----------------------------------------------------------------------
    def flatten_inputs(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
                       ) -> tuple[list[Any], int]:
        """Bind and flatten call inputs, check them, and return them with the sequence length.

        Raises:
            RuntimeInputError: naming the input, what it is, and what was compiled.
        """
        try:
            bound = bind_inputs(self._model, tuple(args), dict(kwargs))
        except CaptureError as exc:
            raise RuntimeInputError(str(exc)) from exc
        flat, spec = pytree.tree_flatten((bound.args, bound.kwargs))
        if self._signature.in_spec is not None and spec != self._signature.in_spec:
            raise RuntimeInputError(
                f"inputs of {self.model_name} have structure {spec}, the pipeline was compiled "
                f"for {self._signature.in_spec}. fix: pass the inputs used at compile time")
        lengths = {}
        for ph, value in zip(self._placeholders, flat):
            check_input(ph, value)
            for axis in self.context.seq_inputs.get(ph.name, ()):
                lengths[ph.name] = int(value.shape[axis])
        if len(set(lengths.values())) != 1:
            raise RuntimeInputError(f"sequence inputs disagree in length: {lengths}")
        length = next(iter(lengths.values()))
        if length > self.max_seq:
            raise RuntimeInputError(
                f"the sequence has {length} tokens, the K/V buffers hold {self.max_seq}. fix: "
                f"compile with max_seq={length} (or more)")
        return flat, length

    def program(self, length: int) -> _Program:
        """The program for ``length`` tokens (re-planned and cached, or refused)."""
        if length not in self._programs:
            if self._planner is None:
                raise RuntimeInputError(
                    f"the sequence has {length} tokens; the given plan is for "
                    f"{self.plan.seq_len}. fix: call with {self.plan.seq_len} tokens, or "
                    "compile with plan=None so that tppc re-plans per length")
            self._programs[length] = self._build(self._planner(length))
        return self._programs[length]

    def run(self, call: Call, program: _Program, executor: ExecutorName | None = None,
            sink: Sink | None = None) -> list[tuple[Any, ...]]:
        """Run ``call`` on ``program``'s stages with an executor (default: the compiled one);
        per-chunk outputs are returned, or handed to ``sink``."""
        return self._executors[executor or self.executor].run(program.runners, call, sink)

    def next_epoch(self) -> int:
        """A fresh key for positional values (see :class:`Call`)."""
        return next(self._epoch)

    def reserve(self, length: int) -> None:
        """Grow the K/V buffers to hold ``length`` tokens (keeps their contents)."""
        if length <= self.max_seq:
            return
        self.max_seq = length
        for key, old in list(self._buffers.items()):
            spec = next(b.spec for b in self._signature.buffers if b.name == key[0])
            new = self._new_buffer(spec, old.device)
            new.narrow(spec.axis, 0, old.shape[spec.axis]).copy_(old)
            self._buffers[key] = new
        for program in self._programs.values():
            for runner in program.runners:
                runner.buffers = {n: self._buffers[n, str(runner.device)]
                                  for n in runner.buffers}

    def assemble(self, leaves: list[Any]) -> Any:
        """The model's output structure from its flat outputs."""
        if self._signature.out_spec is None:
            return leaves[0] if len(leaves) == 1 else tuple(leaves)
        return pytree.tree_unflatten(leaves, self._signature.out_spec)

    def set_filled(self, length: int) -> None:
        """Record that the buffers hold ``length`` tokens (for :meth:`kv_cache`)."""
        self._filled = length

    # -- building ------------------------------------------------------------------------------
    def _build(self, plan: Plan) -> _Program:
        graph = run_passes(self._chunk, self.context, [partition_stages(plan)])
        runners = []
        for s, st in enumerate(plan.stages):
            device = device_for(st, s, self._devices)
            module = getattr(graph, f"stage_{s}").to(device)
            names = module.meta[STAGE_INFO].buffers
            buffers = {n: self._buffer(n, device) for n in names}
            runners.append(StageRunner(module, device, buffers))
        reason = self._executors[self.executor].check(runners)
        if reason is not None:
            raise SpecError(f"executor {self.executor!r} cannot run these stages: {reason}. "
                            "fix: use executor='local' or other devices")
        return _Program(plan, graph, tuple(runners))

    def _buffer(self, name: str, device: torch.device) -> torch.Tensor:
        key = (name, str(device))
        if key not in self._buffers:
            spec = next(b.spec for b in self._signature.buffers if b.name == name)
            self._buffers[key] = self._new_buffer(spec, device)
        return self._buffers[key]

    def _new_buffer(self, spec: Any, device: torch.device) -> torch.Tensor:
        shape = [self.max_seq if s is None else s for s in spec.shape]
        return torch.zeros(shape, dtype=spec.dtype, device=device)


def _summary(runner: StageRunner) -> StageSummary:
    params = dict(runner.module.named_parameters())
    module_buffers = dict(runner.module.named_buffers())
    info = runner.module.meta[STAGE_INFO]
    return StageSummary(
        index=info.index, device=runner.device, layers=info.layers, module=runner.module,
        param_count=sum(p.numel() for p in params.values()),
        param_bytes=sum(t.numel() * t.element_size()
                        for t in [*params.values(), *module_buffers.values()]),
        kv_bytes=sum(t.numel() * t.element_size() for t in runner.buffers.values()))


def compile_pipeline(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    cluster: str = "2xcpu",
    backend: Literal["torch"] = "torch",
    plan: Plan | None = None,
    executor: ExecutorName = "threads",
    chunks: int | Sequence[int] | None = None,
    devices: Sequence[str | torch.device] | None = None,
    max_seq: int | None = None,
    num_stages: int | None = None,
    granularity: int | None = None,
    threads_per_stage: int | Sequence[int] | None = None,
    queue_depth: int = 2,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
    time_limit: float = 10.0,
) -> CompiledPipeline:
    """Capture, annotate, plan (unless ``plan`` is given), emit and place a model's stages.

    Args:
        model: the model (eval mode; SDPA attention).
        args: example positional inputs (their sequence length is the planned length).
        kwargs: example keyword inputs.
        cluster: the cluster string priced by the cost model (``"2xcpu"``, ``"4xh100-sxm"``).
        backend: ``"torch"`` (the stages run as torch GraphModules).
        plan: a plan to use as is (then other lengths are refused).
        executor: ``"threads"`` (one worker per stage) or ``"local"`` (the reference).
        chunks: override the planner's split: a number of equal chunks or the boundaries.
        devices: one torch device per stage (default: ``cpu`` for CPU presets, ``cuda:i``).
        max_seq: tokens the K/V buffers hold (default: the planned length).
        num_stages: stages to plan for (default: the planner's choice).
        granularity: chunk sizes are multiples of this (default: 128 for long sequences).
        threads_per_stage: intra-op threads of each ``threads`` worker (default: unchanged).
        queue_depth: chunks that may wait between two stages.
        seq_dims: sequence axes of the inputs (see :func:`tppc.capture.capture`).
        time_limit: seconds for the planner's solver.

    Raises:
        CaptureError, AnnotationError, PassError, PlanError, SpecError: naming the problem.
    """
    if backend != "torch":
        raise SpecError(f"backend={backend!r}; this build runs backend='torch' (ONNX Runtime "
                        "stages come with tppc.export)")
    gm, ctx = capture(model, args, kwargs, seq_dims=seq_dims)
    annotated = run_passes(gm, ctx, [annotate_seq_dims_pass, group_layers_pass])
    chunk = run_passes(annotated, ctx, [chunk_attention_pass])
    planner = None
    if plan is None:
        planner = _auto_planner(annotated, ctx, cluster, chunks, num_stages, granularity,
                                time_limit)
        plan = planner(ctx.example_seq)
    return CompiledPipeline(model, annotated, chunk, ctx, plan, planner=planner,
                            executor=executor, devices=devices, max_seq=max_seq,
                            threads_per_stage=threads_per_stage, queue_depth=queue_depth)


def _auto_planner(gm: fx.GraphModule, ctx: CompileContext, cluster: str,
                  chunks: int | Sequence[int] | None, num_stages: int | None,
                  granularity: int | None, time_limit: float) -> Callable[[int], Plan]:
    from tppc.cost_models import build_cost_table
    from tppc.planner import plan_for, plan_from_costs

    def plan_length(length: int) -> Plan:
        table = build_cost_table(gm, ctx.layers, cluster, length, seq_symbol=ctx.seq_symbol,
                                 token_count=ctx.token_count)
        g = granularity or default_granularity(length)
        plan = plan_from_costs(table, granularity=g, num_stages=num_stages,
                               time_limit=time_limit)
        if chunks is None:
            return plan
        if isinstance(chunks, int):
            step = length / chunks
            bounds = tuple(round(i * step) for i in range(chunks + 1))
        else:
            bounds = tuple(chunks)
        cuts = (0, *(st.layer_end for st in plan.stages))
        return plan_for(table, cuts, bounds, granularity=1)

    return plan_length
