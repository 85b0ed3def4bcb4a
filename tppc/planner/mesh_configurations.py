"""The meshes a diffusion transformer and a cluster allow: CFG × Ring × Ulysses × TP groups.

Terms:
    limits: what the model allows (:class:`MeshLimits`): ``cfg_parallel`` must divide the
        call's batch (the two halves of a guided batch), ``ulysses · tensor_parallel`` every
        attention's head count (Ulysses trades tokens for heads, TP cuts heads),
        ``tensor_parallel`` the sharding pass's shard sizes, ``ulysses · ring`` the tokens.
    configuration: one mesh (``cfg, ring, ulysses, tp``; ``g`` devices a group) and the
        cluster's devices cut into groups of ``g`` consecutive devices (inside a node, or
        whole nodes); the placement planner chooses the stages (PipeFusion) among the groups
        and the patches, exactly as for tensor-parallel groups
        (:mod:`tppc.planner.hybrid`).
    placement: which axis gets which links inside a group: the devices of a group listed in
        worker order (``tp`` fastest) for each nesting of the axes above 1. Where a group's
        links differ (a node boundary, a mixed chain) every nesting is a configuration, so
        the prices of the links choose (e.g. CFG's one exchange per step across nodes, the
        all-to-alls inside); on uniform links one nesting stands for all.
    fixed degrees: a degree the user gives keeps its value; the others are searched.
    intra-op workers: on a cluster of CPU devices only (one machine's cores), each worker of
        a mesh may run ``k`` devices' cores as its intra-op threads (``intra_op=k``, tensor
        degree 1): a group of ``cfg · ring · ulysses · k`` consecutive devices inside a node,
        worker ``r`` on its devices ``r·k … r·k + k − 1`` (``IntraOp2`` alone: one worker on
        2 devices; ``CFG2 x IntraOp2`` on ``"4xcpu"``: two workers of 2 threads each). It is
        priced on a ``k``-thread calibration (:mod:`tppc.cost_models.intra_op`), so the
        driver drops a ``k`` whose calibration a pin lacks.
    every device: a job of one rank per device (``backend="distributed"``) needs a worker on
        every device, so each configuration's stage count is its number of groups (its
        groups tile the cluster); in threads a plan may leave devices idle.

Example:
    >>> from tppc.cost_models.cluster import Cluster
    >>> limits = MeshLimits(heads=(16,), shard_sizes=(16, 1152), batch=2, tokens=4096)
    >>> configs, _ = mesh_configurations(Cluster.parse("2xh100-sxm"), limits)
    >>> [c.label for c in configs]
    ['TP1', 'CFG2 x TP1', 'Ring2 x TP1', 'Ulysses2 x TP1', 'TP2']
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from tppc.cost_models.cluster import Cluster
from tppc.errors import PlanError
from tppc.planner.configurations import Configuration, check_degree
from tppc.program.mesh import AXES, Mesh

__all__ = ["FixedDegrees", "MeshLimits", "check_mesh", "mesh_configurations"]


@dataclass(frozen=True)
class MeshLimits:
    """What one model call allows (module docstring).

    Attributes:
        heads: the head count of each attention (self and cross).
        shard_sizes: the sizes a tensor-parallel degree must divide (empty: nothing cut).
        batch: the call's batch (2 for a guided batch).
        tokens: the tokens of the sequence.
    """

    heads: tuple[int, ...]
    shard_sizes: tuple[int, ...]
    batch: int
    tokens: int


@dataclass(frozen=True, kw_only=True)
class FixedDegrees:
    """The degrees the user gave (None: the planner chooses)."""

    cfg_parallel: int | None = None
    ulysses: int | None = None
    ring: int | None = None
    tensor_parallel: int | None = None
    num_stages: int | None = None
    intra_op: int | None = None
    """Devices a worker runs as intra-op threads (CPU clusters; module docstring)."""
    every_device: bool = False
    """Every device runs a worker: a configuration's stages are all its groups (module
    docstring; a given ``num_stages`` stays as given)."""


def check_mesh(limits: MeshLimits, mesh: Mesh) -> None:
    """Refuse a mesh the model cannot be cut into, naming the degree and the fix.

    Raises:
        PlanError: a CFG degree that does not divide the batch, a Ulysses (× TP) degree that
            does not divide a head count, token parts that do not divide the tokens, or a
            TP degree that does not divide the shard sizes.
    """
    if limits.batch % mesh.cfg:
        raise PlanError(
            f"cfg_parallel={mesh.cfg}: the call's batch of {limits.batch} does not split into "
            f"{mesh.cfg} equal parts (classifier-free guidance runs the prompt and the "
            "negative prompt as a batch of 2). fix: cfg_parallel=1, or call with guidance "
            "(a batch of 2)")
    cut = mesh.ulysses * mesh.tp
    bad = sorted({h for h in limits.heads if h % cut})
    if bad:
        what = f"ulysses={mesh.ulysses}" + (f" x tensor_parallel={mesh.tp}" if mesh.tp > 1
                                            else "")
        good = [d for d in range(1, max(limits.heads) + 1)
                if all(h % d == 0 for h in limits.heads)]
        raise PlanError(f"{what} = {cut} does not divide the attention head count(s) {bad}: "
                        "each worker must hold whole heads. fix: ulysses x tensor_parallel "
                        f"one of {good} (or use ring=, which cuts tokens)")
    parts = mesh.ulysses * mesh.ring
    if limits.tokens % parts:
        raise PlanError(f"ulysses x ring = {parts} does not divide the sequence's "
                        f"{limits.tokens} tokens into equal parts. fix: a degree that "
                        f"divides {limits.tokens}")
    check_degree(mesh.tp, limits.shard_sizes)


def _allowed(limits: MeshLimits, mesh: Mesh) -> bool:
    try:
        check_mesh(limits, mesh)
    except PlanError:
        return False
    return True


def _blocks(cluster: Cluster, g: int) -> tuple[list[tuple[int, ...]], bool] | None:
    """Groups of ``g`` consecutive devices inside nodes, or of whole nodes (spans=True)."""
    nodes = [cluster.node_devices(n) for n in range(cluster.num_nodes)]
    sizes = {len(n) for n in nodes}
    if all(len(n) % g == 0 for n in nodes):
        return [tuple(n[i:i + g]) for n in nodes for i in range(0, len(n), g)], False
    size = min(sizes)
    if len(sizes) == 1 and g % size == 0 and len(nodes) % (g // size) == 0:
        flat = [d for n in nodes for d in n]
        return [tuple(flat[i:i + g]) for i in range(0, len(flat), g)], True
    return None


def _uniform(cluster: Cluster, block: tuple[int, ...]) -> bool:
    """Every hop inside ``block`` is the same link (no node boundary, one link kind)."""
    if len({cluster.nodes[d] for d in block}) > 1:
        return False
    return len({cluster.link(a, b) for a, b in itertools.pairwise(block)}) <= 1


def _ordered(block: tuple[int, ...], mesh: Mesh, nest: Sequence[str]) -> tuple[int, ...]:
    """``block``'s devices in worker order when the axes nest as ``nest`` (outer to inner)
    over the block's chain: rank ``r`` sits at the mixed-radix position of its coordinates
    read in ``nest``'s order."""
    out = []
    for rank in range(len(block)):
        coords = mesh.coords(rank)
        pos = 0
        for axis in nest:
            pos = pos * getattr(mesh, axis) + coords[axis]
        out.append(block[pos])
    return tuple(out)


