"""Compiler passes: each ``(gm, ctx) -> gm`` either annotates or transforms, never both.

One sub-package per concern, each pass in its own module beside the helpers only it reads:

annotation/         what the captured graph is: ``annotate_seq_dims`` (token axis and role of
                    every node, ``meta["tppc.token"]``), ``group_layers`` (prologue, blocks,
                    epilogue, ``meta["tppc.layer"]``); helpers: attention kinds, masks, key
                    masks, positional evaluation, row-wise regions, segments, buffered
                    mixing, waists
chunking/           ``chunk_attention``: the chunk-step graph with full-length K/V buffers
                    (``chunk_buffers``, ``chunk_parts``: its buffers, K/V queries and programs;
                    the cost model reads the queries); helpers: token, bias, frame and
                    context rows
stages/             stage transforms: ``partition_stages`` (one GraphModule per stage),
                    ``direct_output`` (the last stage writes per-token outputs in place),
                    ``hoist_consts`` (const sub-graphs run once per input)

and, shared by all three:

runner              ``run_passes``: timing, lint, named errors, ``TPPC_DEBUG``
subgraph            THE fx subgraph copier every pass that slices a graph uses
shapes              symbolic shapes, module paths, op dimensions

Chunking reads annotation's helpers (segments, key masks, buffered mixing); annotation never
reads chunking, and the stage transforms read neither (tests/unit/test_import_layers.py).
Op rules (which ops are attention, reductions, views...) live in :mod:`tppc.ir.op_rules`,
shared with the cost model.
"""

from __future__ import annotations

__all__: list[str] = []
