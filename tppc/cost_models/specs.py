"""Hardware specs: what one device and one link can do, as validated frozen records.

Terms:
    matrix unit: the tensor cores / MXU; a peak FLOP/s per dtype and a tile m×n×k to which
        every matmul's dimensions are rounded up (m = rows of the left operand, usually
        tokens; n = output features; k = the reduction).
    vector unit: everything that is not a matmul (norms, activations, elementwise), one
        FLOP/s rate (fp32).
    memory: HBM (or DRAM) bandwidth in bytes/s and capacity in bytes.
    op overhead: seconds added to every op that launches a kernel.
    view overhead: seconds per view node of a graph run eagerly (dispatch without a kernel;
        0 on the datasheet presets, measured on CPUs by calibration).
    attention overhead: seconds per ``tppc::chunk_attention`` call besides one op overhead
        (custom-op dispatch, per-chunk mask building; measured on CPUs by calibration).
    ridge point: peak matrix FLOP/s / memory bandwidth, in FLOP per byte. Below it an op is
        memory-bound.
    half rows (m½): a matmul of m rows reaches m / (m + m½) of peak, i.e. it costs as if it
        had m + m½ rows (skinny matmuls re-stream the weights for few rows; 0 on the
        datasheet presets, where tile padding models the same effect).
    attention efficiency: the fraction of the matrix peak a fused attention kernel reaches
        (its softmax, masking and rescaling run on the same cores between two small matmuls).
    achieved efficiency (GPU presets, measured, not peak): a large GEMM sustains
        ``matrix.efficiency`` of the peak; a kernel's output tiles run on ``matrix.units``
        processors (SMs, CUs) in waves, so a kernel of ``t`` tiles costs
        ``ceil(t / units)`` full waves (wave quantisation); memory-bound kernels reach
        ``memory.efficiency`` of the bandwidth; an eager op costs the host
        ``host_overhead`` seconds to issue, overlapped with the device's work (an op takes
        at least that long) on top of ``op_overhead`` of gap between kernels.
    attention curve: the head dim is padded to ``attention_dim_tile`` (FlashAttention's
        kernels exist for head dims 32, 64, 96, ...); a kernel of padded head dim ``d`` reaches
        ``attention_efficiency · d / (d + attention_half_dim)`` of the peak, and each query
        row costs ``attention_half_keys`` keys more than it visits (per-tile prologue and
        epilogue: short key ranges run below the asymptotic rate).
    link: bandwidth per direction (bytes/s) and latency (s) between two neighbouring devices.

Example:
    >>> h = DeviceSpec(name="toy", matrix=MatrixUnit(peak_flops={"bf16": 1e15}),
    ...                vector=VectorUnit(peak_flops=1e13),
    ...                memory=Memory(bandwidth=2e12, capacity=80 * 10**9))
    >>> h.ridge_point("bf16")
    500.0
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from tppc.errors import SpecError

if TYPE_CHECKING:
    from tppc.cost_models.thread_groups import ThreadGroupSpec

__all__ = [
    "DTYPES",
    "DeviceSpec",
    "Dtype",
    "LinkSpec",
    "MatrixUnit",
    "Memory",
    "VectorUnit",
]

Dtype = Literal["fp32", "tf32", "bf16", "fp16", "fp8", "int8"]
DTYPES: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8", "int8")

# When a device has no rate for a dtype, the op runs at the rate of the next one in this
# list (an fp8 model on an A100 runs at the fp16 rate; bf16 on a V100 at the fp32 rate).
_FALLBACK: dict[str, tuple[str, ...]] = {
    "fp8": ("fp16", "bf16", "tf32", "fp32"),
    "int8": ("fp16", "bf16", "fp32"),
    "fp16": ("bf16", "tf32", "fp32"),
    "bf16": ("fp16", "tf32", "fp32"),
    "tf32": ("fp32",),
    "fp32": ("tf32",),
}


def _positive(owner: str, name: str, value: float, fix: str) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise SpecError(f"{owner}: {name} must be a positive finite number, got {value!r}; {fix}")


def _fraction(owner: str, name: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0 < value <= 1:
        raise SpecError(f"{owner}: {name} must be in (0, 1], got {value!r}; it is the measured "
                        "fraction of the datasheet rate that real kernels sustain")


@dataclass(frozen=True, kw_only=True)
class MatrixUnit:
    """Matrix (tensor-core / MXU) throughput and tile.

    Attributes:
        peak_flops: dense peak FLOP/s per dtype (keys from :data:`DTYPES`).
        tile_m: rows (tokens) a matmul is padded to a multiple of.
        tile_n: output columns a matmul is padded to a multiple of.
        tile_k: reduction length a matmul is padded to a multiple of.
        half_rows: m½, rows added to every matmul's (padded) row count: a matmul of m rows
            runs at m / (m + m½) of peak. 0 means size-independent throughput.
        cache_bytes: the last-level cache (CPUs): a matmul operand without a token axis
            (a weight) larger than this is packed in a pass over memory of its own.
        stream_bandwidth: bytes/s of that pass, which does not overlap the multiply (0: no
            such pass; datasheet presets).
        efficiency: fraction of the peak a large, well-shaped GEMM sustains (measured, e.g.
            the maximum achievable matmul FLOPS); in (0, 1].
        units: processors the output tiles are spread over (SMs, CUs); 0: no wave
            quantisation.
    """

    peak_flops: Mapping[str, float]
    tile_m: int = 1
    tile_n: int = 1
    tile_k: int = 1
    half_rows: float = 0.0
    cache_bytes: int = 0
    stream_bandwidth: float = 0.0
    efficiency: float = 1.0
    units: int = 0

    def __post_init__(self) -> None:
        if not self.peak_flops:
            raise SpecError("MatrixUnit: peak_flops is empty; give at least {'fp32': rate}")
        for dtype, rate in self.peak_flops.items():
            if dtype not in DTYPES:
                raise SpecError(
                    f"MatrixUnit: unknown dtype {dtype!r} in peak_flops; use one of {DTYPES}"
                )
            _positive("MatrixUnit", f"peak_flops[{dtype!r}]", rate, "give FLOP/s, e.g. 9.89e14")
        for name in ("tile_m", "tile_n", "tile_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"MatrixUnit: {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.half_rows, int | float) or not math.isfinite(self.half_rows) \
                or self.half_rows < 0:
            raise SpecError(f"MatrixUnit: half_rows must be >= 0 rows, got {self.half_rows!r}")
        _fraction("MatrixUnit", "efficiency", self.efficiency)
        if not isinstance(self.units, int) or self.units < 0:
            raise SpecError(f"MatrixUnit: units must be an integer >= 0, got {self.units!r}")
        object.__setattr__(self, "peak_flops", dict(self.peak_flops))

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``, falling back to the nearest dtype the unit supports."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        for other in _FALLBACK.get(dtype, ()):
            if other in self.peak_flops:
                return self.peak_flops[other]
        raise SpecError(
            f"MatrixUnit: no rate for dtype {dtype!r} (has {sorted(self.peak_flops)}); "
            "add it to peak_flops"
        )

    def __hash__(self) -> int:
        return hash((tuple(sorted(self.peak_flops.items())), self.tile_m, self.tile_n, self.tile_k,
                     self.half_rows, self.cache_bytes, self.stream_bandwidth, self.efficiency,
                     self.units))


@dataclass(frozen=True, kw_only=True)
class VectorUnit:
    """Throughput of non-matmul arithmetic.

    Attributes:
        peak_flops: FLOP/s of elementwise / reduction work (fp32).
    """

    peak_flops: float

    def __post_init__(self) -> None:
        _positive("VectorUnit", "peak_flops", self.peak_flops, "give FLOP/s, e.g. 6.7e13")


@dataclass(frozen=True, kw_only=True)
class Memory:
    """Device memory.

    Attributes:
        bandwidth: bytes/s between memory and the compute units (datasheet, or measured).
        capacity: usable bytes.
        efficiency: fraction of ``bandwidth`` memory-bound kernels sustain, in (0, 1].
    """

    bandwidth: float
    capacity: int
    efficiency: float = 1.0

    def __post_init__(self) -> None:
        _positive("Memory", "bandwidth", self.bandwidth, "give bytes/s, e.g. 3.35e12")
        _positive("Memory", "capacity", self.capacity, "give bytes, e.g. 80 * 10**9")
        _fraction("Memory", "efficiency", self.efficiency)

    @property
    def achieved(self) -> float:
        """Bytes/s memory-bound kernels sustain: ``bandwidth × efficiency``."""
        return self.bandwidth * self.efficiency


@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator (or CPU) as the cost model sees it.

    Attributes:
        name: preset name (``"h100-sxm"``), used in cluster strings and cost tables.
        matrix: the matrix unit.
        vector: the vector unit.
        memory: the memory.
        op_overhead: seconds added per kernel-launching op (launch, dispatch).
        view_overhead: seconds per view node (eager dispatch of a view; 0: views are free).
        attention_overhead: seconds per chunk-attention call besides its op overhead.
        attention_efficiency: fraction of the matrix peak fused attention (SDPA) reaches,
            in (0, 1]; 1 prices attention like any matmul. With ``attention_half_dim`` it
            is the asymptote of the head-dim curve.
        host_overhead: seconds the host spends issuing one eager op; the device runs
            asynchronously, so an op costs ``max(device time, host_overhead)`` (0: none).
        attention_dim_tile: head dims are padded to a multiple of this (0: the matrix
            unit's ``tile_k``).
        attention_half_dim: d½ of the head-dim curve (0: flat).
        attention_half_keys: keys added to every query row's visited keys (0: none).
        thread_group: what collectives of worker threads sharing this CPU cost (measured,
            :mod:`.thread_groups`); None: a group of these devices is priced by its link.
        description: free text (full product name, where the numbers come from).
    """

    name: str
    matrix: MatrixUnit
    vector: VectorUnit
    memory: Memory
    op_overhead: float = 0.0
    view_overhead: float = 0.0
    attention_overhead: float = 0.0
    attention_efficiency: float = 1.0
    host_overhead: float = 0.0
    attention_dim_tile: int = 0
    attention_half_dim: float = 0.0
    attention_half_keys: float = 0.0
    thread_group: ThreadGroupSpec | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.name:
            raise SpecError("DeviceSpec: name is empty; give a preset-like name such as 'h100-sxm'")
        eff = self.attention_efficiency
        if not isinstance(eff, int | float) or not math.isfinite(eff) or not 0 < eff <= 1:
            raise SpecError(
                f"DeviceSpec {self.name!r}: attention_efficiency must be in (0, 1], got "
                f"{eff!r}; it is the fraction of the matrix peak that SDPA reaches"
            )
        for name in ("op_overhead", "view_overhead", "attention_overhead", "host_overhead",
                     "attention_half_dim", "attention_half_keys"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise SpecError(
                    f"DeviceSpec {self.name!r}: {name} must be >= 0, got {value!r}"
                )
        if not isinstance(self.attention_dim_tile, int) or self.attention_dim_tile < 0:
            raise SpecError(f"DeviceSpec {self.name!r}: attention_dim_tile must be an integer "
                            f">= 0, got {self.attention_dim_tile!r}")

    def ridge_point(self, dtype: str = "bf16") -> float:
        """FLOP per byte above which a matmul in ``dtype`` is compute-bound."""
        return self.matrix.peak(dtype) / self.memory.bandwidth


@dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """A point-to-point link between two neighbouring devices.

    Attributes:
        name: preset name (``"nvlink4"``).
        bandwidth: bytes/s in one direction.
        latency: seconds per message.
        duplex: True when both directions run at full bandwidth at once.
        description: free text (where the numbers come from).
    """

    name: str
    bandwidth: float
    latency: float
    duplex: bool = True
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        _positive(f"LinkSpec {self.name!r}", "bandwidth", self.bandwidth, "give bytes/s")
        if not math.isfinite(self.latency) or self.latency < 0:
            raise SpecError(
                f"LinkSpec {self.name!r}: latency must be >= 0 seconds, got {self.latency!r}"
            )

    def time(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` one way."""
        return self.latency + nbytes / self.bandwidth
