"""Preset device and link specs, with their sources.

Numbers are dense (no sparsity) datasheet peaks; ANCHORS.md (shared) lists them. Datasheet
peaks are upper bounds: real kernels reach 60-80 % of them, which is why ``calibrate`` exists
for the machine you are on. Per-op overheads are typical eager launch costs, not datasheet
numbers. The ``cpu`` device is not here: it is measured (see :mod:`.calibration`).

Example:
    >>> DEVICE_PRESETS["h100-sxm"].ridge_point("bf16")  # FLOP per byte
    295.2...
"""

from __future__ import annotations

from tppc.cost_models.specs import DeviceSpec, LinkSpec, MatrixUnit, Memory, VectorUnit

__all__ = ["DEFAULT_LINK", "DEVICE_PRESETS", "LINK_PRESETS"]

T = 1e12
G = 1e9
GIB = 2**30

_GPU_TILE = {"tile_m": 64, "tile_n": 64, "tile_k": 16}
"""NVIDIA tensor-core GEMMs run in thread-block tiles; 64 rows is the smallest wgmma/mma
tile cuBLAS uses for skinny problems. Wave quantisation (tiles / SMs) is not modelled."""
_MXU_TILE = {"tile_m": 128, "tile_n": 128, "tile_k": 128}
"""TPU MXU: a 128×128 systolic array; XLA pads matmul operands to multiples of 128."""


def _h100_sxm() -> DeviceSpec:
    """NVIDIA H100 SXM5 80GB.

    Source: NVIDIA H100 Tensor Core GPU datasheet (2023): 989 TFLOP/s bf16/fp16 dense,
    1979 fp8/int8, 495 tf32, 67 fp32 (non-tensor); HBM3 3.35 TB/s, 80 GB.
    """
    return DeviceSpec(
        name="h100-sxm",
        matrix=MatrixUnit(
            peak_flops={"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T, "fp16": 989 * T,
                        "fp8": 1979 * T, "int8": 1979 * T},
            **_GPU_TILE,
        ),
        vector=VectorUnit(peak_flops=67 * T),
        memory=Memory(bandwidth=3.35 * T, capacity=80 * G),
        op_overhead=4e-6,
        description=_h100_sxm.__doc__ or "",
    )


def _h200() -> DeviceSpec:
    """NVIDIA H200 SXM 141GB.

    Source: NVIDIA H200 datasheet (2024): same tensor cores as H100 SXM (989 TFLOP/s bf16
    dense, 1979 fp8); HBM3e 4.8 TB/s, 141 GB.
    """
    h100 = _h100_sxm()
    return DeviceSpec(
        name="h200",
        matrix=h100.matrix,
        vector=h100.vector,
        memory=Memory(bandwidth=4.8 * T, capacity=141 * G),
        op_overhead=4e-6,
        description=_h200.__doc__ or "",
    )


def _a100_80gb() -> DeviceSpec:
    """NVIDIA A100 SXM4 80GB.

    Source: NVIDIA A100 datasheet (2021): 312 TFLOP/s bf16/fp16 dense, 624 int8, 156 tf32,
    19.5 fp32; HBM2e 2.04 TB/s, 80 GB. No fp8 (fp8 models run at the fp16 rate).
    """
    return DeviceSpec(
        name="a100-80gb",
        matrix=MatrixUnit(
            peak_flops={"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T, "fp16": 312 * T,
                        "int8": 624 * T},
            **_GPU_TILE,
        ),
        vector=VectorUnit(peak_flops=19.5 * T),
        memory=Memory(bandwidth=2.039 * T, capacity=80 * G),
        op_overhead=5e-6,
        description=_a100_80gb.__doc__ or "",
    )


def _v100() -> DeviceSpec:
    """NVIDIA V100 SXM2 32GB.

    Source: NVIDIA V100 datasheet (2018): 125 TFLOP/s fp16 tensor, 15.7 fp32; HBM2
    0.9 TB/s, 32 GB (a 16 GB part exists). No bf16 tensor cores: bf16 runs at the fp32 rate.
    """
    return DeviceSpec(
        name="v100",
        matrix=MatrixUnit(peak_flops={"fp32": 15.7 * T, "fp16": 125 * T}, **_GPU_TILE),
        vector=VectorUnit(peak_flops=15.7 * T),
        memory=Memory(bandwidth=0.9 * T, capacity=32 * G),
        op_overhead=6e-6,
        description=_v100.__doc__ or "",
    )


