"""The hybrid configurations a cluster and a model allow: tensor-parallel groups per stage.

Terms:
    shard sizes: the sizes every tensor-parallel degree must divide (head counts, the
        segments of cut axes: ``gm.meta[SHARD_SIZES]``); a model without them (nothing
        sharded) allows degree 1 only.
    node kind: nodes with the same chain of devices; every node of a kind gets the same
        degree (degrees differ per stage only where node kinds differ: a heterogeneous
        cluster).
    configuration: a degree per node; each node is cut into ``size / t`` groups of ``t``
        consecutive devices; the groups, in chain order, are the "devices" the placement
        planner chooses stages from (a stage = a group). A degree larger than a node
        (a multiple of it) makes groups of whole nodes: they span the inter-node link and are
        searched only when no configuration inside nodes fits, or when asked for.
    fixed degrees: ``tensor_parallel=t`` gives every stage ``t`` devices; a tuple gives stage
        ``i`` its own ``t_i``: groups are packed in chain order, a group that would cross a
        node boundary starting at the next node instead.
    intra-op configuration: on a cluster of CPU devices only (they share this machine),
        groups of ``k`` consecutive devices each run by ONE worker with ``k`` intra-op
        threads (torch splits every op; no shards, no collectives): ``intra_op=k``, tensor
        degree 1, priced on a calibration measured with ``k`` threads
        (:func:`intra_op_configurations`).

Example:
    >>> from tppc.cost_models.cluster import Cluster
    >>> [c.label for c in tp_configurations(Cluster.parse("2xcpu"), (4, 4))]
    ['TP1', 'TP2']
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from tppc.cost_models.cluster import Cluster
from tppc.errors import PlanError

__all__ = ["Configuration", "check_degree", "fixed_configuration", "intra_op_configurations",
           "tp_configurations"]


@dataclass(frozen=True)
class Configuration:
    """One point of the hybrid space (module docstring).

    Attributes:
        groups: device indices of each group, in chain order.
        spans_nodes: some group crosses the inter-node link.
        fixed_stages: the stage count the degrees fix (a tuple of degrees: its length).
        one_patch: its plans keep one patch a step (a ring with stale PipeFusion steps runs
            its ring form only then, the gather form with more: priced apart,
            :func:`tppc.driver.mesh_planning.mesh_plan`).
        intra_op: devices per worker whose cores it runs as intra-op threads (module
            docstring; 1: one device a worker).
    """

    groups: tuple[tuple[int, ...], ...]
    spans_nodes: bool = False
    fixed_stages: int | None = None
    cfg_parallel: int = 1
    ulysses: int = 1
    ring: int = 1
    placement: str = ""
    one_patch: bool = False
    intra_op: int = 1

    @property
    def token_workers(self) -> int:
        """Workers of a group that share a chunk's batch × tokens (``cfg · ulysses · ring``;
        1 for tensor parallelism alone); each group's tensor-parallel degree is its size
        over this."""
        return self.cfg_parallel * self.ulysses * self.ring

    @property
    def degrees(self) -> tuple[int, ...]:
        """The tensor-parallel degree of each group."""
        return tuple(len(g) // (self.token_workers * self.intra_op) for g in self.groups)

    @property
    def label(self) -> str:
        """``"TP8"`` (one degree), ``"TP(8,4)"`` (degrees that differ between groups), or
        with sequence / CFG parallelism ``"CFG2 x Ulysses2 x TP1"`` (and the placement), or
        ``"IntraOp2"`` (one worker of 2 intra-op threads a group; on a mesh ``"CFG2 x
        IntraOp2"``: each worker of the mesh one of 2 threads)."""
        kinds = list(dict.fromkeys(self.degrees))
        tp = f"TP{kinds[0]}" if len(kinds) == 1 else "TP(" + ",".join(map(str, kinds)) + ")"
        if self.intra_op > 1:
            tp = f"IntraOp{self.intra_op}"
        elif self.token_workers == 1:
            return tp
        return " x ".join([*self._axes(), tp]) + (f" [{self.placement}]" if self.placement
                                                  else "") \
            + (" (one patch)" if self.one_patch else "")

    def _axes(self) -> list[str]:
        return [f"{name}{d}" for name, d in (("CFG", self.cfg_parallel), ("Ring", self.ring),
                                             ("Ulysses", self.ulysses)) if d > 1]


def _divides(t: int, sizes: Sequence[int]) -> bool:
    """``t`` cuts every size (nothing to cut: only ``t = 1``)."""
    return t == 1 or (bool(sizes) and all(s % t == 0 for s in sizes))


def check_degree(t: int, sizes: Sequence[int]) -> None:
    """Refuse a degree the model cannot be cut into (named sizes, the degrees that work).

    Raises:
        PlanError: ``t`` does not divide every shard size.
    """
    if t == 1 or _divides(t, sizes):
        return
    if not sizes:
        raise PlanError(f"tensor_parallel={t}: nothing in this model was sharded (no "
                        "column/row pairs found: see the sharding pass's refusals). fix: "
                        "tensor_parallel=1, or leave it to the planner")
    bad = sorted({s for s in sizes if s % t})
    good = [d for d in range(1, max(sizes) + 1) if _divides(d, sizes)]
    raise PlanError(f"tensor_parallel={t} does not divide the model's shard sizes {bad} (head "
                    f"counts, cut axes), so a shard cannot hold a whole head. fix: one of "
                    f"{good}")


def _node_groups(devices: Sequence[int], t: int) -> list[tuple[int, ...]]:
    return [tuple(devices[i:i + t]) for i in range(0, len(devices), t)]


def tp_configurations(cluster: Cluster, sizes: Sequence[int], *, across_nodes: bool = False
                      ) -> list[Configuration]:
    """Every configuration of one degree per node kind (inside nodes), or with
    ``across_nodes`` the degrees that are whole multiples of a (homogeneous) node size."""
    nodes = [cluster.node_devices(n) for n in range(cluster.num_nodes)]
    if across_nodes:
        size = len(nodes[0])
        if any(len(n) != size for n in nodes) or len(set(cluster.device_names)) != 1:
            return []
        out = []
        for k in range(2, len(nodes) + 1):
            t = k * size
            if len(nodes) % k == 0 and _divides(t, sizes):
                flat = [d for n in nodes for d in n]
                out.append(Configuration(tuple(_node_groups(flat, t)), spans_nodes=True))
        return out
    kinds = list(dict.fromkeys(tuple(cluster.device_names[d] for d in n) for n in nodes))
    options = [[t for t in range(1, len(kind) + 1) if len(kind) % t == 0 and _divides(t, sizes)]
               for kind in kinds]
    out = []
    for choice in itertools.product(*options):
        by_kind = dict(zip(kinds, choice, strict=True))
        groups = [g for n in nodes
                  for g in _node_groups(n, by_kind[tuple(cluster.device_names[d] for d in n)])]
        out.append(Configuration(tuple(groups)))
    return out


def fixed_configuration(cluster: Cluster, sizes: Sequence[int], tensor_parallel: int |
                        tuple[int, ...], num_stages: int | None) -> Configuration:
    """The configuration the user's degrees fix (module docstring).

    Raises:
        PlanError: a degree that does not divide the shard sizes, more devices than the
            cluster has, or a tuple whose length is not ``num_stages``.
    """
    per_stage = isinstance(tensor_parallel, tuple)
    degrees = tensor_parallel if per_stage else (tensor_parallel,)
    for t in dict.fromkeys(degrees):
        check_degree(t, sizes)
    if per_stage and num_stages is not None and num_stages != len(degrees):
        raise PlanError(f"tensor_parallel={tensor_parallel} gives {len(degrees)} stages, "
                        f"num_stages={num_stages}. fix: one degree per stage, or an int")
    n = cluster.num_devices
    wanted = degrees if per_stage else (degrees[0],) * (n // degrees[0])
    if not wanted or sum(degrees if per_stage else wanted) > n or (
            num_stages is not None and not per_stage and num_stages * degrees[0] > n):
        need = sum(degrees) if per_stage else degrees[0] * (num_stages or 1)
        raise PlanError(f"tensor_parallel={tensor_parallel} (num_stages={num_stages}) needs "
                        f"{need} devices, the cluster {str(cluster)!r} has {n}. fix: smaller "
                        "degrees or fewer stages")
    groups, at, spans = [], 0, False
    for t in wanted:
        if at + t > n:
            break
        node = cluster.nodes[at]
        inside = cluster.nodes[at + t - 1] == node
        if not inside and t <= len(cluster.node_devices(node)):
            nxt = next((d for d in range(at, n) if cluster.nodes[d] != node), n)
            if nxt + t <= n and cluster.nodes[nxt + t - 1] == cluster.nodes[nxt]:
                at, inside = nxt, True
        spans = spans or not inside
        groups.append(tuple(range(at, at + t)))
        at += t
    if per_stage and len(groups) < len(degrees):
        raise PlanError(f"tensor_parallel={tensor_parallel}: the groups do not fit the nodes "
                        f"of {str(cluster)!r} in chain order. fix: order the degrees so that "
                        "each group fits in a node, or use fewer devices")
    return Configuration(tuple(groups), spans_nodes=spans,
                         fixed_stages=len(degrees) if per_stage else None)


def intra_op_configurations(cluster: Cluster, fixed: int | None = None) -> list[Configuration]:
    """The intra-op configurations of ``cluster`` (module docstring): one per ``k > 1`` that
    divides its device count (``fixed``: that ``k`` alone); none unless every device is a
    ``cpu`` (GPUs and mixed chains: torch's intra-op threads are a CPU's).

    Raises:
        PlanError: ``fixed`` on a cluster with a non-CPU device, or a ``k`` that does not
            divide its devices.
    """
    n = cluster.num_devices
    if any(name != "cpu" for name in cluster.device_names):
        if fixed is not None and fixed > 1:
            raise PlanError(f"intra_op={fixed}: the cluster {str(cluster)!r} has non-CPU "
                            f"devices ({sorted(set(cluster.device_names) - {'cpu'})}); "
                            "intra-op workers run on the cores of CPU devices of one "
                            "machine. fix: intra_op=1 (or None), or a cluster such as '2xcpu'")
        return []
    if fixed is not None:
        if fixed > 1 and n % fixed:
            raise PlanError(f"intra_op={fixed} does not divide the {n} CPU devices of "
                            f"{str(cluster)!r}. fix: one of "
                            f"{[k for k in range(2, n + 1) if n % k == 0] or [1]}")
        ks = [fixed] if fixed > 1 else []
    else:
        ks = [k for k in range(2, n + 1) if n % k == 0]
    return [Configuration(tuple(_node_groups(list(range(n)), k)), intra_op=k) for k in ks]
