"""Intra-op groups of CPU devices: one worker whose ``k`` intra-op threads split every op.

Terms:
    intra-op group: ``k`` CPU devices of this machine (``"2xcpu"`` names two; each is an equal
        share of the cores, :mod:`tppc.program.cores`) run by ONE worker with ``k`` times a
        device's share of intra-op threads: torch (OpenMP) splits each op, elementwise ops
        too, across them. Nothing is sharded and nothing is exchanged, so it is priced as one
        device whose rates were measured with ``k`` threads (``calibrate("cpu", threads=k,
        co_running=w)`` for ``w`` such workers at once), not with the thread-group meetings
        of :mod:`.thread_groups`.
    worker chain: the groups in chain order as a :class:`Cluster` of one device each (the
        ``k``-thread spec) on their nodes, joined by the link between their first and last
        members; the ordinary one-device-a-stage cost table of that chain prices every
        placement, the groups of one node charged together against its RAM
        (:meth:`Cluster.memory_pools`).
    mesh of intra-op workers (a diffusion transformer's CFG, Ring or Ulysses workers, each
        of ``k`` threads): a group of ``w · k`` devices is ``w`` workers of ``k`` consecutive
        devices; the worker chain has one device per worker, every worker of every group
        (all of them run at once: ``co_running`` is their count), and each group becomes
        the group of its workers' positions in that chain (:func:`intra_op_workers`), which
        the mesh's group table prices as it prices devices.

Example:
    >>> cluster = Cluster.parse("2xh100-sxm")
    >>> intra_op_chain(cluster, ((0, 1),), 2)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    tppc.errors.SpecError: intra-op groups run on CPU devices only; ...
"""

from __future__ import annotations

from itertools import pairwise

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.specs import DeviceSpec
from tppc.errors import SpecError

__all__ = ["intra_op_chain", "intra_op_spec", "intra_op_workers"]


def intra_op_spec(threads: int, workers: int = 1) -> DeviceSpec:
    """The CPU spec of one worker of ``threads`` intra-op threads while ``workers`` such
    workers run at once (measured once and cached; pinned under ``$TPPC_CALIBRATION``).

    Raises:
        SpecError: a pinned calibration without a ``threads``-thread entry.
    """
    from tppc.cost_models.calibration import calibrate

    return calibrate("cpu", threads=threads, co_running=workers)


def intra_op_chain(cluster: Cluster, groups: tuple[tuple[int, ...], ...], threads: int
                   ) -> Cluster:
    """The worker chain of ``groups`` on ``cluster`` (module docstring).

    Raises:
        SpecError: a group with a non-CPU device, or no ``threads``-thread calibration.
    """
    names = {cluster.device_names[d] for g in groups for d in g}
    if names != {"cpu"}:
        raise SpecError(f"intra-op groups run on CPU devices only; the groups {groups} hold "
                        f"{sorted(names)}. fix: intra_op=1 on this cluster")
    spec = intra_op_spec(threads, len(groups))
    links = tuple(cluster.link(a[-1], b[0]) for a, b in pairwise(groups))
    seen: dict[int, int] = {}  # the groups' nodes, numbered 0, 1, ... (one RAM each)
    nodes = tuple(seen.setdefault(cluster.nodes[g[0]], len(seen)) for g in groups)
    return Cluster(devices=(spec,) * len(groups), links=links, nodes=nodes,
                   inter_node=cluster.inter_node if len(seen) > 1 else None)


def intra_op_workers(cluster: Cluster, groups: tuple[tuple[int, ...], ...], threads: int,
                     workers: int = 1) -> tuple[Cluster, tuple[tuple[int, ...], ...]]:
    """The worker chain of ``groups``, each ``workers`` workers of ``threads`` devices, and
    each group's workers as positions in it (module docstring).

    Raises:
        SpecError: a group that is not ``workers · threads`` devices, a non-CPU device, or
            no ``threads``-thread calibration for that many workers at once.
    """
    bad = [g for g in groups if len(g) != workers * threads]
    if bad:
        raise SpecError(f"intra-op groups {bad} must each hold {workers} worker(s) of "
                        f"{threads} devices ({workers * threads} devices). fix: groups of "
                        f"{workers * threads} consecutive CPU devices")
    members = tuple(g[i:i + threads] for g in groups for i in range(0, len(g), threads))
    chain = intra_op_chain(cluster, members, threads)
    return chain, tuple(tuple(range(j * workers, (j + 1) * workers)) for j in range(len(groups)))
