"""Roofline time of one priced node on one device: the terms the layer time sums.

Terms:
    padded matmul: every matmul dimension rounded up to the matrix unit's tile, then the
        device's ``half_rows`` (m½) added to the row count: a skinny matmul of m rows runs
        at m / (m + m½) of peak (measured by calibration on CPUs; 0 on datasheet presets).
    attention rate: ``peak × attention_efficiency`` for fused attention (SDPA), whose
        softmax and masking share the cores with its two matmuls.

    dispatch overhead: ``op_overhead`` per op the node launches (``NodeCost.launches``), plus
        ``attention_overhead`` per ``chunk_attention`` call; a view node costs
        ``view_overhead`` (0 on the presets) and nothing else (see :mod:`.dispatch`).

    achieved rates (GPU presets; see :mod:`.specs`): matrix seconds divide by
        ``peak × matrix.efficiency``; with ``matrix.units`` a kernel's output tiles run in
        whole waves (:func:`.efficiency.wave_flops`); attention follows the head-dim and key
        curve of :mod:`.efficiency`; bytes divide by ``memory.achieved``.
    host overhead: an eager op's issue cost on the host, overlapped with the device's
        work: the node costs at least ``host_overhead × launches``.

A node's time is ``max(max(matrix_s, vector_s, memory_s) + serial_s + overhead, host)``:
serial seconds are copies done by separate kernels (eager K/V repeat), which cannot overlap
the node's compute. Const nodes (no token dependence, run once per call) cost nothing per
chunk.

Example:
    >>> terms = node_time_terms(cost, DEVICE_PRESETS["tpu-v5p"])  # doctest: +SKIP
    >>> terms.matrix, terms.overhead                                # doctest: +SKIP
"""

from __future__ import annotations

from typing import NamedTuple

import sympy

from tppc.cost_models.efficiency import attention_seconds, wave_flops
from tppc.cost_models.node_costs import NodeCost
from tppc.cost_models.node_shapes import P
from tppc.cost_models.specs import DeviceSpec, MatrixUnit

__all__ = ["ITEMSIZE", "TimeTerms", "node_time_terms"]


class TimeTerms(NamedTuple):
    """Seconds of one node on one device; its time is ``max(max(matrix, vector, memory) +
    serial + overhead, host)``.

    Attributes:
        matrix: padded matmul FLOPs / rate.
        vector: vector FLOPs / vector rate.
        memory: bytes the op's own kernel moves / bandwidth.
        serial: bytes of separate copy kernels (not overlapped) / bandwidth, plus the
            packing pass of a weight larger than the last-level cache (CPU GEMMs).
        overhead: launch and dispatch seconds (a number, or an expression in c for a node
            whose launches depend on the chunk, e.g. a loop over the experts touched).
        host: the host's issue seconds, overlapped with the rest (0 when none).
    """

    matrix: sympy.Expr
    vector: sympy.Expr
    memory: sympy.Expr
    serial: sympy.Expr
    overhead: float | sympy.Expr
    host: float | sympy.Expr = 0.0

    def total(self) -> sympy.Expr:
        """``max(max(matrix, vector, memory) + serial + overhead, host)`` (zero terms
        dropped)."""
        terms = [t for t in (self.matrix, self.vector, self.memory) if t != 0]
        body = sympy.Max(*terms, evaluate=False) if len(terms) > 1 else \
            (terms[0] if terms else sympy.Integer(0))
        device = body + self.serial + self.overhead
        if not self.host:
            return device
        return sympy.Max(device, self.host, evaluate=False)


def _pad(x: sympy.Expr, tile: int) -> sympy.Expr:
    if tile <= 1 or (x.is_Integer and int(x) % tile == 0):
        return x
    return sympy.ceiling(x / tile) * tile


def _pad_dim(x: sympy.Expr, tile: int, cost: NodeCost) -> sympy.Expr:
    """Pad a matmul dim; causal key dims (already padded per tile) are left as they are."""
    if cost.causal_keys and x.free_symbols & {P}:
        return x
    return _pad(x, tile)


ITEMSIZE = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
"""Bytes per element of a compute dtype name (:attr:`NodeCost.dtype`)."""


