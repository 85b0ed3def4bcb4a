"""PipeFusion inside an unchanged diffusers pipeline (issue 21).

transformer    ``PipeFusionTransformer``: what a pipeline reads of ``pipe.transformer``
               (``config``, ``dtype``, ``device``, ``forward(..., return_dict)``,
               ``cache_context``), compiled on its first call; ``compile_pipeline(pipe)``
               sets it as ``pipe.transformer`` and starts a new loop at every pipeline call
pipeline_plan  ``plan_pipeline(pipe, ...)``: the transformer's plan plus the text encoders and
               the VAE decoder captured, priced and placed on a device (a whole call)
"""

from __future__ import annotations

from tppc.diffusers.pipeline_plan import ComponentPlan, PipelinePlan, plan_pipeline
from tppc.diffusers.transformer import PipeFusionTransformer, compile_pipeline

__all__ = ["ComponentPlan", "PipeFusionTransformer", "PipelinePlan", "compile_pipeline",
           "plan_pipeline"]
