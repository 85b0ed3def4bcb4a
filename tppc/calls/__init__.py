"""The call core: one call of a compiled pipeline, in one process or on one rank of a job.

``call`` THE call algorithm (bind, program, state, run, release, epilogue, assemble) and the
in-process delivery; ``states`` a pipeline's call states (a pool per capture, the
last call's); ``io`` output assembly; ``kv_cache`` reading the K/V of the last call;
``kv_memory`` whether a generation fits in the K/V buffers.
"""

from __future__ import annotations

__all__: list[str] = []