def _streamed_weights(cost: NodeCost, unit: MatrixUnit) -> sympy.Expr:
    """Seconds of packing a weight larger than the last-level cache (CPU GEMMs pack their
    ``n × k`` operand before multiplying; beyond the cache that pass streams from memory)."""
    if cost.kind != "matrix" or unit.stream_bandwidth <= 0:
        return sympy.Integer(0)
    total = 0
    for b, _m, n, k in cost.matmuls:
        size = b * n * k * ITEMSIZE.get(cost.dtype, 4)
        if size.is_number and size > unit.cache_bytes:  # no token axis: a weight
            total += int(size)
    return sympy.Float(total / unit.stream_bandwidth) if total else sympy.Integer(0)


def node_time_terms(cost: NodeCost, device: DeviceSpec, *, fuse_elementwise: bool = False
                    ) -> TimeTerms:
    """The :class:`TimeTerms` of a node on a device.

    Matrix seconds use tile-padded dims plus the unit's ``half_rows``; attention runs at
    ``attention_efficiency`` of the peak. With ``fuse_elementwise`` (XLA) vector ops lose
    their memory traffic and launch, and copies fuse into their consumer (no serial term).
    Const nodes cost nothing per chunk; views cost the device's ``view_overhead``.
    """
    zero = sympy.Integer(0)
    if cost.kind == "const":
        return TimeTerms(zero, zero, zero, zero, 0.0)
    if cost.kind == "view":  # a Python getitem of a tuple dispatches nothing
        free = fuse_elementwise or cost.op == "getitem"
        return TimeTerms(zero, zero, zero, zero, 0.0 if free else device.view_overhead)
    unit = device.matrix
    if cost.kind == "attention" and (device.attention_dim_tile or device.attention_half_dim
                                     or device.attention_half_keys or unit.units):
        t_mat = attention_seconds(cost.matmuls, device, causal=cost.causal_keys,
                                  dtype=cost.dtype)
    else:
        t_mat = _matrix_flops(cost, unit) / unit.peak(cost.dtype)
        if cost.kind == "attention":
            t_mat = t_mat / device.attention_efficiency
        elif unit.efficiency != 1:
            t_mat = t_mat / unit.efficiency
    t_vec = cost.vector_flops / device.vector.peak_flops
    serial = zero if fuse_elementwise else cost.serial_bytes
    bandwidth = device.memory.achieved
    t_mem = (cost.bytes - serial) / bandwidth
    t_serial = serial / bandwidth + _streamed_weights(cost, unit)
    overhead = device.op_overhead * cost.launches if cost.launches != 1 else device.op_overhead
    if cost.op == "chunk_attention":
        overhead = overhead + device.attention_overhead
    host = device.host_overhead * cost.launches if device.host_overhead else 0.0
    if fuse_elementwise and cost.kind == "vector":
        t_mem, overhead, host = zero, 0.0, 0.0
    return TimeTerms(t_mat, t_vec, t_mem, t_serial, overhead, host)


def _matrix_flops(cost: NodeCost, unit: MatrixUnit) -> sympy.Expr:
    """Tile-padded matmul FLOPs (whole waves of tiles when the unit has ``units``)."""
    zero = sympy.Integer(0)
    extra = sympy.Float(unit.half_rows) if unit.half_rows else zero
    mms = cost.matmuls
    if cost.causal_keys:  # the key dim counts visited keys: pad tile by tile (.attention)
        (b, m, keys, d), (_, _, dv, _) = mms
        padded_keys = keys + (_pad(m, unit.tile_m) - m + max(unit.tile_m, unit.tile_n) - 1) / 2
        mms = ((b, m, padded_keys, d), (b, m, dv, padded_keys))
    if unit.units and cost.kind == "matrix":
        return sum((wave_flops(b, m, n, k, unit) for b, m, n, k in mms), zero)
    return sum((2 * b * (_pad(m, unit.tile_m) + extra) * _pad_dim(n, unit.tile_n, cost)
                * _pad_dim(k, unit.tile_k, cost) for b, m, n, k in mms), zero)
