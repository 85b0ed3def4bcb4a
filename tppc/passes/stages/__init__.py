"""Stage transforms: a chunk-step graph cut into stages and each stage's graph rewritten.

partition_stages    one GraphModule per pipeline stage, given the cuts (not a plan)
direct_output       the last stage writes its per-token outputs in place (emit step)
hoist_consts        a stage's const sub-graphs as programs run once per input (emit step)

Reads only the passes' shared modules (runner, subgraph, shapes).
"""

from __future__ import annotations

__all__: list[str] = []
