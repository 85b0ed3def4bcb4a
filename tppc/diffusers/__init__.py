"""PipeFusion inside an unchanged diffusers pipeline (issue 21).

transformer    ``PipeFusionTransformer``: what a pipeline reads of ``pipe.transformer``
               (``config``, ``dtype``, ``device``, ``forward(..., return_dict)``,
               ``cache_context``), compiled on its first call; ``compile_pipeline(pipe)``
               sets it as ``pipe.transformer`` and starts a new loop at every pipeline call
"""

from __future__ import annotations

from tppc.diffusers.transformer import PipeFusionTransformer, compile_pipeline

__all__ = ["PipeFusionTransformer", "compile_pipeline"]
