"""Compiler passes: each ``(gm, ctx) -> gm`` either annotates or transforms, never both.

annotate_seq_dims   token axis and role of every node (``meta["tppc.token"]``)
group_layers        ordered layers: prologue, blocks, epilogue (``meta["tppc.layer"]``)
chunk_attention     the chunk-step graph with full-length K/V buffers
partition_stages    one GraphModule per pipeline stage
direct_output       the last stage writes its per-token outputs in place (emit step)
hoist_consts        a stage's const sub-graphs as programs run once per input (emit step)
runner              ``run_passes``: timing, lint, named errors, ``TPPC_DEBUG``
subgraph            THE fx subgraph copier every pass that slices a graph uses
chunk_parts         chunk_attention's queries (K/V source, head repeat), tail and positional
                    programs; the cost model reads its K/V queries

Op rules (which ops are attention, reductions, views...) live in :mod:`tppc.ir.op_rules`,
shared with the cost model. Modules with a leading underscore are helpers of the passes.
"""

from __future__ import annotations

__all__: list[str] = []
