"""One worker's work and its group's exchanges when a stage runs on a mesh of devices.

Terms:
    mesh: the degrees of a stage's axes (:class:`tppc.program.mesh.Mesh`): ``cfg`` (the
        call's batch cut: classifier-free guidance), ``ring`` and ``ulysses`` (the tokens
        cut), ``tp`` (the weights cut, :mod:`.shard_costs`). ``n = cfg · ring · ulysses``
        workers share the tokens × batch of a chunk; each holds the whole stage's weights
        (or its ``1/tp`` shard).
    worker order: a group's devices in mesh rank order (``tp`` fastest); an axis's members
        are :meth:`Mesh.members` of each rank, so which devices (which links) each axis
        crosses is the group's order, and the planner searches orders (placements).
    bytes per token: of a value over the whole batch and all heads, per chunk token.

One worker's compute (:func:`mesh_node_cost`): every token-dependent node's work cut ``n``
ways. A linear's rows (``m``: batch × tokens) are cut and its weight is read whole; an
attention's batch × heads are cut by ``cfg · ulysses`` (Ulysses trades tokens for heads),
its queries by ``ring``, and a self-attention in the ring form runs ``ring`` kernels, one
per K/V block of ``1/ring`` of the keys, each paying its launch and fixed cost, and merges
the ``ring`` partial outputs by their log-sum-exp (:func:`ring_merge`: float32 passes over
the output, priced even by a fusing preset) (:func:`ring_blocks`). Const nodes (timestep embeddings) run whole on every worker.

Exchanges of a layer for a chunk of ``c`` tokens (:class:`MeshExchanges`; each priced by
:func:`.collective_costs.collective_cost` on the members' own links, the slowest group of an
axis counting)::

    Ulysses   each self-attention: 4 all-to-alls (q, k, v in; out back), each member's send
              buffer bytes_per_token(out) · c / (n · tp); each cross-attention: 2 (q, out)
    Ring      each self-attention in the ring form (:mod:`tppc.passes.meshcut.ring_form`):
              r - 1 ring shifts of a worker's own K/V block, the keys of the whole
              sequence it holds, 2 · bytes_per_token(out) · L / (r · cfg · ulysses · tp),
              and r attention kernels,
              one per block, plus r - 1 merges of the partial outputs (:func:`ring_blocks`); a chunk shorter than the sequence
              (PipeFusion's stale patches) is priced in the gather form, as
              ``cp.denoise`` runs it. As tppc's workers run it (the default)
              every shift blocks the stage (a collective ends a part); as xDiT runs it
              (``overlap``) each block is passed while the previous one is attended,
              exposed max(0, passes - attention). A self-attention in the gather form
              (causal, masked, a video's frames): the chunk's K and V gathered around the
              ring (a ring all-gather of 2 · bytes_per_token(out) · c / (cfg · ulysses ·
              tp)), blocking, then one kernel
    TP        its all-reduces / all-gathers of bytes_per_token · c / n over the tp group
    gather    the model's last layer: its output gathered once per chunk over the
              cfg × ring × ulysses workers (all-gather of bytes_per_token · c): for CFG the
              two halves' outputs, once per step and patch

Memory per worker (``group_costs``' layer rows): weights whole (``1/tp`` of the cut ones);
K/V buffers ``/ (cfg · ulysses)`` (and ``/ tp`` when cut by heads), and ``/ ring`` for the
self-attentions in the ring form (each worker keeps its own block, plus two blocks in flight
per attention: the one it sends and the one it receives, counted with the activations);
activations ``/ n``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import sympy

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.node_shapes import C, L, P
from tppc.cost_models.roofline import ITEMSIZE
from tppc.cost_models.shard_costs import LayerShards
from tppc.program.mesh import Mesh

__all__ = [
    "RING_MERGE_LAUNCHES",
    "SELF_ATTENTION",
    "LayerTraffic",
    "MeshExchanges",
    "axis_groups",
    "ceil_share",
    "layer_traffic",
    "mesh_kv_bytes",
    "mesh_node_cost",
    "mesh_words",
    "ring_blocks",
    "ring_merge",
    "token_workers",
]


SELF_ATTENTION = "chunk_attention"
"""The op of an attention that reads a K/V buffer of the sequence (self-attention)."""


def token_workers(mesh: Mesh) -> int:
    """Workers that share a chunk's batch × tokens: ``cfg · ring · ulysses``."""
    return mesh.cfg * mesh.ring * mesh.ulysses


