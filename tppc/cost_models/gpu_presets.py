"""GPU presets: datasheet peaks, and what eager PyTorch kernels achieve on them.

Each device states its datasheet numbers (peak FLOP/s per dtype, memory) and the measured
fractions of them that :mod:`.efficiency` applies. Sources, cited per device below:

    [MAMF] S. Bekman, *Machine Learning Engineering*, compute/accelerator/README.md,
        "Maximum Achievable Matmul FLOPS comparison table" (bf16 matmul, best shape; A100
        SXM 267.9, A100 PCIe 256.4, H100 SXM 792.1, H100/H200 SXM 794.5, B200 SXM 1745,
        MI300X 781.9 TFLOP/s).
    [MMG] NVIDIA, *Matrix Multiplication Background User's Guide* (DU-09799-001), §2.3
        cuBLAS tiles (64×64 up to 256×128), §3.1 tile and §3.2 wave quantisation over the
        SMs (on an A100's 108 SMs, 109 tiles take as long as 216).
    [FA2] T. Dao, *FlashAttention-2* (2023), Fig. 4: forward pass on A100 80GB SXM4, fp16,
        non-causal: about 178 TFLOP/s at head dim 64 and 225 at head dim 128 for long
        sequences. Head dims are padded to the next compiled size, a multiple of 32 up to
        128 (``flash_api.cpp``: ``round_multiple(head_size, 32)``).
    [TB] pytorch/benchmark PR 2391 (H100, fp16, head dim 128, batch·seq = 16k): Triton
        FA2 329 → 477 TFLOP/s and FA3 430 → 621 from 512 to 16384 keys; both fit
        ``R·keys/(keys + 240)`` within 2 %: a query tile pays about 240 keys of fixed cost.
    [HOST] per-op issue cost of eager PyTorch from Python: "~5-25 µs of CPU-side work per
        op" (jiahuanglin.xyz, GPU kernel serving, lesson 18 "From PyTorch op to kernel
        launch"); a bare aten op measures ~4 µs, one replayed in a CUDA graph ~1.3 µs of
        device-side gap. Taken for all GPUs: 15 µs host (the range's middle: diffusers'
        ops go through ``nn.Module`` calls and attention processors), 1.5 µs gap.
    [STREAM] copy kernels sustain about 90 % of the HBM/GDDR datasheet bandwidth on NVIDIA
        parts (BabelStream-style copies; e.g. 3.57 of 3.94 TB/s on an H100 NVL).

The FA2 curve (asymptote, d½) is fitted once on [FA2]'s two head dims: 0.98 of peak and
d½ = 46; the A100 PCIe part runs it ``256.4 / 267.9`` slower (its [MAMF] ratio: the same
cores at a lower sustained clock under its 300 W cap). Devices without a published attention
measurement reuse the curve of their architecture, marked ``estimate``.
"""

from __future__ import annotations

from dataclasses import replace

from tppc.cost_models.specs import DeviceSpec, MatrixUnit, Memory, VectorUnit

__all__ = ["GPU_DEVICES"]

T = 1e12
G = 1e9

_TILE = {"tile_m": 64, "tile_n": 64, "tile_k": 16}
"""The quantisation grain: 64×64 is the smallest CTA tile cuBLAS picks ([MMG] §2.3); it
picks larger tiles when they fill the SMs, so counting waves of the smallest tile charges the
tail a large tile would leave idle only where no tile choice avoids it. A wave of 64×64
tiles keeps the cost subadditive (two chunks never cost less than their union), which the
planner's bounds need; split-K, which cuBLAS uses to fill the SMs on skinny GEMMs, would
break that and is not modelled (skinny GEMMs are weight-streaming bound anyway)."""
_EAGER = {"op_overhead": 1.5e-6, "host_overhead": 15e-6}
"""[HOST]: device-side gap per kernel, host-side issue per eager op (overlapped)."""
_FA2 = {"attention_dim_tile": 32, "attention_half_dim": 46.0, "attention_half_keys": 240.0}
"""[FA2] head-dim padding and curve, [TB] per-tile fixed cost in keys."""
_HBM = 0.9
"""[STREAM]."""


def _nvidia(name: str, peaks: dict[str, float], fp32: float, bandwidth: float,
            capacity: float, sms: int, gemm: float, attention: float, doc: str,
            memory_efficiency: float = _HBM) -> DeviceSpec:
    return DeviceSpec(
        name=name,
        matrix=MatrixUnit(peak_flops=peaks, efficiency=gemm, units=sms, **_TILE),
        vector=VectorUnit(peak_flops=fp32),
        memory=Memory(bandwidth=bandwidth, capacity=int(capacity),
                      efficiency=memory_efficiency),
        attention_efficiency=attention, description=doc, **_EAGER, **_FA2)


