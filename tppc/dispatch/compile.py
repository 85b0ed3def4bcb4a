"""``tppc.compile``: capture, annotate, plan, emit and place a model's stages.

Terms:
    planned length: the sequence length a plan was made for. tppc re-plans every other
        length (cached per length) when it made the plan, and refuses other lengths when the
        plan was given. A length the granularity does not divide gets one shorter last chunk.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch

from tppc.driver.emit import Emitter
from tppc.driver.options import CompileOptions
from tppc.driver.planning import example_plan
from tppc.errors import SpecError
from tppc.frontend.front_end import capture_front_end
from tppc.pipeline.compiled import CompiledPipeline
from tppc.planner.plan import Plan
from tppc.validation.validate import validate_pipeline

__all__ = ["compile_pipeline"]


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
            ``device``: see :func:`tppc.distributed.pipeline.compile_distributed`).
        plan: a plan to use as is (then other lengths are refused); its lengths are in units
            of the sequence axis (:attr:`tppc.planner.plan.Plan.unit`).
        seq_dims: sequence axes of the inputs (see :func:`tppc.frontend.capture.capture`).
        **options: the fields of :class:`tppc.driver.options.CompileOptions` (``cluster``,
            ``executor``, ``chunks``, ``devices``, ``max_seq``, ``num_stages``,
            ``tensor_parallel``, ``cfg_parallel``, ``ulysses``, ``ring``, ``patches``,
            ``memory_limit``, ``objective``, ``granularity``, ``threads_per_stage``,
            ``queue_depth``, ``time_limit``, ``timeout``, ``program_cache``, ``keep_states``,
            ``verify``, ``verbose``).

    The plan is the one ``tppc.plan`` gives for the same inputs and options
    (:mod:`tppc.driver.planning`).

    Raises:
        SpecError: a bad option (before anything is captured).
        CaptureError, AnnotationError, PassError, PlanError: naming the problem.
        SoundnessError: the emitted program differs from the captured graph on the example
            or on a probe length (see :mod:`tppc.validation.validate`; ``verify=False`` skips it).
    """
    if backend == "distributed" or options.get("executor") == "distributed":
        from tppc.distributed.pipeline import compile_distributed

        options.pop("executor", None)
        return compile_distributed(model, args, kwargs, plan=plan, seq_dims=seq_dims,
                                   **options)
    if backend != "torch":
        raise SpecError(f"backend={backend!r}; use 'torch' or 'distributed' (ONNX Runtime "
                        "stages come with tppc.export)")
    opts = CompileOptions.from_kwargs(**options)
    front = capture_front_end(model, args, kwargs, seq_dims=seq_dims)
    plan, planner = example_plan(front, opts, plan)
    emitter = Emitter(opts, planner, None if planner is not None else plan)
    emitter.check(front, plan)
    cp = CompiledPipeline(model, front, emitter.emit(front, plan), emitter, seq_dims=seq_dims)
    cp.example = (tuple(args), dict(kwargs or {}))
    if opts.verify:  # translation validation: SoundnessError names the first diverging node
        cp.validation = validate_pipeline(cp, model, args, kwargs)
    return cp