def _tpu(name: str, bf16: float, int8: float, bw: float, cap: int, vec: float, doc: str
         ) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        # fp32 matmuls at HIGHEST precision take 6 bf16 passes on the MXU.
        matrix=MatrixUnit(peak_flops={"bf16": bf16, "fp32": bf16 / 6, "int8": int8},
                          **_MXU_TILE),
        vector=VectorUnit(peak_flops=vec),
        memory=Memory(bandwidth=bw, capacity=cap),
        op_overhead=2e-6,
        description=doc,
    )


def _tpu_v4() -> DeviceSpec:
    """Google TPU v4 (one chip, 2 TensorCores, 4 MXUs each).

    Source: Google Cloud TPU v4 docs / Jouppi et al., ISCA 2023: 275 TFLOP/s bf16 and int8,
    32 GiB HBM2 at 1.2 TB/s. Vector rate is an estimate (VPU 8×128 lanes per core).
    """
    return _tpu("tpu-v4", 275 * T, 275 * T, 1.2 * T, 32 * GIB, 8.6 * T, _tpu_v4.__doc__ or "")


def _tpu_v5e() -> DeviceSpec:
    """Google TPU v5e (one chip, 1 TensorCore, 4 MXUs).

    Source: Google Cloud TPU v5e docs: 197 TFLOP/s bf16, 394 TOP/s int8, 16 GB HBM2 at
    819 GB/s. Vector rate is an estimate.
    """
    return _tpu("tpu-v5e", 197 * T, 394 * T, 0.819 * T, 16 * G, 6.1 * T, _tpu_v5e.__doc__ or "")


def _tpu_v5p() -> DeviceSpec:
    """Google TPU v5p (one chip, 2 TensorCores).

    Source: Google Cloud TPU v5p docs: 459 TFLOP/s bf16, 918 TOP/s int8, 95 GB HBM2e at
    2.765 TB/s. Vector rate is an estimate.
    """
    return _tpu("tpu-v5p", 459 * T, 918 * T, 2.765 * T, 95 * G, 14 * T, _tpu_v5p.__doc__ or "")


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (_h100_sxm(), _h200(), _a100_80gb(), _v100(), _tpu_v4(), _tpu_v5e(), _tpu_v5p())
}
"""Datasheet devices by name. ``cpu`` is resolved by :func:`tppc.cost_models.calibrate`."""


def _link(name: str, per_direction: float, latency: float, doc: str) -> LinkSpec:
    return LinkSpec(name=name, bandwidth=per_direction, latency=latency, description=doc)


LINK_PRESETS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        _link("nvlink1", 80 * G, 5e-6, "P100 NVLink 1.0: 4 links × 20 GB/s per direction."),
        _link("nvlink2", 150 * G, 5e-6, "V100 NVLink 2.0: 300 GB/s total, 150 per direction."),
        _link("nvlink3", 300 * G, 5e-6, "A100 NVLink 3.0: 600 GB/s total, 300 per direction."),
        _link("nvlink4", 450 * G, 5e-6, "H100 NVLink 4.0: 900 GB/s total, 450 per direction."),
        _link("pcie4", 32 * G, 10e-6, "PCIe Gen4 x16: about 32 GB/s per direction."),
        _link("pcie5", 64 * G, 10e-6, "PCIe Gen5 x16: about 64 GB/s per direction."),
        _link("ici-v4", 150 * G, 5e-6,
              "TPU v4 ICI, one neighbour in a chain; estimate (6 links/chip, 3-D torus)."),
        _link("ici-v5e", 200 * G, 5e-6, "TPU v5e ICI: 400 GB/s total per chip, 2-D torus."),
        _link("ici-v5p", 600 * G, 5e-6, "TPU v5p ICI: 1200 GB/s total per chip, 3-D torus."),
        _link("eth-100g", 12.5 * G, 10e-6, "100 Gb/s Ethernet with RDMA: 12.5 GB/s."),
        _link("eth-400g", 50 * G, 10e-6, "400 Gb/s Ethernet with RDMA: 50 GB/s."),
        _link("shm", 8 * G, 20e-6,
              "Same-host shared memory between processes or threads: a memcpy (~8 GB/s "
              "single-threaded) plus a hand-off of about 20 us."),
    )
}
"""Links by name; ``ici`` is an alias for the TPU generation's own ICI in cluster strings."""

DEFAULT_LINK: dict[str, str] = {
    "h100-sxm": "nvlink4",
    "h200": "nvlink4",
    "a100-80gb": "nvlink3",
    "v100": "nvlink2",
    "tpu-v4": "ici-v4",
    "tpu-v5e": "ici-v5e",
    "tpu-v5p": "ici-v5p",
    "cpu": "shm",
}
"""The link that joins two devices of a family when a cluster string names none."""
