"""The in-process pipeline: ``CompiledPipeline``, one thread per stage in this process.

``compiled`` ``CompiledPipeline`` (the programs it is given, per-call states, calls);
``drop_in`` what it answers as its model (``__class__``, attributes, ``to``: ``conversions``);
``captures`` a capture per batch shape and the binding of a call's inputs; ``programs``
the programs it holds, one per (capture, length), and their emitter; ``generate``
pipelined prefill + greedy decoding (the loop: ``tppc.generation``); ``profile`` predicted
against measured; ``rebalance`` measuring the stages, refitting the rates, swapping the program.
"""

from __future__ import annotations

__all__: list[str] = []
