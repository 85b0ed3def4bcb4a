"""Cluster strings and CPU calibration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tppc.cost_models import calibration as calibrate_module
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.specs import DeviceSpec, MatrixUnit, Memory, VectorUnit
from tppc.errors import SpecError


def test_homogeneous_cluster_uses_the_family_link():
    c = Cluster.parse("8xh100-sxm")
    assert c.device_names == ("h100-sxm",) * 8
    assert [link.name for link in c.links] == ["nvlink4"] * 7


def test_heterogeneous_chain_joins_groups_with_the_slower_link():
    c = Cluster.parse("2xh100-sxm+2xa100-80gb")
    assert c.device_names == ("h100-sxm", "h100-sxm", "a100-80gb", "a100-80gb")
    assert [link.name for link in c.links] == ["nvlink4", "nvlink3", "nvlink3"]


def test_tpu_cluster_uses_its_generation_ici():
    assert [link.name for link in Cluster.parse("4xtpu-v5p").links] == ["ici-v5p"] * 3
    assert Cluster.parse("2xtpu-v4@ici").links[0].name == "ici-v4"


def test_explicit_link_overrides_the_default():
    assert [link.name for link in Cluster.parse("4xa100-80gb@pcie4").links] == ["pcie4"] * 3


def test_cluster_string_round_trips():
    for text in ("8xh100-sxm@nvlink4", "2xh100-sxm@nvlink4+2xa100-80gb@pcie4", "1xtpu-v5e"):
        assert str(Cluster.parse(str(Cluster.parse(text)))) == str(Cluster.parse(text))


def test_cpu_cluster_uses_calibration(monkeypatch):
    fake = DeviceSpec(name="cpu", matrix=MatrixUnit(peak_flops={"fp32": 1e11}),
                      vector=VectorUnit(peak_flops=1e10),
                      memory=Memory(bandwidth=2e10, capacity=2**34), op_overhead=2e-6)
    monkeypatch.setattr(calibrate_module, "calibrate", lambda device, **kw: fake)
    c = Cluster.parse("2xcpu")
    assert c.devices == (fake, fake)
    assert c.links[0].name == "shm"


@pytest.mark.parametrize("text", ["8xh100", "2xh100-sxm@nvlink9", "", "3xh100-sxm++1xv100",
                                  "two x h100-sxm"])
def test_bad_cluster_string_lists_valid_presets_and_links(text):
    with pytest.raises(SpecError) as info:
        Cluster.parse(text)
    message = str(info.value)
    if text.strip():
        assert "h100-sxm" in message and "nvlink4" in message and "cpu" in message


def test_zero_count_is_rejected():
    with pytest.raises(SpecError, match="0 devices"):
        Cluster.parse("0xh100-sxm")


def test_real_calibration_is_measured_cached_and_forced_on_request(tmp_path, monkeypatch,
                                                                   real_calibration):
    monkeypatch.setenv("TPPC_CACHE_DIR", str(tmp_path))
    calls = []
    real = calibrate_module.measure_device

    def measure(device):
        calls.append(device)
        return {"fp32": 1e11, "half_rows": 8.0, "attention_efficiency": 0.7,
                "op_overhead": 1e-6, "bandwidth": 2e10, "vector": 5e9,
                "capacity": 2.0**34} if len(calls) > 1 else real(device)

    monkeypatch.setattr(calibrate_module, "measure_device", measure)
    first = calibrate_module.calibrate("cpu", threads=1)
    assert first.matrix.peak("fp32") > 1e9 and first.memory.bandwidth > 1e9
    assert first.matrix.half_rows > 0  # a 16-row matmul is slower per FLOP than a 512-row one
    assert 0 < first.attention_efficiency <= 1
    assert 1e-7 < first.op_overhead < 1e-3
    again = calibrate_module.calibrate("cpu", threads=1)
    assert again == first and len(calls) == 1
    files = list((tmp_path / "calibration").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["measured"]["fp32"] > 0
    forced = calibrate_module.calibrate("cpu", threads=1, force=True)
    assert len(calls) == 2 and forced.matrix.peak("fp32") == 1e11
    assert forced.matrix.half_rows == 8.0 and forced.attention_efficiency == 0.7


def test_stale_calibration_cache_is_measured_again(tmp_path, monkeypatch, real_calibration):
    monkeypatch.setenv("TPPC_CACHE_DIR", str(tmp_path))
    fake = {"fp32": 1e11, "half_rows": 8.0, "attention_efficiency": 0.7, "op_overhead": 1e-6,
            "bandwidth": 2e10, "vector": 5e9, "capacity": 2.0**34}
    monkeypatch.setattr(calibrate_module, "measure_device", lambda device: dict(fake))
    calibrate_module.calibrate("cpu", threads=1)
    path = next((tmp_path / "calibration").glob("*.json"))
    data = json.loads(path.read_text())
    data["schema"] -= 1
    data["measured"]["fp32"] = 3e9
    path.write_text(json.dumps(data))
    assert calibrate_module.calibrate("cpu", threads=1).matrix.peak("fp32") == 1e11


def test_a_pinned_calibration_is_used_without_measuring(tmp_path, monkeypatch):
    pinned = json.loads((Path(__file__).parents[1] / "data" / "cpu_calibration.json").read_text())
    pinned["2"]["measured"]["fp32"] = 1.25e11
    path = tmp_path / "pinned.json"
    path.write_text(json.dumps(pinned))
    monkeypatch.setenv("TPPC_CALIBRATION", str(path))
    monkeypatch.setattr(calibrate_module, "measure_device", lambda device: pytest.fail("measured"))
    assert calibrate_module.calibrate("cpu", co_running=2).matrix.peak("fp32") == 1.25e11
    assert calibrate_module.calibrate("cpu").matrix.peak("fp32") == \
        pinned["1"]["measured"]["fp32"]
    path.write_text("{not json")
    with pytest.raises(SpecError, match="TPPC_CALIBRATION=.*fix"):
        calibrate_module.calibrate("cpu")


def test_calibrate_rejects_unknown_device():
    with pytest.raises(SpecError, match="calibrate"):
        calibrate_module.calibrate("npu:0")


def test_a_weight_beyond_the_last_level_cache_pays_its_packing_pass_and_a_small_one_not():
    import sympy

    from tppc.cost_models.node_costs import C, NodeCost
    from tppc.cost_models.roofline import node_time_terms

    unit = MatrixUnit(peak_flops={"fp32": 1e11}, cache_bytes=32 * 2**20, stream_bandwidth=1e10)
    spec = DeviceSpec(name="cpu", matrix=unit, vector=VectorUnit(peak_flops=1e10),
                      memory=Memory(bandwidth=4e10, capacity=2**34))

    def linear(n: int, k: int) -> NodeCost:
        mm = ((sympy.Integer(1), C, sympy.Integer(n), sympy.Integer(k)),)
        return NodeCost("x", "linear", "matrix", 2 * C * n * k, mm, sympy.Integer(0),
                        sympy.Integer(4 * n * k), "fp32")

    head = node_time_terms(linear(32000, 768), spec)  # 98 MB of weight: streamed
    block = node_time_terms(linear(2048, 768), spec)  # 6 MB: packed from the cache
    assert float(head.serial) == pytest.approx(4 * 32000 * 768 / 1e10)
    assert block.serial == 0
    plain = dataclasses.replace(spec, matrix=MatrixUnit(peak_flops={"fp32": 1e11}))
    assert node_time_terms(linear(32000, 768), plain).serial == 0  # presets: no such pass
