"""Records of graphs cut over a mesh of workers: tensor-parallel shards and ring attention.

Terms:
    tensor-parallel group: ``t`` workers that each run ``1/t`` of a stage's cut nodes
        (:class:`ShardRole` under :data:`SHARD`).
    ring group: workers that each hold ``1/r`` of the tokens and pass K/V blocks around
        (:class:`RingForm` under :data:`RING_FORM`).

Every key and record here is also importable from :mod:`tppc.ir.records`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["RING_FORM", "SHARD", "SHARD_SIZES", "RingForm", "ShardRole"]

SHARD = "tppc.shard"
"""Key of a node's :class:`ShardRole` (``annotate_shards``: how it runs under tensor
parallelism, for every degree the sizes in :data:`SHARD_SIZES` allow)."""

SHARD_SIZES = "tppc.shard_sizes"
"""``GraphModule.meta`` key: the sizes a tensor-parallel degree must divide (head counts,
the segments of sharded axes); a degree that divides all of them shards every
``column``/``row`` node of the graph."""


@dataclass(frozen=True)
class ShardRole:
    """How a node runs on ``t`` workers of a tensor-parallel group.

    Attributes:
        kind: ``replicated`` (every worker computes all of it), ``sharded`` (every worker
            computes its part: ``1/t`` of the work; its value is cut on ``axis``),
            ``column`` (a linear whose weight rows are cut: output sharded on its last axis),
            ``row`` (a linear whose weight columns are cut: its output is a partial sum,
            all-reduced right after it; a bias is added once, after the sum), ``gather``
            (a sharded value gathered whole on ``axis`` before a replicated use).
        axis: the cut axis of the node's value (``sharded``/``column``/``gather``).
        segments: that axis's segments (sizes); each is cut into ``t`` equal parts and
            worker ``r`` holds part ``r`` of every segment (a fused QKV: three).
        collective: the group's collective after the node: ``all_reduce`` (``row``),
            ``all_gather`` (``gather``), else ``""``.
    """

    kind: Literal["replicated", "sharded", "column", "row", "gather"]
    axis: int | None = None
    segments: tuple[int, ...] = ()
    collective: str = ""


RING_FORM = "tppc.ring_form"
"""Key of a self-attention's :class:`RingForm` in a worker graph cut by a ring
(:mod:`tppc.passes.meshcut.ring_form`)."""


@dataclass(frozen=True)
class RingForm:
    """How a worker runs an attention over a ring group.

    Attributes:
        form: ``ring`` (its own K/V block, the blocks passed around the group, partials
            merged by their log-sum-exps) or ``gather`` (the chunk's K/V gathered whole).
        reason: why the gather form (empty for ``ring``).
    """

    form: Literal["ring", "gather"]
    reason: str = ""
