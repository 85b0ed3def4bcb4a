"""What a collective costs on a cluster: latency + bytes / bandwidth, per algorithm.

Terms:
    group: the device indices (into ``Cluster.devices``) that take part, ``n`` of them.
    B: the bytes of the collective, counted as nccl-tests counts them: the buffer an
        all-reduce reduces; the gathered output of an all-gather; the input of a
        reduce-scatter (each member keeps B/n); each member's send buffer of an all-to-all
        (B/n to each peer); each member's block of a ring shift (it sends B to the next
        member while it receives B from the previous).
    bottleneck: the group's slowest link, ``bw`` (bytes/s, one direction) and ``α`` (its
        latency, s): a ring or tree step waits for its slowest hop, and every step of a flat
        algorithm over a group that spans nodes crosses the inter-node link somewhere.
        ``α`` is the link's message latency (:class:`.specs.LinkSpec`), charged per step.

Formulas (the α-β model of R. Thakur, R. Rabenseifner, W. Gropp, *Optimization of
Collective Communication Operations in MPICH*, IJHPCA 19(1), 2005, §3-4; the step counts
``2(n-1)`` and ``n-1`` are NCCL's own, ``src/graph/tuning.cc``, and the ``(n-1)/n`` factors
nccl-tests' bus bandwidth, ``doc/PERFORMANCE.md``)::

    ring all-reduce              2(n-1)/n · B/bw + 2(n-1)·α
    tree all-reduce              2·⌈log2 n⌉ · (α + B/bw)   (binomial reduce, then broadcast)
    ring all-gather              (n-1)/n · B/bw + (n-1)·α
    ring reduce-scatter          (n-1)/n · B/bw + (n-1)·α
    all-to-all (pairwise)        (n-1)/n · B/bw + (n-1)·α
    ring shift (one step)        B/bw + α                   (every member's hop at once)
    hierarchical all-reduce      a group over m > 1 nodes, k members in its smallest node:
                                 ring reduce-scatter of B inside every node (at once)
                                 + all-reduce of B/k among the m nodes over the inter-node
                                   link (the better of ring and tree; one NIC per device,
                                   so the k shards cross in parallel)
                                 + ring all-gather of B inside every node

The tree wins on small messages (``log n`` latencies instead of ``n``), the ring on large
ones; the hierarchical all-reduce keeps most bytes on the fast links inside nodes.

Example:
    >>> from tppc.cost_models.cluster import Cluster
    >>> cost = collective_cost(Cluster.parse("2x(4xh20)@ib-ndr"), "all_reduce", 1e9,
    ...                        range(8))
    >>> cost.algorithm, round(cost.seconds * 1e3, 2)       # ms
    ('hierarchical', 9.12)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from tppc.cost_models.cluster import Cluster
from tppc.errors import SpecError

__all__ = ["COLLECTIVES", "Algorithm", "Collective", "CollectiveCost", "collective_cost"]

Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "ring_shift"]
Algorithm = Literal["ring", "tree", "hierarchical", "none"]
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                                "ring_shift")


@dataclass(frozen=True, kw_only=True)
class CollectiveCost:
    """The price of one collective on one group.

    Attributes:
        collective: which collective (one of :data:`COLLECTIVES`).
        nbytes: B, as the module docstring counts it.
        group: the device indices, in the order given.
        algorithm: the fastest algorithm (``"none"`` for a group of one: nothing moves).
        seconds: its time.
        candidates: every algorithm priced, ``(name, seconds)``, fastest first.
    """

    collective: Collective
    nbytes: float
    group: tuple[int, ...]
    algorithm: Algorithm
    seconds: float
    candidates: tuple[tuple[str, float], ...]


def _ring_steps(collective: str, n: int, nbytes: float, bw: float, alpha: float) -> float:
    """The ring (or pairwise all-to-all, or one ring shift) formula for ``n`` members."""
    if collective == "ring_shift":  # one hop: every member sends its whole block
        return nbytes / bw + alpha
    steps = 2 * (n - 1) if collective == "all_reduce" else n - 1
    return steps / n * nbytes / bw + steps * alpha


def _tree_all_reduce(n: int, nbytes: float, bw: float, alpha: float) -> float:
    return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bw)


def _flat_all_reduce(n: int, nbytes: float, bw: float, alpha: float) -> float:
    """The better of ring and tree for an all-reduce on one bottleneck (0 for n = 1)."""
    if n == 1:
        return 0.0
    return min(_ring_steps("all_reduce", n, nbytes, bw, alpha),
               _tree_all_reduce(n, nbytes, bw, alpha))


def _bottleneck(cluster: Cluster, members: dict[int, list[int]]) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest links among ``members`` (node → devices)."""
    links = [cluster.inter_node] if len(members) > 1 and cluster.inter_node else []
    for devices in members.values():
        links.extend(cluster.links[min(devices):max(devices)])
    return min(link.bandwidth for link in links), max(link.latency for link in links)


