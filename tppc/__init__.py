"""tppc: a token-level pipeline parallelism compiler for PyTorch transformers.

``capture`` traces a model with a symbolic sequence length; ``annotate`` finds the token axis
and role of every value and groups the layers; ``cost_report`` prices each layer on a
device; ``plan`` chooses the chunk boundaries and the stage placement on a ``Cluster``;
``compile`` does all of that and returns a :class:`CompiledPipeline` that runs the stages
concurrently and returns what the model returns. ``export`` writes a compiled pipeline as
portable files; ``load`` runs them on ONNX Runtime (and imports no torch: on a machine
without torch, ``import tppc`` offers ``load`` and the errors only).
"""

from __future__ import annotations

from tppc.errors import (
    AnnotationError,
    CaptureError,
    CostModelError,
    PassError,
    PlanError,
    PlanInfeasible,
    RuntimeInputError,
    SpecError,
    StageFailed,
    StageTimeout,
    TppcError,
)
from tppc.export_runtime import load

try:  # a serving machine may have no torch: tppc.load needs numpy and onnxruntime only
    import torch as _torch
except ImportError:
    _torch = None

if _torch is not None:
    from tppc.analysis import annotate
    from tppc.capture import capture
    from tppc.context import CompileContext, PassRecord
    from tppc.cost_models import Cluster, CostTable, DeviceSpec, LinkSpec, calibrate
    from tppc.costing import cost_report
    from tppc.export import export
    from tppc.inspect import layer_table
    from tppc.launch import LaunchResult, launch
    from tppc.planner import Plan, Workload, plan_from_costs, split_tokens
    from tppc.planning import plan
    from tppc.program import Program
    from tppc.runtime.compile import compile_pipeline as compile
    from tppc.runtime.compile import manual_plan
    from tppc.runtime.compiled import CompiledPipeline, StageSummary
    from tppc.runtime.options import CompileOptions
    from tppc.trace import plan_trace

__all__ = [
    "AnnotationError",
    "CaptureError",
    "Cluster",
    "CompileContext",
    "CompileOptions",
    "CompiledPipeline",
    "CostModelError",
    "CostTable",
    "DeviceSpec",
    "LaunchResult",
    "LinkSpec",
    "PassError",
    "PassRecord",
    "Plan",
    "PlanError",
    "PlanInfeasible",
    "Program",
    "RuntimeInputError",
    "SpecError",
    "StageFailed",
    "StageSummary",
    "StageTimeout",
    "TppcError",
    "Workload",
    "annotate",
    "calibrate",
    "capture",
    "compile",
    "cost_report",
    "export",
    "launch",
    "layer_table",
    "load",
    "manual_plan",
    "plan",
    "plan_from_costs",
    "plan_trace",
    "split_tokens",
]

__version__ = "0.1.0"
