"""``tppc.compile``: capture, annotate, plan, emit and place a model's stages.

Terms:
    planned length: the sequence length a plan was made for. tppc re-plans every other
        length (cached per length) when it made the plan, and refuses other lengths when the
        plan was given. A length the granularity does not divide gets one shorter last chunk.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch

from tppc.errors import SpecError
from tppc.planner.plan import Plan, SolverInfo, StagePlan, Workload
from tppc.runtime.compiled import CompiledPipeline, Planner
from tppc.runtime.frontend import FrontEnd, capture_front_end
from tppc.runtime.options import CompileOptions, chunk_bounds

__all__ = ["compile_pipeline", "manual_plan"]


def compile_pipeline(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    backend: Literal["torch", "distributed"] = "torch",
    plan: Plan | None = None,
    seq_dims: Mapping[str, int | tuple[int, ...]] | None = None,
    **options: Any,
) -> CompiledPipeline:
    """Capture, annotate, plan (unless ``plan`` is given), emit and place a model's stages.

    Args:
        model: the model (eval mode; SDPA attention). It is never modified: stages hold
            their own parameter tensors (aliasing its storage on the same device).
        args: example positional inputs (their sequence length is the planned length).
        kwargs: example keyword inputs.
        backend: ``"torch"`` (the stages run as torch GraphModules in this process) or
            ``"distributed"`` (one process per stage; call on every rank of a torchrun job;
            extra keywords ``checkpoint``, ``buffers``, ``results``, ``comm_timeout``,
            ``device``: see :func:`tppc.runtime.distributed.compile_distributed`).
        plan: a plan to use as is (then other lengths are refused).
        seq_dims: sequence axes of the inputs (see :func:`tppc.capture.capture`).
        **options: the fields of :class:`tppc.runtime.options.CompileOptions` (``cluster``,
            ``executor``, ``chunks``, ``devices``, ``max_seq``, ``num_stages``,
            ``granularity``, ``threads_per_stage``, ``queue_depth``, ``time_limit``,
            ``timeout``, ``program_cache``, ``keep_states``).

    Raises:
        SpecError: a bad option (before anything is captured).
        CaptureError, AnnotationError, PassError, PlanError: naming the problem.
    """
    if backend == "distributed" or options.get("executor") == "distributed":
        from tppc.runtime.distributed import compile_distributed

        options.pop("executor", None)
        return compile_distributed(model, args, kwargs, plan=plan, seq_dims=seq_dims,
                                   **options)
    if backend != "torch":
        raise SpecError(f"backend={backend!r}; use 'torch' or 'distributed' (ONNX Runtime "
                        "stages come with tppc.export)")
    unknown = sorted(set(options) - set(CompileOptions.__dataclass_fields__))
    if unknown:
        raise SpecError(f"unknown compile option(s) {unknown}; the options are "
                        f"{sorted(CompileOptions.__dataclass_fields__)}")
    opts = CompileOptions.from_kwargs(**options)
    front = capture_front_end(model, args, kwargs, seq_dims=seq_dims,
                              keep_states=opts.keep_states)
    planner = None
    if plan is None:
        planner = _auto_planner(opts)
        plan = planner(front, front.ctx.example_seq)
    return CompiledPipeline(model, front, plan, planner=planner, options=opts,
                            seq_dims=seq_dims)


def _auto_planner(opts: CompileOptions) -> Planner:
    from tppc.cost_models import build_cost_table
    from tppc.planner.grid import plan_any_length

    def plan_length(front: FrontEnd, length: int, workload: Workload | None = None) -> Plan:
        """The plan of ``length``; a diffusion ``workload`` plans patches (``denoise``)."""

        def table_at(tokens: int) -> Any:
            return build_cost_table(front.chunk, front.ctx.layers, opts.cluster, tokens,
                                    seq_symbol=front.ctx.seq_symbol,
                                    token_count=front.ctx.token_count)

        bounds = None
        diffusion = workload is not None and workload.kind == "diffusion"
        if opts.chunks is not None:
            bounds = chunk_bounds(opts.chunks, length)
        elif front.bidirectional and not diffusion:
            bounds = (0, length)
        per = front.ctx.tokens_per_unit()
        if per > 1:  # a DiT: priced in tokens on a grid of whole patch rows, returned in rows
            g = per * (opts.granularity or 1)
            plan = plan_any_length(table_at, length * per, granularity=g,
                                   num_stages=opts.num_stages, time_limit=opts.time_limit,
                                   workload=workload,
                                   bounds=None if bounds is None else tuple(b * per
                                                                           for b in bounds))
            return dataclasses.replace(plan, seq_len=length, granularity=g // per,
                                       boundaries=tuple(b // per for b in plan.boundaries))
        return plan_any_length(table_at, length, granularity=opts.granularity,
                               num_stages=opts.num_stages, time_limit=opts.time_limit,
                               workload=workload, bounds=bounds)

    return plan_length


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