def _hierarchical_all_reduce(cluster: Cluster, members: dict[int, list[int]],
                             nbytes: float) -> float:
    """Reduce-scatter inside nodes, all-reduce of B/k across them, all-gather inside."""
    inside = 0.0
    for devices in members.values():
        if len(devices) > 1:
            bw, alpha = _bottleneck(cluster, {0: devices})
            inside = max(inside, _ring_steps("reduce_scatter", len(devices), nbytes, bw, alpha))
    k = min(len(devices) for devices in members.values())
    bw, alpha = _bottleneck(cluster, {node: devices[:1] for node, devices in members.items()})
    across = _flat_all_reduce(len(members), nbytes / k, bw, alpha)
    return 2 * inside + across  # all-gather inside nodes costs what reduce-scatter did


def _check(cluster: Cluster, collective: str, nbytes: float, group: tuple[int, ...]) -> None:
    if collective not in COLLECTIVES:
        raise SpecError(f"collective {collective!r} is not priced; use one of {COLLECTIVES}")
    if not isinstance(nbytes, int | float) or not math.isfinite(nbytes) or nbytes < 0:
        raise SpecError(f"{collective}: nbytes must be a finite number >= 0, got {nbytes!r}; "
                        "give the bytes of the buffer (see collective_costs' docstring)")
    if not group:
        raise SpecError(f"{collective}: the group is empty; give the device indices that "
                        "take part, e.g. range(8)")
    bad = [i for i in group if not isinstance(i, int) or not 0 <= i < cluster.num_devices]
    if bad:
        raise SpecError(f"{collective}: device indices {bad} are not in the cluster "
                        f"{str(cluster)!r} (0..{cluster.num_devices - 1}); give indices into "
                        "cluster.devices")
    if len(set(group)) != len(group):
        raise SpecError(f"{collective}: group {group} names a device twice; give each device "
                        "once")


def collective_cost(cluster: Cluster | str, collective: Collective, nbytes: float,
                    group: Iterable[int]) -> CollectiveCost:
    """Price ``collective`` of ``nbytes`` over the devices ``group`` of ``cluster``.

    Every algorithm the collective has here is priced (the formulas: the module
    docstring); the fastest is returned with all of them as ``candidates``.

    Raises:
        SpecError: an unknown collective, negative bytes, an empty group, an index outside
            the cluster or a device named twice.
    """
    cluster = Cluster.parse(cluster)
    members_list = tuple(group)
    _check(cluster, collective, nbytes, members_list)
    n = len(members_list)
    if n == 1:
        return CollectiveCost(collective=collective, nbytes=nbytes, group=members_list,
                              algorithm="none", seconds=0.0, candidates=(("none", 0.0),))
    members: dict[int, list[int]] = {}
    for index in members_list:
        members.setdefault(cluster.nodes[index], []).append(index)
    bw, alpha = _bottleneck(cluster, members)
    prices: dict[str, float] = {"ring": _ring_steps(collective, n, nbytes, bw, alpha)}
    if collective == "all_reduce":
        prices["tree"] = _tree_all_reduce(n, nbytes, bw, alpha)
        if len(members) > 1 and any(len(devices) > 1 for devices in members.values()):
            prices["hierarchical"] = _hierarchical_all_reduce(cluster, members, nbytes)
    ranked = tuple(sorted(prices.items(), key=lambda item: item[1]))
    best, seconds = ranked[0]
    return CollectiveCost(collective=collective, nbytes=nbytes, group=members_list,
                          algorithm=best, seconds=seconds,  # type: ignore[arg-type]
                          candidates=ranked)