def _a100_80gb() -> DeviceSpec:
    """NVIDIA A100 SXM4 80GB, 108 SMs.

    Source: datasheet (2021): 312 TFLOP/s bf16/fp16 dense, 624 int8, 156 tf32, 19.5 fp32; HBM2e
    2.039 TB/s. No fp8 (runs at the fp16 rate). Achieved: GEMM 0.859 ([MAMF] 267.9/312);
    attention 0.98·d/(d+46) ([FA2]); [STREAM] 0.9 of the bandwidth.
    """
    return _nvidia("a100-80gb", {"fp32": 19.5 * T, "tf32": 156 * T, "bf16": 312 * T,
                                 "fp16": 312 * T, "int8": 624 * T},
                   19.5 * T, 2.039 * T, 80 * G, 108, 0.859, 0.98, _a100_80gb.__doc__ or "")


def _a100_pcie() -> DeviceSpec:
    """NVIDIA A100 80GB PCIe (300 W), 108 SMs.

    Source: datasheet (2021): the SXM4 part's peaks, HBM2e 1.935 TB/s. Achieved: GEMM 0.822
    ([MAMF] A100 PCIe 256.4/312); attention: the SXM4 curve × 256.4/267.9 (the same
    kernels at the PCIe part's lower sustained clock, per [MAMF]).
    """
    sxm = _a100_80gb()
    clock = 256.4 / 267.9
    return replace(sxm, name="a100-pcie",
                   matrix=replace(sxm.matrix, efficiency=0.822),
                   memory=replace(sxm.memory, bandwidth=1.935 * T),
                   attention_efficiency=round(sxm.attention_efficiency * clock, 4),
                   description=_a100_pcie.__doc__ or "")


def _h100_sxm() -> DeviceSpec:
    """NVIDIA H100 SXM5 80GB, 132 SMs.

    Source: datasheet (2023): 989 TFLOP/s bf16/fp16 dense, 1979 fp8/int8, 495 tf32, 67 fp32; HBM3
    3.35 TB/s. Achieved: GEMM 0.801 ([MAMF] 792.1/989); attention: eager SDPA runs
    FA2-class kernels, [TB] Triton FA2 484 TFLOP/s asymptote at head dim 128 = 0.489 of
    peak, on [FA2]'s d½ = 46: asymptote 0.665.
    """
    return _nvidia("h100-sxm", {"fp32": 67 * T, "tf32": 495 * T, "bf16": 989 * T,
                                "fp16": 989 * T, "fp8": 1979 * T, "int8": 1979 * T},
                   67 * T, 3.35 * T, 80 * G, 132, 0.801, 0.665, _h100_sxm.__doc__ or "")


def _h200() -> DeviceSpec:
    """NVIDIA H200 SXM 141GB, 132 SMs.

    Source: datasheet (2024): H100 SXM's tensor cores (989 TFLOP/s bf16 dense); HBM3e 4.8 TB/s.
    Achieved: GEMM 0.803 ([MAMF] H100/H200 SXM 794.5/989); attention as H100 (estimate).
    """
    h100 = _h100_sxm()
    return replace(h100, name="h200", matrix=replace(h100.matrix, efficiency=0.803),
                   memory=replace(h100.memory, bandwidth=4.8 * T, capacity=141 * 10**9),
                   description=_h200.__doc__ or "")


def _h20() -> DeviceSpec:
    """NVIDIA H20 96GB (Hopper, export-limited, 400 W), 78 SMs.

    Source: datasheet (2024): 148 TFLOP/s fp16/bf16 dense, 296 fp8/int8, 74 tf32, 44 fp32;
    HBM3 96 GB at 4.0 TB/s; NVLink 4 at 900 GB/s total (450 per direction, ``nvlink4``).
    Achieved: GEMM 0.8 and attention as H100 (estimates: no public MAMF for the part).
    """
    return _nvidia("h20", {"fp32": 44 * T, "tf32": 74 * T, "bf16": 148 * T, "fp16": 148 * T,
                           "fp8": 296 * T, "int8": 296 * T},
                   44 * T, 4.0 * T, 96 * G, 78, 0.8, 0.665, _h20.__doc__ or "")