def _placements(cluster: Cluster, blocks: list[tuple[int, ...]], mesh: Mesh
                ) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """``(name, groups)`` of every nesting of the axes above 1 (one on uniform links)."""
    busy = [a for a in AXES if getattr(mesh, a) > 1]
    if len(busy) < 2 or all(_uniform(cluster, b) for b in blocks):
        return [("", tuple(blocks))]
    out = []
    for perm in itertools.permutations(busy):
        nest = [a for a in AXES if a not in busy] + list(perm)
        name = "near to far: " + ", ".join(reversed(perm))
        out.append((name, tuple(_ordered(b, mesh, nest) for b in blocks)))
    return out


def _degrees(fixed: int | None, limit: int) -> list[int]:
    return [fixed] if fixed is not None else list(range(1, limit + 1))


def _intra_ops(cluster: Cluster, fixed: FixedDegrees) -> list[int]:
    """The intra-op degrees searched (module docstring): 1, and on a cluster of CPU devices
    (not a job of one rank per device) every ``k > 1`` that divides a node's devices.

    Raises:
        PlanError: a fixed ``intra_op`` above 1 on a cluster with a non-CPU device, with
            ``tensor_parallel`` above 1, or that divides no node's devices.
    """
    k = fixed.intra_op
    cpus = all(name == "cpu" for name in cluster.device_names)
    if k is not None and k > 1:
        if not cpus:
            raise PlanError(f"intra_op={k}: the cluster {str(cluster)!r} has non-CPU devices "
                            f"({sorted(set(cluster.device_names) - {'cpu'})}); intra-op "
                            "workers run on the cores of CPU devices of one machine. fix: "
                            "intra_op=1 (or None), or a cluster such as '2xcpu'")
        if (fixed.tensor_parallel or 1) > 1:
            raise PlanError(f"intra_op={k} and tensor_parallel={fixed.tensor_parallel}: a "
                            "worker is one or the other (intra-op threads, or a shard). fix: "
                            "drop one of them")
        size = len(cluster.node_devices(0))
        if any(len(cluster.node_devices(n)) % k for n in range(cluster.num_nodes)):
            raise PlanError(f"intra_op={k} does not divide the {size} CPU devices of a node "
                            f"of {str(cluster)!r} (a worker's threads are one machine's). "
                            f"fix: one of {[d for d in range(1, size + 1) if size % d == 0]}")
        return [k]
    if k == 1 or not cpus or fixed.every_device or (fixed.tensor_parallel or 1) > 1:
        return [1]
    sizes = {len(cluster.node_devices(n)) for n in range(cluster.num_nodes)}
    return [1] + [d for d in range(2, min(sizes) + 1) if all(s % d == 0 for s in sizes)]


