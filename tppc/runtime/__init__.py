"""The runtime of a compiled pipeline.

compile     ``tppc.compile``: the compile driver and ``manual_plan``
options     ``CompileOptions``: every option, validated up front
frontend    captures per batch shape; binding and checking call inputs
compiled    ``CompiledPipeline``: program cache, per-call states, calls
state       ``Call``, ``CallState`` (K/V buffers, positional values), ``StatePool``
generate    pipelined prefill + greedy decoding
io          input checks and output assembly
"""

from __future__ import annotations

__all__: list[str] = []
