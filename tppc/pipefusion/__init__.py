"""PipeFusion denoising: the patches of consecutive diffusion steps flow through the stages.

``denoise`` ``cp.denoise`` (patch programs, warm-up, the step loop); ``jobs`` the patches of
pipelined steps through the stages, in threads or serially; ``step`` one step at a time, for a
pipeline's own loop (``StepCalls``); ``check`` the first call's check of the patch program
against the warm-up program; ``quality`` the PSNR target; ``schedulers`` which diffusers
schedulers act element-wise, one copy per patch.
"""

from __future__ import annotations

__all__: list[str] = []
