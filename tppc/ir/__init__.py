"""The IR: node-meta keys and their frozen records, the compile context, and ``torch.ops.tppc``.

``records`` holds the ``tppc.*`` meta keys and the records stored under them (and re-exports
those of ``chunk_records``, the chunk-step and stage graphs, and ``mesh_records``, shards and
ring attention); ``context`` the per-compile state passes read and write
(:class:`CompileContext`); ``ops`` registers the custom ops the chunked graphs call (import
it before running such a graph).
"""

from __future__ import annotations

__all__: list[str] = []
