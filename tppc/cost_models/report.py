"""Cost report: every layer's price for one chunk, the formulas behind it, and the bound.

Terms:
    arithmetic intensity: FLOPs (matrix + vector) per byte moved.
    bound: what dominates a layer's time on the device: ``compute`` (matrix or vector
        FLOPs), ``memory`` (bytes / bandwidth) or ``overhead`` (per-op launch cost); each
        node's roofline time goes to its largest term, then the largest total wins.
    ridge point: the device's peak matrix FLOP/s / memory bandwidth (FLOP per byte).

Example:
    >>> r = report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=512)  # doctest: +SKIP
    >>> print(r)                # a table, one row per layer (identical blocks merged)
    >>> print(r.formula("model.layers.0"))   # sympy, pretty-printed
    >>> r.to_json()
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import sympy
from torch import fx

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.layer_pricer import LayerExpr
from tppc.cost_models.node_shapes import C, L, P
from tppc.cost_models.program_costs import is_chunk_graph
from tppc.cost_models.roofline import node_time_terms
from tppc.errors import CostModelError, SpecError
from tppc.ir.records import LayerInfo

__all__ = ["CostReport", "LayerReport", "report_from_graph"]


@dataclass(frozen=True, kw_only=True)
class LayerReport:
    """One layer's price for the report's chunk.

    Attributes:
        name: layer name.
        kind: prologue, block or epilogue.
        matrix_flops: matmul FLOPs (before tile padding).
        vector_flops: non-matmul FLOPs.
        bytes: bytes moved.
        intensity: (matrix + vector FLOPs) / bytes.
        bound: compute, memory or overhead.
        time: seconds.
        compute_s: seconds of nodes bound by compute.
        memory_s: seconds of nodes bound by memory.
        overhead_s: per-op overhead seconds.
    """

    name: str
    kind: str
    matrix_flops: float
    vector_flops: float
    bytes: float
    intensity: float
    bound: str
    time: float
    compute_s: float
    memory_s: float
    overhead_s: float


@dataclass(frozen=True, kw_only=True)
class CostReport:
    """Per-layer prices of a model for one chunk on one device of a cluster.

    Attributes:
        device: device preset name.
        cluster: the cluster string.
        chunk: tokens in the chunk (c).
        prefix: tokens before it (p).
        seq_len: full sequence length (L).
        dtype: the matmul dtype of the ridge point.
        ridge_point: the device's FLOP per byte above which matmuls are compute-bound.
        layers: one row per layer.
        formulas: per layer, the sympy expressions (matrix_flops, vector_flops, bytes, time).
        unpriced_ops: op names with no pricing rule (priced as memory traffic only).
    """

    device: str
    cluster: str
    chunk: int
    prefix: int
    seq_len: int
    dtype: str
    ridge_point: float
    layers: tuple[LayerReport, ...]
    formulas: dict[str, dict[str, sympy.Expr]]
    unpriced_ops: tuple[str, ...] = ()

    @property
    def total_time(self) -> float:
        """Seconds for the chunk through all layers on one device."""
        return sum(r.time for r in self.layers)

    @property
    def total_flops(self) -> float:
        """Matrix plus vector FLOPs of all layers."""
        return sum(r.matrix_flops + r.vector_flops for r in self.layers)

    @property
    def total_bytes(self) -> float:
        """Bytes moved by all layers."""
        return sum(r.bytes for r in self.layers)

    def formula(self, layer: str) -> str:
        """The layer's FLOPs, bytes and time in (c, p), pretty-printed."""
        if layer not in self.formulas:
            raise CostModelError(f"no layer {layer!r} in the report; layers: "
                                 f"{', '.join(self.formulas)}")
        f = self.formulas[layer]
        lines = [f"{layer} on {self.device} (c = chunk tokens, p = prefix tokens)"]
        for key in ("matrix_flops", "vector_flops", "bytes", "time"):
            expr = sympy.N(f[key], 4) if key == "time" else f[key]
            lines.append(f"{key} =\n{sympy.pretty(expr, use_unicode=True)}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (formulas as strings), for JSON."""
        return {
            "device": self.device, "cluster": self.cluster, "chunk": self.chunk,
            "prefix": self.prefix, "seq_len": self.seq_len, "dtype": self.dtype,
            "ridge_point": self.ridge_point, "total_time": self.total_time,
            "total_flops": self.total_flops, "total_bytes": self.total_bytes,
            "layers": [asdict(r) for r in self.layers],
            "formulas": {k: {n: str(e) for n, e in v.items()} for k, v in self.formulas.items()},
            "unpriced_ops": list(self.unpriced_ops),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The report as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        head = (f"cost of a {self.chunk}-token chunk after {self.prefix} tokens (L = "
                f"{self.seq_len}) on {self.device} [{self.cluster}]; ridge point "
                f"{self.ridge_point:.1f} FLOP/B ({self.dtype})")
        cols = f"{'layer':<28} {'GFLOP':>10} {'MB':>10} {'FLOP/B':>8} {'bound':>9} {'time':>11}"
        rows = [head, cols, "-" * len(cols)]
        for row, count in _merge(self.layers):
            name = row.name if count == 1 else f"{row.name} (x{count})"
            rows.append(f"{name[:28]:<28} {(row.matrix_flops + row.vector_flops) / 1e9:>10.3f} "
                        f"{row.bytes / 1e6:>10.3f} {row.intensity:>8.1f} {row.bound:>9} "
                        f"{_fmt_time(row.time):>11}")
        rows.append("-" * len(cols))
        intensity = self.total_flops / self.total_bytes if self.total_bytes else 0.0
        rows.append(f"{'total':<28} {self.total_flops / 1e9:>10.3f} "
                    f"{self.total_bytes / 1e6:>10.3f} {intensity:>8.1f} {'':>9} "
                    f"{_fmt_time(self.total_time):>11}")
        if self.unpriced_ops:
            rows.append(f"unpriced ops (memory traffic only, may be under-priced): "
                        f"{', '.join(self.unpriced_ops)}")
        return "\n".join(rows)


def _fmt_time(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} us"


def _merge(rows: Sequence[LayerReport]) -> list[tuple[LayerReport, int]]:
    merged: list[tuple[LayerReport, int]] = []
    for row in rows:
        if merged:
            last, n = merged[-1]
            same = {k: v for k, v in asdict(last).items() if k != "name"} == \
                {k: v for k, v in asdict(row).items() if k != "name"}
            if same and row.kind == "block":
                merged[-1] = (last, n + 1)
                continue
        merged.append((row, 1))
    return merged


def _layer_row(expr: LayerExpr, device, chunk: int, prefix: int, seq_len: int, fuse: bool,
               cache: dict) -> tuple[LayerReport, dict[str, sympy.Expr]]:
    point = {C: chunk, P: prefix, L: seq_len}
    key = (expr.time, expr.matrix_flops, expr.vector_flops, expr.bytes)
    if key not in cache:
        split = {"compute": 0.0, "memory": 0.0, "overhead": 0.0}
        for cost in expr.nodes:
            t = node_time_terms(cost, device, fuse_elementwise=fuse)
            terms = [float(sympy.sympify(x).subs(point)) for x in (t.matrix, t.vector, t.memory)]
            split["compute" if max(terms[:2]) >= terms[2] else "memory"] += max(terms)
            split["memory"] += float(sympy.sympify(t.serial).subs(point))
            split["overhead"] += float(sympy.sympify(t.overhead).subs(point))
        cache[key] = (split, float(expr.time.subs(point)), float(expr.matrix_flops.subs(point)),
                      float(expr.vector_flops.subs(point)), float(expr.bytes.subs(point)))
    split, time, matrix, vector, nbytes = cache[key]
    row = LayerReport(
        name=expr.info.name, kind=expr.info.kind, matrix_flops=matrix, vector_flops=vector,
        bytes=nbytes, intensity=(matrix + vector) / nbytes if nbytes else 0.0,
        bound=max(split, key=split.__getitem__), time=time,
        compute_s=split["compute"], memory_s=split["memory"], overhead_s=split["overhead"])
    formulas = {"matrix_flops": expr.matrix_flops, "vector_flops": expr.vector_flops,
                "bytes": expr.bytes, "time": expr.time}
    return row, formulas


def report_from_graph(gm: fx.GraphModule, ctx: Any = None, *, cluster: Cluster | str,
                      chunk: int, prefix: int = 0, seq_len: int | None = None,
                      device_index: int = 0, layers: Sequence[LayerInfo] | None = None,
                      dtype: str | None = None, **options: Any) -> CostReport:
    """Price each layer of the chunk-step program for one chunk on one device of ``cluster``.

    Args:
        gm: the chunk-step graph (:func:`tppc.frontend.annotate.program_of`): the report
            prices the program that runs.
        ctx: the compile context (``seq_symbol``, ``token_count``, ``layers``).
        cluster: a cluster or cluster string; the report prices ``devices[device_index]``.
        chunk: tokens in the chunk (c >= 1).
        prefix: tokens before the chunk (p >= 0).
        seq_len: full length L (bidirectional attention reads L keys); default
            ``prefix + chunk``.
        layers: overrides ``ctx.layers``.
        dtype: dtype of the ridge point (default: the first matmul's dtype).
        **options: passed to :func:`tppc.cost_models.layer_costs.layer_expressions`
            (``compute_dtype``, ``fuse_elementwise``, ``default_attention``).

    Raises:
        SpecError: bad chunk, prefix or device index.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise SpecError(f"chunk must be an int >= 1, got {chunk!r}")
    if not isinstance(prefix, int) or prefix < 0:
        raise SpecError(f"prefix must be an int >= 0, got {prefix!r}")
    cluster = Cluster.parse(cluster)
    if not 0 <= device_index < cluster.num_devices:
        raise SpecError(f"device_index {device_index} outside the cluster's "
                        f"{cluster.num_devices} devices")
    device = cluster.devices[device_index]
    seq_len = seq_len if seq_len is not None else prefix + chunk
    options.setdefault("seq_symbol", getattr(ctx, "seq_symbol", None))
    options.setdefault("token_count", getattr(ctx, "token_count", None))
    layers = layers if layers is not None else getattr(ctx, "layers", None)
    if layers is None:
        raise SpecError("report_from_graph needs the layers of group_layers: pass ctx (from "
                        "tppc.frontend.annotate.annotate) or layers=")
    if not is_chunk_graph(gm) and ctx is not None:
        raise SpecError("report_from_graph prices the chunk-step graph (what runs), got the "
                        "annotated graph. fix: pass tppc.frontend.annotate.program_of(gm, ctx) "
                        "or use tppc.cost_report(model, args, ...)")
    fuse = options.get("fuse_elementwise")
    fuse = device.name.startswith("tpu") if fuse is None else fuse
    exprs = layer_expressions(gm, layers, device, seq_len, **options)
    cache: dict = {}
    rows, formulas = [], {}
    for expr in exprs:
        row, formula = _layer_row(expr, device, chunk, prefix, seq_len, fuse, cache)
        rows.append(row)
        formulas[row.name] = formula
    if dtype is None:
        dtype = next((c.dtype for e in exprs for c in e.nodes if c.matmuls), "fp32")
    return CostReport(device=device.name, cluster=str(cluster), chunk=chunk, prefix=prefix,
                      seq_len=seq_len, dtype=dtype, ridge_point=device.ridge_point(dtype),
                      layers=tuple(rows), formulas=formulas,
                      unpriced_ops=tuple(sorted({op for e in exprs for op in e.unpriced})))
