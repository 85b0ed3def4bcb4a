"""Tensor parallelism: the analysis (``annotate_shards``: which linears are cut by columns or
rows, written into node meta), the rewrite of a stage graph into one worker's shard
(``shard_graph``) and its parts between collectives (``split_parts``).

Reads the annotation's records only (``tppc.ir.records``); read by the emitter.
"""

from __future__ import annotations

__all__: list[str] = []
