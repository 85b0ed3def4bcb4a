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

from tppc.artifact.core.load import load
from tppc.errors import (
    ActivationMaskError,
    AnnotationError,
    ArtifactError,
    CaptureError,
    CostModelError,
    ExportError,
    PassError,
    PlanError,
    PlanInfeasible,
    RuntimeInputError,
    ScheduleError,
    SoundnessError,
    SpecError,
    StageFailed,
    StageTimeout,
    TppcError,
)
from tppc.version import __version__ as __version__

try:  # a serving machine may have no torch: tppc.load needs numpy and onnxruntime only
    import torch as _torch
except ImportError:
    _torch = None

if _torch is not None:
    from tppc.artifact.writer.write import export
    from tppc.cost_models import Cluster, CostTable, DeviceSpec, LinkSpec, calibrate
    from tppc.dispatch.compile import compile_pipeline as compile
    from tppc.driver.costing import cost_report
    from tppc.driver.options import CompileOptions
    from tppc.driver.planning import plan
    from tppc.frontend.annotate import annotate
    from tppc.frontend.capture import capture
    from tppc.ir.context import CompileContext, PassRecord
    from tppc.pipeline.compiled import CompiledPipeline, StageSummary
    from tppc.planner import Plan, Workload, plan_from_costs, split_tokens
    from tppc.planner.manual import manual_plan
    from tppc.processes.launch import LaunchResult, launch
    from tppc.program.program import Program
    from tppc.report.layers import layer_table
    from tppc.report.timeline import draw_timeline as plan_timeline
    from tppc.report.trace import plan_trace

__all__ = [
    "ActivationMaskError",
    "AnnotationError",
    "ArtifactError",
    "CaptureError",
    "Cluster",
    "CompileContext",
    "CompileOptions",
    "CompiledPipeline",
    "CostModelError",
    "CostTable",
    "DeviceSpec",
    "ExportError",
    "LaunchResult",
    "LinkSpec",
    "PassError",
    "PassRecord",
    "Plan",
    "PlanError",
    "PlanInfeasible",
    "Program",
    "RuntimeInputError",
    "ScheduleError",
    "SoundnessError",
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
    "plan_timeline",
    "plan_trace",
    "split_tokens",
]