def _b200() -> DeviceSpec:
    """NVIDIA B200 SXM 180GB (HGX, 1000 W), 148 SMs.

    Source: datasheet (HGX B200, 2024): 2.25 PFLOP/s bf16/fp16 dense, 4.5 fp8, 1.1 tf32, 75 fp32;
    HBM3e 8 TB/s, 180 GB. Achieved: GEMM 0.776 ([MAMF] 1745/2250); attention: H100's
    FA2-class fraction (estimate; no public Blackwell SDPA table found).
    """
    return _nvidia("b200", {"fp32": 75 * T, "tf32": 1100 * T, "bf16": 2250 * T,
                            "fp16": 2250 * T, "fp8": 4500 * T, "int8": 4500 * T},
                   75 * T, 8 * T, 180 * G, 148, 0.776, 0.665, _b200.__doc__ or "")


def _v100() -> DeviceSpec:
    """NVIDIA V100 SXM2 32GB, 80 SMs.

    Source: datasheet (2018): 125 TFLOP/s fp16 tensor, 15.7 fp32; HBM2 0.9 TB/s. No bf16 tensor
    cores (bf16 runs at the fp32 rate). Achieved: GEMM 0.8 and attention 0.5 of the FA2
    curve (estimates: no public MAMF; FlashAttention-2 does not support Volta, SDPA runs
    the memory-efficient kernel).
    """
    return _nvidia("v100", {"fp32": 15.7 * T, "fp16": 125 * T}, 15.7 * T, 0.9 * T, 32 * G,
                   80, 0.8, 0.5, _v100.__doc__ or "")


def _l40s() -> DeviceSpec:
    """NVIDIA L40S 48GB (Ada, 350 W), 142 SMs.

    Source: datasheet (2023): 362 TFLOP/s fp16/bf16 dense tensor (fp32 accumulate), 733 fp8/int8,
    183 tf32, 91.6 fp32; GDDR6 864 GB/s. Achieved: GEMM 0.7 (estimate: no public MAMF; the
    part is power-capped far below its datasheet clock); attention: the A100 FA2 curve × 0.7
    / 0.859 (estimate).
    """
    return _nvidia("l40s", {"fp32": 91.6 * T, "tf32": 183 * T, "bf16": 362 * T,
                            "fp16": 362 * T, "fp8": 733 * T, "int8": 733 * T},
                   91.6 * T, 0.864 * T, 48 * G, 142, 0.7, 0.8, _l40s.__doc__ or "")


def _l20() -> DeviceSpec:
    """NVIDIA L20 48GB (Ada), 92 SMs.

    Source: datasheet (2023): 119.5 TFLOP/s fp16/bf16 dense tensor, 239 fp8, 59.8 tf32/fp32; GDDR6
    864 GB/s. Achieved: GEMM 0.92 (cuBLAS 105-115 TFLOP/s measured on an L20 in
    DefTruth/CUDA-Learn-Notes, hgemm/README.md); attention: [FA2] curve (estimate).
    """
    return _nvidia("l20", {"fp32": 59.8 * T, "tf32": 59.8 * T, "bf16": 119.5 * T,
                           "fp16": 119.5 * T, "fp8": 239 * T, "int8": 239 * T},
                   59.8 * T, 0.864 * T, 48 * G, 92, 0.92, 0.98, _l20.__doc__ or "")


def _mi300x() -> DeviceSpec:
    """AMD Instinct MI300X 192GB, 304 CUs.

    Source: datasheet (2023): 1307 TFLOP/s fp16/bf16 dense, 2615 fp8/int8, 654 tf32, 163 fp32
    matrix; HBM3 5.3 TB/s. Achieved: GEMM 0.598 ([MAMF] 781.9, ROCm 6.2); attention: CK
    FlashAttention at 0.6 of the FA2 curve's fraction (estimate); memory 0.8 (estimate).
    """
    return _nvidia("mi300x", {"fp32": 163.4 * T, "tf32": 653.7 * T, "bf16": 1307.4 * T,
                              "fp16": 1307.4 * T, "fp8": 2614.9 * T, "int8": 2614.9 * T},
                   81.7 * T, 5.3 * T, 192 * G, 304, 0.598, 0.6, _mi300x.__doc__ or "",
                   memory_efficiency=0.8)


GPU_DEVICES: tuple[DeviceSpec, ...] = (
    _h100_sxm(), _h200(), _h20(), _b200(), _a100_80gb(), _a100_pcie(), _v100(), _l40s(), _l20(),
    _mi300x())
"""Every GPU preset, achieved rates included."""
