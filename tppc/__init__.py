"""tppc: a token-level pipeline parallelism compiler for PyTorch transformers.

``tppc.capture`` traces a model with a symbolic sequence length, ``tppc.annotate`` finds the
token axis and role of every value and groups the layers; see DESIGN.md for the rest.
"""

from __future__ import annotations

from tppc.analysis import annotate
from tppc.capture import capture
from tppc.context import CompileContext, PassRecord
from tppc.errors import (
    AnnotationError,
    CaptureError,
    CostModelError,
    PassError,
    PlanError,
    PlanInfeasible,
    RuntimeInputError,
    SpecError,
    TppcError,
)
from tppc.inspect import layer_table

__all__ = [
    "AnnotationError",
    "CaptureError",
    "CompileContext",
    "CostModelError",
    "PassError",
    "PassRecord",
    "PlanError",
    "PlanInfeasible",
    "RuntimeInputError",
    "SpecError",
    "TppcError",
    "annotate",
    "capture",
    "layer_table",
]

__version__ = "0.1.0"