def mesh_configurations(cluster: Cluster, limits: MeshLimits,
                        fixed: FixedDegrees | None = None
                        ) -> tuple[list[Configuration], list[str]]:
    """Every configuration the cluster, the model and the fixed degrees allow, and why the
    fixed degrees' others were refused (one line each).

    Raises:
        PlanError: fixed degrees the model cannot be cut into (:func:`check_mesh`), or that
            need more devices than the cluster has.
    """
    fixed = fixed or FixedDegrees()
    n = cluster.num_devices
    given = Mesh(cfg=fixed.cfg_parallel or 1, ring=fixed.ring or 1,
                 ulysses=fixed.ulysses or 1, tp=fixed.tensor_parallel or 1)
    check_mesh(limits, given)
    ks = _intra_ops(cluster, fixed)
    intra = fixed.intra_op or 1
    need = math.prod(getattr(given, a) for a in AXES) * intra * (fixed.num_stages or 1)
    if need > n:
        raise PlanError(f"the degrees given ({given.cfg} cfg x {given.ring} ring x "
                        f"{given.ulysses} ulysses x {given.tp} tp"
                        + (f" x {intra} intra-op" if intra > 1 else "")
                        + f", {fixed.num_stages or 1} stage(s)) need {need} devices; "
                        f"{str(cluster)!r} has {n}. fix: smaller degrees or fewer stages")
    configs: list[Configuration] = []
    refused: list[str] = []
    for cfg, ring, uly, tp, k in itertools.product(
            _degrees(fixed.cfg_parallel, limits.batch), _degrees(fixed.ring, n),
            _degrees(fixed.ulysses, n), _degrees(fixed.tensor_parallel, n), ks):
        g = cfg * ring * uly * tp * k
        if g > n or n // g < (fixed.num_stages or 1) or (k > 1 and tp > 1):
            continue
        mesh = Mesh(cfg=cfg, ring=ring, ulysses=uly, tp=tp)
        if not _allowed(limits, mesh):
            continue
        cut = _blocks(cluster, g)
        if cut is None or (k > 1 and cut[1]):
            refused.append(f"{mesh}" + (f" x IntraOp{k}" if k > 1 else "")
                           + f": groups of {g} devices do not tile the nodes of "
                           f"{str(cluster)!r}")
            continue
        blocks, spans = cut
        places = _placements(cluster, blocks, mesh) if k == 1 else [("", tuple(blocks))]
        for name, groups in places:
            configs.append(Configuration(groups, spans_nodes=spans, cfg_parallel=cfg,
                                         ulysses=uly, ring=ring, placement=name, intra_op=k,
                                         fixed_stages=len(groups) if fixed.every_device
                                         and fixed.num_stages is None else None))
    return configs, refused
