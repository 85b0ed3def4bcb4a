"""Hardware specs and presets: validation, dtype fallback, ridge points, sources."""

from __future__ import annotations

import pytest

from tppc.cost_models.presets import DEVICE_PRESETS, LINK_PRESETS
from tppc.cost_models.specs import DeviceSpec, LinkSpec, MatrixUnit, Memory, VectorUnit
from tppc.errors import SpecError


def test_matrix_unit_rejects_zero_rate():
    with pytest.raises(SpecError, match=r"peak_flops\['bf16'\].*0"):
        MatrixUnit(peak_flops={"bf16": 0})


def test_matrix_unit_rejects_tile_below_one():
    with pytest.raises(SpecError, match="tile_m must be an integer >= 1, got 0"):
        MatrixUnit(peak_flops={"fp32": 1e12}, tile_m=0)


def test_matrix_unit_rejects_unknown_dtype():
    with pytest.raises(SpecError, match="unknown dtype 'fp64'"):
        MatrixUnit(peak_flops={"fp64": 1e12})


def test_memory_rejects_negative_bandwidth():
    with pytest.raises(SpecError, match="bandwidth must be a positive"):
        Memory(bandwidth=-1.0, capacity=10)


def test_vector_unit_rejects_nan():
    with pytest.raises(SpecError, match="VectorUnit"):
        VectorUnit(peak_flops=float("nan"))


def test_link_rejects_zero_bandwidth_and_negative_latency():
    with pytest.raises(SpecError, match="LinkSpec 'x'.*bandwidth"):
        LinkSpec(name="x", bandwidth=0, latency=0)
    with pytest.raises(SpecError, match="latency must be >= 0"):
        LinkSpec(name="x", bandwidth=1e9, latency=-1e-6)


def test_device_rejects_negative_overhead():
    with pytest.raises(SpecError, match="op_overhead"):
        DeviceSpec(name="d", matrix=MatrixUnit(peak_flops={"fp32": 1.0}),
                   vector=VectorUnit(peak_flops=1.0), memory=Memory(bandwidth=1.0, capacity=1),
                   op_overhead=-1.0)


def test_missing_dtype_falls_back_to_a_supported_rate():
    a100 = DEVICE_PRESETS["a100-80gb"]
    assert a100.matrix.peak("fp8") == a100.matrix.peak("fp16")
    v100 = DEVICE_PRESETS["v100"]
    assert v100.matrix.peak("bf16") == pytest.approx(125e12)  # runs on the fp16 tensor cores


def test_bf16_model_uses_bf16_rate_on_fp8_device():
    h100 = DEVICE_PRESETS["h100-sxm"]
    assert h100.matrix.peak("bf16") == pytest.approx(989e12)
    assert h100.matrix.peak("fp8") == pytest.approx(1979e12)


def test_h100_bf16_ridge_point_is_about_295():
    assert DEVICE_PRESETS["h100-sxm"].ridge_point("bf16") == pytest.approx(295, rel=0.01)


def test_tpu_presets_have_128_by_128_mxu():
    for name in ("tpu-v4", "tpu-v5e", "tpu-v5p"):
        unit = DEVICE_PRESETS[name].matrix
        assert (unit.tile_m, unit.tile_n, unit.tile_k) == (128, 128, 128)


def test_every_preset_names_its_source():
    for spec in DEVICE_PRESETS.values():
        assert "Source" in spec.description, spec.name
    for link in LINK_PRESETS.values():
        assert link.description, link.name


def test_matrix_unit_rejects_negative_half_rows():
    with pytest.raises(SpecError, match="half_rows must be >= 0 rows, got -1"):
        MatrixUnit(peak_flops={"fp32": 1e11}, half_rows=-1)


@pytest.mark.parametrize("value", [0, 1.5, float("nan")])
def test_device_rejects_attention_efficiency_outside_zero_one(value):
    with pytest.raises(SpecError, match="attention_efficiency must be in"):
        DeviceSpec(name="x", matrix=MatrixUnit(peak_flops={"fp32": 1e11}),
                   vector=VectorUnit(peak_flops=1e10),
                   memory=Memory(bandwidth=1e10, capacity=2**30), attention_efficiency=value)
