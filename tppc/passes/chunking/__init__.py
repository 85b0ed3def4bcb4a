"""Chunking: the annotated graph rewritten into a chunk-step graph with full-length buffers.

chunk_attention     the pass (``chunk_attention_pass``, ``ChunkSignature``, ``REST_CHUNK``)
chunk_buffers       full-length buffers and the reads that follow them
chunk_parts         the K/V value behind SDPA, the positional program, the tail (the cost
                    model reads its K/V queries)
token_rows          rows per unit, prefixes, patches (diffusion transformers)
bias_rows           the rows of a float attention bias for one chunk
frame_rows          a chunk of patch rows in every frame (video latents)
context_rows        context segments on either side of the split tokens

Reads :mod:`tppc.passes.annotation`'s helpers; nothing there reads this package.
"""

from __future__ import annotations

__all__: list[str] = []
