"""Preset device and link specs, with their sources.

Peaks are dense (no sparsity) datasheet numbers; GPUs also carry the fractions of them that
real kernels sustain (:mod:`.gpu_presets`, each with its source), so a prediction is what
eager PyTorch achieves, not the peak. TPUs keep their datasheet matrix rate (no public
per-matmul measurement found) and fuse elementwise work (XLA). Links carry measured
point-to-point bandwidth and small-message latency. The ``cpu`` device is not here: it is
measured (see :mod:`.calibration`).

Example:
    >>> DEVICE_PRESETS["h100-sxm"].ridge_point("bf16")  # FLOP per byte
    295.2...
"""

from __future__ import annotations

from tppc.cost_models.gpu_presets import GPU_DEVICES
from tppc.cost_models.specs import DeviceSpec, LinkSpec, MatrixUnit, Memory, VectorUnit

__all__ = ["DEFAULT_LINK", "DEVICE_PRESETS", "LINK_PRESETS"]

T = 1e12
G = 1e9
GIB = 2**30

def _tpu(name: str, bf16: float, int8: float, bw: float, cap: int, vec: float, doc: str,
         mxu: int = 128) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        # fp32 matmuls at HIGHEST precision take 6 bf16 passes on the MXU; XLA pads matmul
        # operands to the MXU's side (128, or 256 on v6e).
        matrix=MatrixUnit(peak_flops={"bf16": bf16, "fp32": bf16 / 6, "int8": int8},
                          tile_m=mxu, tile_n=mxu, tile_k=mxu),
        vector=VectorUnit(peak_flops=vec),
        # HBM copies sustain ~90 % of the datasheet (as on GPUs, [STREAM] in .gpu_presets).
        memory=Memory(bandwidth=bw, capacity=cap, efficiency=0.9),
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


def _tpu_v6e() -> DeviceSpec:
    """Google TPU v6e Trillium (one chip, 1 TensorCore, 256×256 MXUs).

    Source: Google Cloud TPU v6e docs: 918 TFLOP/s bf16, 1836 TOP/s int8, 32 GB HBM at
    1640 GB/s, ICI 3584 Gb/s per chip. Vector rate is an estimate.
    """
    return _tpu("tpu-v6e", 918 * T, 1836 * T, 1.64 * T, 32 * G, 28 * T,
                _tpu_v6e.__doc__ or "", mxu=256)


DEVICE_PRESETS: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (*GPU_DEVICES, _tpu_v4(), _tpu_v5e(), _tpu_v5p(), _tpu_v6e())
}
"""Datasheet devices by name. ``cpu`` is resolved by :func:`tppc.cost_models.calibrate`."""


def _link(name: str, per_direction: float, latency: float, doc: str) -> LinkSpec:
    return LinkSpec(name=name, bandwidth=per_direction, latency=latency, description=doc)


LINK_PRESETS: dict[str, LinkSpec] = {
    link.name: link
    for link in (
        _link("nvlink1", 80 * G, 5e-6, "P100 NVLink 1.0: 4 links × 20 GB/s per direction."),
        _link("nvlink2", 130 * G, 8e-6,
              "V100 NVLink 2.0: 150 GB/s per direction datasheet; ~130 achieved in NCCL "
              "p2p (estimate, 87 % as on NVLink 3)."),
        _link("nvlink3", 260 * G, 8e-6,
              "A100 NVLink 3.0: 300 GB/s per direction datasheet; nccl-tests sendrecv / "
              "all_reduce busbw ~230-260 GB/s on DGX A100; NCCL small-message latency "
              "~8 us."),
        _link("nvlink4", 370 * G, 8e-6,
              "H100 NVLink 4.0: 450 GB/s per direction datasheet; nccl-tests all_reduce "
              "busbw ~360-380 GB/s on 8×H100 SXM; NCCL latency ~8 us."),
        _link("nvlink5", 740 * G, 8e-6,
              "B200 NVLink 5.0: 900 GB/s per direction datasheet; ~740 achieved (estimate: "
              "NVLink 4's 82 %)."),
        _link("pcie4", 25 * G, 15e-6,
              "PCIe Gen4 x16: 32 GB/s raw per direction, ~25 GB/s GPU-to-GPU "
              "(p2pBandwidthLatencyTest unidirectional, A100 PCIe); NCCL p2p small-message "
              "latency ~15 us through the host bridge."),
        _link("pcie5", 50 * G, 15e-6,
              "PCIe Gen5 x16: 64 GB/s raw per direction, ~50 achieved (PCIe 4's 78 %)."),
        _link("xgmi", 48 * G, 10e-6,
              "AMD Infinity Fabric (MI300X): 64 GB/s per direction between each pair of 8 "
              "GPUs; RCCL p2p ~48 achieved (estimate, 75 %)."),
        _link("ici-v4", 150 * G, 5e-6,
              "TPU v4 ICI, one neighbour in a chain; estimate (6 links/chip, 3-D torus)."),
        _link("ici-v5e", 200 * G, 5e-6, "TPU v5e ICI: 400 GB/s total per chip, 2-D torus."),
        _link("ici-v5p", 600 * G, 5e-6, "TPU v5p ICI: 1200 GB/s total per chip, 3-D torus."),
        _link("ici-v6e", 224 * G, 5e-6,
              "TPU v6e ICI: 3584 Gb/s = 448 GB/s total per chip, 2-D torus."),
        _link("eth-100g", 12.5 * G, 10e-6, "100 Gb/s Ethernet with RDMA: 12.5 GB/s."),
        _link("eth-400g", 50 * G, 10e-6, "400 Gb/s Ethernet with RDMA: 50 GB/s."),
        _link("ib-ndr", 50 * G, 10e-6,
              "NDR InfiniBand (ConnectX-7, 400 Gb/s = 50 GB/s per direction), one NIC per GPU "
              "(rail-optimised HGX nodes); latency: NCCL's own model charges a network hop "
              "2.7 us (LL) to 9.6 us (Simple) per ring step (src/graph/tuning.cc, hwLat NET); "
              "taken as 10 us, as the RDMA Ethernet presets."),
        _link("ib-hdr", 25 * G, 10e-6,
              "HDR InfiniBand (ConnectX-6, 200 Gb/s = 25 GB/s per direction), one NIC per GPU; "
              "latency as ib-ndr (NCCL's hwLat NET does not depend on the generation)."),
        _link("shm", 8 * G, 20e-6,
              "Same-host shared memory between processes or threads: a memcpy (~8 GB/s "
              "single-threaded) plus a hand-off of about 20 us."),
    )
}
"""Links by name; ``ici`` is an alias for the TPU generation's own ICI in cluster strings."""

DEFAULT_LINK: dict[str, str] = {
    "h100-sxm": "nvlink4",
    "h200": "nvlink4",
    "h20": "nvlink4",
    "b200": "nvlink5",
    "a100-80gb": "nvlink3",
    "a100-pcie": "pcie4",
    "v100": "nvlink2",
    "l40s": "pcie4",
    "l20": "pcie4",
    "mi300x": "xgmi",
    "tpu-v4": "ici-v4",
    "tpu-v5e": "ici-v5e",
    "tpu-v5p": "ici-v5p",
    "tpu-v6e": "ici-v6e",
    "cpu": "shm",
}
"""The link that joins two devices of a family when a cluster string names none."""
