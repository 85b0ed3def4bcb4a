"""Compiler passes: each ``(gm, ctx) -> gm`` either annotates or transforms, never both.

annotate_seq_dims   token axis and role of every node (``meta["tppc.token"]``)
group_layers        ordered layers: prologue, blocks, epilogue (``meta["tppc.layer"]``)
chunk_attention     the chunk-step graph with full-length K/V buffers
partition_stages    one GraphModule per pipeline stage
runner              ``run_passes``: timing, lint, named errors, ``TPPC_DEBUG``
"""

from __future__ import annotations

__all__: list[str] = []
