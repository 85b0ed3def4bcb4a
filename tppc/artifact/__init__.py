"""The artifact: a compiled pipeline written as files, verified and run without torch, or run
by runners that need torch.

writer/         ``tppc.export``: stage graphs, the ONNX translation, the model signature, the
                check of the written artifact against the compiled pipeline (torch)
core/           ``tppc.load``: verify, check, load, run through ONNX Runtime; imports no torch
torch_runners/  the runners that need torch: one process per stage over torch.distributed
                (``distributed``), PipeFusion denoising with diffusers' schedulers
                (``denoise``, reached from ``LoadedPipeline.denoise`` only when called)

The writer and the runners read the core; the core reads neither (but for that one call).
"""

from __future__ import annotations

__all__: list[str] = []
