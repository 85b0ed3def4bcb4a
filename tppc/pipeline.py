"""Compatibility names: the compile driver and the pipeline live in :mod:`tppc.runtime`."""

from __future__ import annotations

from tppc.runtime.compile import compile_pipeline, manual_plan
from tppc.runtime.compiled import CompiledPipeline, StageSummary
from tppc.runtime.options import CompileOptions, ExecutorName

__all__ = ["CompileOptions", "CompiledPipeline", "ExecutorName", "StageSummary",
           "compile_pipeline", "manual_plan"]
