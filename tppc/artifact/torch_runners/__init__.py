"""Runners of a written artifact that need torch.

distributed     one process per stage over torch.distributed (``tppc.launch``, the rank entry)
denoise         PipeFusion denoising through the ORT stages with diffusers' (torch)
                schedulers: ``LoadedPipeline.denoise``

Read :mod:`tppc.artifact.core`.
"""

from __future__ import annotations

__all__: list[str] = []
