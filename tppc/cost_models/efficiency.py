"""Achieved throughput of GEMMs and attention kernels: the curves behind the GPU presets.

A datasheet peak is what no kernel reaches. What a kernel sustains depends on its shape:

Terms:
    tile quantisation: a GEMM computes its ``m × n`` output in ``tile_m × tile_n`` tiles and
        its reduction in ``tile_k`` steps; a ragged edge costs a whole tile (NVIDIA, *Matrix
        Multiplication Background User's Guide*, DU-09799-001, §3.1).
    wave quantisation: the tiles run on ``units`` processors (SMs) at once; a kernel of
        ``t`` tiles runs ``ceil(t / units)`` waves, the last one partly idle (same guide, §3.2:
        on an A100's 108 SMs, 109 tiles take as long as 216).
    large-GEMM efficiency: even a perfect shape sustains only ``matrix.efficiency`` of the
        peak (clock under load, issue limits): the maximum achievable matmul FLOPS.
    attention curve: a FlashAttention-class kernel tiles the queries (``tile_m`` rows per
        thread block, one block per ``(batch·head, query tile)``) and loops over the keys.
        Its head dim is padded to the next compiled size (``attention_dim_tile``); its rate
        grows with the padded head dim ``d`` as ``d / (d + attention_half_dim)`` (the
        softmax and rescaling between the two matmuls cost about the same per score whatever
        ``d``), and each query tile pays a fixed prologue and epilogue worth
        ``attention_half_keys`` keys.

The asymptotes and half-values are per device, from public measurements; see
:mod:`.presets`. The curves are monotone in the size of the work once whole waves are
compared, and saturate at the asymptote (``tests/unit/test_cost_efficiency.py``).

Example:
    >>> from tppc.cost_models.presets import DEVICE_PRESETS
    >>> a100 = DEVICE_PRESETS["a100-80gb"]
    >>> round(gemm_efficiency(8192, 8192, 8192, a100.matrix), 3)  # doctest: +SKIP
    0.859
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from tppc.cost_models.specs import DeviceSpec, MatrixUnit

__all__ = ["attention_efficiency", "attention_rate", "attention_seconds", "gemm_efficiency",
           "pad_to", "wave_flops"]

Dims = tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]


def pad_to(x: sympy.Expr | int, tile: int) -> sympy.Expr:
    """``x`` rounded up to a multiple of ``tile`` (unchanged when ``tile <= 1``)."""
    x = sympy.sympify(x)
    if tile <= 1 or (x.is_Integer and int(x) % tile == 0):
        return x
    return sympy.ceiling(x / tile) * tile


def _waves(tiles: sympy.Expr, units: int) -> sympy.Expr:
    """Tile slots a kernel of ``tiles`` tiles occupies: whole waves of ``units``."""
    return sympy.ceiling(tiles / units) * units


def wave_flops(b: sympy.Expr, m: sympy.Expr, n: sympy.Expr, k: sympy.Expr,
               unit: MatrixUnit) -> sympy.Expr:
    """FLOPs a ``b × (m × k)·(k × n)`` GEMM costs: whole tiles, in whole waves of tiles."""
    tiles = b * sympy.ceiling(sympy.sympify(m) / unit.tile_m) \
        * sympy.ceiling(sympy.sympify(n) / unit.tile_n)
    slots = _waves(tiles, unit.units) if unit.units else tiles
    return 2 * slots * unit.tile_m * unit.tile_n * pad_to(k, unit.tile_k)


def gemm_efficiency(m: int, n: int, k: int, unit: MatrixUnit, dtype: str = "fp16",
                    batch: int = 1) -> float:
    """Fraction of the ``dtype`` peak a ``batch × m × n × k`` GEMM achieves (numbers)."""
    if unit.units:
        cost = wave_flops(sympy.Integer(batch), sympy.Integer(m), sympy.Integer(n),
                          sympy.Integer(k), unit)
    else:
        cost = 2 * batch * pad_to(m, unit.tile_m) * pad_to(n, unit.tile_n) \
            * pad_to(k, unit.tile_k)
    seconds = float(cost) / (unit.peak(dtype) * unit.efficiency)
    return 2.0 * batch * m * n * k / seconds / unit.peak(dtype)


def _head_tile(device: DeviceSpec) -> int:
    return device.attention_dim_tile or device.matrix.tile_k


def attention_rate(device: DeviceSpec, dtype: str, head_dim: sympy.Expr) -> sympy.Expr:
    """FLOP/s (on padded work) of fused attention with head dim ``head_dim``."""
    rate = device.matrix.peak(dtype) * device.attention_efficiency
    if not device.attention_half_dim:
        return sympy.Float(rate)
    d = pad_to(head_dim, _head_tile(device))
    return rate * d / (d + device.attention_half_dim)


def attention_seconds(matmuls: Sequence[Dims], device: DeviceSpec, *, causal: bool,
                      dtype: str = "fp16") -> sympy.Expr:
    """Seconds of a fused attention call ``((b, m, keys, d), (b, m, dv, keys))``.

    Non-causal: ``ceil(b·⌈m/tile_m⌉ / units)`` waves of query tiles, each over
    ``keys + attention_half_keys`` keys of padded head dims. Causal: ``keys`` is the mean
    visited keys per row, padded tile by tile as in :mod:`.roofline`; no wave term (its
    query tiles differ in work, so the scheduler balances them).
    """
    (b, m, keys, d), (_, _, dv, _) = matmuls
    unit = device.matrix
    tile = _head_tile(device)
    width = pad_to(d, tile) + pad_to(dv, tile)
    keys = keys + device.attention_half_keys
    if causal:
        keys = keys + (pad_to(m, unit.tile_m) - m + max(unit.tile_m, unit.tile_n) - 1) / 2
        rows = b * pad_to(m, unit.tile_m)
    else:
        tiles = b * sympy.ceiling(sympy.sympify(m) / unit.tile_m)
        rows = (_waves(tiles, unit.units) if unit.units else tiles) * unit.tile_m
    return 2 * rows * keys * width / attention_rate(device, dtype, d)


def attention_efficiency(queries: int, keys: int, head_dim: int, device: DeviceSpec,
                         *, heads: int = 1, dtype: str = "fp16") -> float:
    """Fraction of the ``dtype`` peak a non-causal attention call achieves on useful FLOPs."""
    mm = ((sympy.Integer(heads), sympy.Integer(queries), sympy.Integer(keys),
           sympy.Integer(head_dim)),
          (sympy.Integer(heads), sympy.Integer(queries), sympy.Integer(head_dim),
           sympy.Integer(keys)))
    seconds = float(attention_seconds(mm, device, causal=False, dtype=dtype))
    return 4.0 * heads * queries * keys * head_dim / seconds / device.matrix.peak(dtype)