def _cut(x: object, k: int) -> sympy.Expr:
    return sympy.sympify(x) / k


def _cut_matmul(mm: tuple, mesh: Mesh, attention: bool) -> tuple:
    b, m, n, k = (sympy.sympify(d) for d in mm)
    if not attention:  # a linear: batch × tokens are its rows
        return (b, _cut(m, token_workers(mesh)), n, k) if m.free_symbols else \
            (_cut(b, token_workers(mesh)), m, n, k)
    heads = mesh.cfg * mesh.ulysses
    if heads > 1 and b.is_Integer and int(b) % heads == 0:
        b = b / heads
    else:
        m = _cut(m, heads)
    return (b, _cut(m, mesh.ring), n, k)


def mesh_node_cost(cost: NodeCost, mesh: Mesh) -> NodeCost:
    """One worker's share of ``cost`` (already a tensor-parallel shard) on ``mesh`` (module
    docstring); a ring's self-attention as one kernel (:func:`ring_blocks` cuts it in blocks)."""
    n = token_workers(mesh)
    if n == 1 or cost.kind in ("const", "view"):
        return cost
    share = sympy.Rational(1, n)
    if cost.kind == "matrix":
        fixed = cost.bytes.subs({C: 0, P: 0, L: 0})  # the weight, read whole
        nbytes = fixed + (cost.bytes - fixed) * share
    else:
        nbytes = cost.bytes * share
    attention = cost.kind == "attention"
    return NodeCost(
        name=cost.name, op=cost.op, kind=cost.kind, matrix_flops=cost.matrix_flops * share,
        matmuls=tuple(_cut_matmul(mm, mesh, attention) for mm in cost.matmuls),
        vector_flops=cost.vector_flops * share, bytes=nbytes, dtype=cost.dtype,
        kv_bytes_per_key=cost.kv_bytes_per_key, unpriced=cost.unpriced,
        serial_bytes=cost.serial_bytes * share, causal_keys=cost.causal_keys,
        launches=cost.launches)


RING_MERGE_LAUNCHES = 5
"""Ops one merge of two partials runs (:mod:`tppc.passes.meshcut.ring_kernels`, as yunchang's
``update_out_and_lse``): the block output cast to float32 (none when it is float32), the
log-sum-exp difference, its sigmoid, the lerp of the outputs, the new log-sum-exp."""


def ring_blocks(cost: NodeCost, mesh: Mesh) -> list[tuple[NodeCost, int]]:
    """A worker's self-attention under a ring as ``[(one kernel, kernels), (one merge,
    merges)]``: ``ring`` kernels, each over one K/V block (``1/ring`` of the keys, FLOPs and
    bytes), so each pays its own launch and its kernel's fixed cost per query tile, and
    ``ring - 1`` merges of the partial outputs (:func:`ring_merge`); any other node:
    ``[(cost, 1)]``."""
    r = mesh.ring
    if r == 1 or cost.op != SELF_ATTENTION or len(cost.matmuls) != 2:
        return [(cost, 1)]
    (b, m, keys, d), (b2, m2, dv, keys2) = cost.matmuls
    share = sympy.Rational(1, r)
    block = dataclasses.replace(
        cost, matmuls=((b, m, keys * share, d), (b2, m2, dv, keys2 * share)),
        matrix_flops=cost.matrix_flops * share, vector_flops=cost.vector_flops * share,
        bytes=cost.bytes * share, serial_bytes=cost.serial_bytes * share)
    return [(block, r), (ring_merge(cost), r - 1)]


def ring_merge(cost: NodeCost) -> NodeCost:
    """One merge of a block's partial into the running one (``ring_kernels.merge``), priced
    as the unfused elementwise ops it runs: the block's output cast to float32 (read in the
    compute dtype, written in float32; none in float32), then the running and the block's float32 outputs
    read and the merged one written (the lerp; the log-sum-exp rows are ``1/head_dim`` of
    that and not counted), :data:`RING_MERGE_LAUNCHES` ops. Kind ``memory``: a fusing
    preset keeps its traffic and launches, since the merge runs between the ring's
    communication ops, which a compiled graph breaks at (xDiT's yunchang runs it as a
    TorchScript function; tppc as eager ops)."""
    _, (b, m, dv, _) = cost.matmuls
    values = b * m * dv
    width = ITEMSIZE.get(cost.dtype, 4)
    cast = width < 4  # a float32 output is merged as it is
    return NodeCost(
        name=f"{cost.name}.merge", op="ring_merge", kind="memory",
        matrix_flops=sympy.S.Zero, matmuls=(), vector_flops=4 * values,
        bytes=values * ((width + 4 if cast else 0) + 3 * 4), dtype=cost.dtype,
        launches=sympy.Integer(RING_MERGE_LAUNCHES - (0 if cast else 1)))



