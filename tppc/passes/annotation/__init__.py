"""Annotation passes: what the captured graph is, written into node meta, nothing rewritten.

annotate_seq_dims   token axis and role of every node (``meta["tppc.token"]``)
token_order         whether an op keeps every token's row, in order (its shape rules)
group_layers        ordered layers: prologue, blocks, epilogue (``meta["tppc.layer"]``)
attention           causal or bidirectional attention, and the mask tppc rebuilds
masks               windows and padding masks, classified at probe lengths
key_masks           masks over the keys read from context inputs (a prompt's padding)
positional          a positional value evaluated at a concrete length
regions             modules that regroup tokens inside but are row-wise as a whole (MoE)
segments            constant-length context (text tokens) beside the split tokens
buffered_mixing     non-causal ops whose rows read every row (linear attention, convolutions)
waist               sub-layers of a block: where a stage boundary may fall inside it

Read by :mod:`tppc.passes.chunking` (segments, key masks, buffered mixing); reads no other
sub-package of the passes.
"""

from __future__ import annotations

__all__: list[str] = []
