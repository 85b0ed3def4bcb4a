"""The in-process pipeline: ``CompiledPipeline``, one thread per stage in this process.

``compiled`` ``CompiledPipeline`` (program cache, per-call states, calls); ``generate``
pipelined prefill + greedy decoding (the loop: ``tppc.generation``); ``profile`` predicted
against measured; ``rebalance`` measuring the stages, refitting the rates, swapping the program.
"""

from __future__ import annotations

__all__: list[str] = []