@dataclass(frozen=True)
class LayerTraffic:
    """What a layer's attention and output weigh, per chunk token (whole batch, all heads).

    Attributes:
        self_attention: the output bytes per token of each self-attention (K/V buffered).
        cross_attention: the output bytes per token of each attention whose keys are not
            the token axis (a prompt's).
        tp: ``(kind, bytes per token)`` of the tensor-parallel collectives.
        output: bytes per token of the layer's output (gathered after the model's last).
        ring_form: for each self-attention, whether a ring runs it in the ring form (its
            own K/V block passed around) rather than the gather form.
    """

    self_attention: tuple[int, ...] = ()
    cross_attention: tuple[int, ...] = ()
    tp: tuple[tuple[str, int], ...] = ()
    output: int = 0
    ring_form: tuple[bool, ...] = ()

    def forms(self) -> tuple[bool, ...]:
        """:attr:`ring_form`, every self-attention in the ring form when not given."""
        return self.ring_form or (True,) * len(self.self_attention)


def _per_token(expr: sympy.Expr, seq_len: int) -> int:
    at = {P: 0, L: seq_len}
    return int(sympy.ceiling(expr.subs({C: 1, **at}) - expr.subs({C: 0, **at})))


def layer_traffic(nodes: Sequence[NodeCost], shards: LayerShards, output_bytes_per_token: int,
                  seq_len: int, ring_form: Callable[[str], bool] | None = None
                  ) -> LayerTraffic:
    """The :class:`LayerTraffic` of a layer from its nodes' costs and its shards (output
    bytes of each node, TP collectives); ``ring_form(name)``: whether a ring runs the
    self-attention ``name`` in the ring form (default: every one)."""
    own, cross, forms = [], [], []
    for cost, out in zip(nodes, shards.out_bytes, strict=True):
        if cost.kind == "attention":
            (own if cost.op == SELF_ATTENTION else cross).append(_per_token(out, seq_len))
            if cost.op == SELF_ATTENTION:
                forms.append(ring_form(cost.name) if ring_form is not None else True)
    return LayerTraffic(self_attention=tuple(own), cross_attention=tuple(cross),
                        tp=shards.collectives, output=output_bytes_per_token,
                        ring_form=tuple(forms))


def axis_groups(group: Sequence[int], mesh: Mesh, axis: str) -> tuple[tuple[int, ...], ...]:
    """The distinct device groups ``axis`` runs over inside ``group`` (worker order)."""
    seen = dict.fromkeys(tuple(group[r] for r in mesh.members(axis, rank))
                         for rank in range(len(group)))
    return tuple(seen)


def _gather_group(group: Sequence[int], mesh: Mesh) -> tuple[int, ...]:
    """Rank 0's peers in batch × tokens: the workers of tp coordinate 0."""
    return tuple(group[r] for r in range(len(group)) if mesh.coords(r)["tp"] == 0)


@dataclass(frozen=True, eq=False)
class MeshExchanges:
    """Seconds of one layer's exchanges on one group for a chunk of ``c`` tokens.

    ``serial(c)`` blocks the stage (all-to-alls, all-reduces, the output gather, the ring's
    K/V gather unless ``overlap``); ``passes(c)``: the ring's K/V passing when ``overlap``,
    hidden behind the self-attention where it fits.

    Attributes:
        cluster: the cluster.
        group: the devices in worker order.
        mesh: the group's mesh.
        traffic: the layer's :class:`LayerTraffic`.
        last: the model's last layer (its output is gathered).
        overlap: the ring's passes overlap the attention (xDiT's ring attention).
        seq_len: the sequence's tokens L (a ring worker's own block is ``L / ring`` of
            them); 0: the chunk's.
    """

    cluster: Cluster
    group: tuple[int, ...]
    mesh: Mesh
    traffic: LayerTraffic
    last: bool = False
    overlap: bool = False
    seq_len: int = 0
    _seen: dict[float, tuple[float, float]] = field(default_factory=dict, repr=False)

    def _worst(self, axis: str, kind: str, nbytes: float) -> float:
        return max(collective_cost(self.cluster, kind, nbytes, g).seconds  # type: ignore[arg-type]
                   for g in axis_groups(self.group, self.mesh, axis))

    def seconds(self, c: float) -> tuple[float, float]:
        """``(serial, passes)`` at ``c`` tokens (memoised)."""
        if c in self._seen:
            return self._seen[c]
        m, t = self.mesh, self.traffic
        n, serial, passes = token_workers(m), 0.0, 0.0
        if m.tp > 1:
            serial += sum(self._worst("tp", kind, per * c / n) for kind, per in t.tp)
        if m.ulysses > 1:
            share = c / (n * m.tp)
            serial += sum(4 * self._worst("ulysses", "all_to_all", per * share)
                          for per in t.self_attention)
            serial += sum(2 * self._worst("ulysses", "all_to_all", per * share)
                          for per in t.cross_attention)
        if m.ring > 1:
            share = m.cfg * m.ulysses * m.tp
            keys = (self.seq_len or c) / (m.ring * share)  # a worker's own block
            # patches (c < L): PipeFusion's stale patches keep the gather form
            forms = t.forms() if c >= (self.seq_len or c) else (False,) * len(t.forms())
            ring = sum((m.ring - 1) * self._worst("ring", "ring_shift", 2 * per * keys)
                       for per, own in zip(t.self_attention, forms, strict=True) if own)
            serial += sum(self._worst("ring", "all_gather", 2 * per * c / share)
                          for per, own in zip(t.self_attention, forms, strict=True) if not own)
            passes, serial = (ring, serial) if self.overlap else (0.0, serial + ring)
        if self.last and n > 1:
            serial += collective_cost(self.cluster, "all_gather", t.output * c,
                                      _gather_group(self.group, m)).seconds
        self._seen[c] = (serial, passes)
        return self._seen[c]

    def __call__(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        c = np.asarray(c, dtype=float)
        values, inverse = np.unique(c, return_inverse=True)
        pairs = np.array([self.seconds(float(v)) for v in values]).reshape(-1, 2)
        return (pairs[:, 0][inverse].reshape(c.shape), pairs[:, 1][inverse].reshape(c.shape))


def mesh_words(traffic: LayerTraffic, mesh: Mesh) -> str:
    """A layer's exchanges in words, e.g. ``"4 all_to_all (Ulysses) of 4608 B/token"``."""
    parts: list[str] = []
    if mesh.ulysses > 1:
        count = 4 * len(traffic.self_attention) + 2 * len(traffic.cross_attention)
        per = max((*traffic.self_attention, *traffic.cross_attention), default=0)
        if count:
            parts.append(f"{count} all_to_all (Ulysses{mesh.ulysses}) of {per} B/token")
    if mesh.ring > 1 and traffic.self_attention:
        forms = traffic.forms()
        own = [b for b, ring in zip(traffic.self_attention, forms, strict=True) if ring]
        gathered = [b for b, ring in zip(traffic.self_attention, forms, strict=True) if not ring]
        if own:
            parts.append(f"{len(own)} x {mesh.ring - 1} K/V ring shift (Ring{mesh.ring}) of "
                         f"{2 * max(own)} B/key of its own block")
        if gathered:
            parts.append(f"{len(gathered)} K/V all_gather (Ring{mesh.ring}, gather form) of "
                         f"{2 * max(gathered)} B/token")
    if mesh.tp > 1 and traffic.tp:
        counts: dict[tuple[str, int], int] = {}
        for kind, per in traffic.tp:
            counts[(kind, per)] = counts.get((kind, per), 0) + 1
        parts.extend(f"{k} {kind} (TP{mesh.tp}) of {per} B/token"
                     for (kind, per), k in counts.items())
    return ", ".join(parts)


def mesh_kv_bytes(kv: int, traffic: LayerTraffic, mesh: Mesh) -> int:
    """One worker's K/V buffer bytes per token of a layer of ``kv`` (module docstring): cut
    by ``cfg · ulysses``, the ring form's share (by the self-attentions' bytes) by ``ring``."""
    kv = ceil_share(kv, (mesh.cfg, mesh.ulysses))
    total = sum(traffic.self_attention)
    if mesh.ring == 1 or not total:
        return kv
    own = sum(b for b, ring in zip(traffic.self_attention, traffic.forms(), strict=True)
              if ring) / total
    return math.ceil(kv * (1 - own) + kv * own / mesh.ring)


def ceil_share(value: int, parts: Iterable[int]) -> int:
    """``value`` divided by the product of ``parts``, rounded up."""
    return math.ceil(value / math.prod(parts))
