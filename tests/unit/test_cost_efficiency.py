"""Achieved-efficiency curves of the GPU presets (tppc/cost_models/efficiency.py) and the
presets' sources."""

from __future__ import annotations

import re

import numpy as np
import pytest
import sympy

from tppc.cost_models.efficiency import (
    attention_efficiency,
    attention_seconds,
    gemm_efficiency,
    wave_flops,
)
from tppc.cost_models.gpu_presets import GPU_DEVICES
from tppc.cost_models.presets import DEFAULT_LINK, DEVICE_PRESETS, LINK_PRESETS
from tppc.cost_models.specs import MatrixUnit
from tppc.errors import SpecError

GPUS = [d.name for d in GPU_DEVICES]
A100 = DEVICE_PRESETS["a100-80gb"]


def test_a100_wave_quantisation_matches_nvidias_109_tile_example():
    # NVIDIA's Matrix Multiplication guide (§3.2): on 108 SMs, 109 tiles take two full waves
    unit = A100.matrix
    m, n, k = 109 * unit.tile_m, unit.tile_n, 4096
    assert gemm_efficiency(m, n, k, unit) == pytest.approx(unit.efficiency * 109 / 216)
    assert gemm_efficiency(108 * unit.tile_m, n, k, unit) == pytest.approx(unit.efficiency)


@pytest.mark.parametrize("name", GPUS)
def test_gemm_time_is_monotone_and_efficiency_saturates_at_the_measured_asymptote(name):
    unit = DEVICE_PRESETS[name].matrix
    n = k = 4096
    rows = np.unique(np.geomspace(1, 1 << 17, 200).astype(int))
    eff = np.array([gemm_efficiency(int(m), n, k, unit) for m in rows])
    seconds = 2.0 * rows * n * k / (eff * unit.peak("fp16"))
    assert np.all(np.diff(seconds) >= -1e-15)  # more rows never cost less
    assert np.all(eff <= unit.efficiency + 1e-12)
    assert eff[-1] >= 0.97 * unit.efficiency  # large GEMMs reach the measured rate
    assert gemm_efficiency(16, n, k, unit) < 0.25 * unit.efficiency  # skinny: far from it
    # the best efficiency reached so far never drops: the envelope is monotone
    assert np.all(np.diff(np.maximum.accumulate(eff)) >= 0)


def test_splitting_a_gemm_never_costs_less_than_the_whole():
    unit = A100.matrix
    c = sympy.Symbol("c", positive=True)
    fn = sympy.lambdify(c, wave_flops(1, c, 1152, 1152, unit))
    for parts in ([1, 2047], [100, 4000, 3], [128] * 32, [4096, 4096]):
        assert sum(fn(p) for p in parts) >= fn(sum(parts))


def test_fa2_curve_reproduces_the_papers_a100_rates():
    # FlashAttention-2, Fig. 4 (A100 SXM4, forward, non-causal, long sequences): about 178
    # TFLOP/s at head dim 64 and 225 at head dim 128
    for head_dim, published in ((64, 178e12), (128, 225e12)):
        eff = attention_efficiency(16384, 16384, head_dim, A100, heads=16)
        assert eff * 312e12 == pytest.approx(published, rel=0.03)


def test_attention_short_key_ranges_follow_the_published_h100_curve():
    # pytorch/benchmark PR 2391 (H100, head dim 128, batch*seq = 16k): 329 TFLOP/s at 512
    # keys against 477 at 16384 (Triton FA2); the ratio is what the per-tile cost gives
    h100 = DEVICE_PRESETS["h100-sxm"]
    short = attention_efficiency(512, 512, 128, h100, heads=32 * 16)
    long = attention_efficiency(16384, 16384, 128, h100, heads=16)
    assert short / long == pytest.approx(329 / 477, rel=0.05)


@pytest.mark.parametrize("name", GPUS)
def test_attention_efficiency_grows_with_keys_and_head_dim_and_stays_below_asymptote(name):
    dev = DEVICE_PRESETS[name]
    by_keys = [attention_efficiency(4096, k, 128, dev, heads=32) for k in
               (128, 512, 2048, 8192, 32768)]
    assert np.all(np.diff(by_keys) > 0)
    by_dim = [attention_efficiency(4096, 4096, d, dev, heads=32) for d in (32, 64, 96, 128)]
    assert np.all(np.diff(by_dim) > 0)
    assert max(by_keys + by_dim) <= dev.attention_efficiency
    # a head dim between two compiled sizes pays the larger one: 72 runs as 96
    assert attention_efficiency(4096, 4096, 72, dev, heads=32) < \
        attention_efficiency(4096, 4096, 64, dev, heads=32)


def test_causal_attention_is_priced_without_waves_and_never_below_its_flops():
    c = sympy.Integer(1024)
    mm = ((16, c, (c + 1) / 2, 64), (16, c, 64, (c + 1) / 2))
    seconds = float(attention_seconds(mm, A100, causal=True))
    assert seconds * A100.matrix.peak("fp16") * A100.attention_efficiency > \
        4 * 16 * 1024 * 512.5 * 64


@pytest.mark.parametrize("name", GPUS)
def test_gpu_presets_cite_their_sources_and_have_sane_values(name):
    dev = DEVICE_PRESETS[name]
    doc = dev.description
    assert "Source: datasheet" in doc and "Achieved" in doc
    assert re.search(r"\[(MAMF|FA2|TB)\]|estimate|measured", doc), doc
    assert 0.5 <= dev.matrix.efficiency <= 0.95
    assert 50 <= dev.matrix.units <= 400
    assert 0.3 <= dev.attention_efficiency <= 1.0
    assert 0.7 <= dev.memory.efficiency <= 0.95
    assert 1e-6 <= dev.host_overhead <= 25e-6 and dev.op_overhead <= dev.host_overhead
    assert 50e12 <= dev.matrix.peak("fp16") <= 5e15
    assert 0.5e12 <= dev.memory.bandwidth <= 10e12
    assert dev.name in DEFAULT_LINK


def test_every_preset_and_link_has_a_description_and_achieved_links_stay_under_datasheet():
    for dev in DEVICE_PRESETS.values():
        assert len(dev.description) > 40
        assert dev.name in DEFAULT_LINK and DEFAULT_LINK[dev.name] in LINK_PRESETS
    datasheet = {"nvlink2": 150e9, "nvlink3": 300e9, "nvlink4": 450e9, "nvlink5": 900e9,
                 "pcie4": 32e9, "pcie5": 64e9, "xgmi": 64e9}
    for name, peak in datasheet.items():
        link = LINK_PRESETS[name]
        assert 0.6 * peak <= link.bandwidth < peak and 1e-6 <= link.latency <= 50e-6


def test_efficiency_fields_are_validated():
    with pytest.raises(SpecError, match="efficiency must be in"):
        MatrixUnit(peak_flops={"fp16": 1e12}, efficiency=1.5)
    with pytest.raises(SpecError, match="units must be an integer"):
        MatrixUnit(peak_flops={"fp16": 1e12}, units=-1)


def test_new_presets_parse_in_cluster_strings():
    from tppc.cost_models.cluster import Cluster

    for text, link in (("4xl40s", "pcie4"), ("8xb200", "nvlink5"), ("8xmi300x", "xgmi"),
                       ("4xtpu-v6e", "ici-v6e"), ("2xl20", "pcie4"), ("4xa100-pcie", "pcie4")):
        assert {lk.name for lk in Cluster.parse(text).links} == {link}


def test_cross_attention_to_text_is_priced_over_the_text_tokens_not_the_image():
    # PixArt's cross-attention reads K/V of the 6 text tokens (const: no token axis); it
    # used to be priced as causal self-attention over the image's tokens
    pytest.importorskip("diffusers")
    from tppc.cost_models.layer_costs import layer_expressions
    from tppc.cost_models.node_costs import C, P
    from tppc.examples import hf_pixart
    from tppc.frontend.annotate import annotate, program_of

    model, args, kwargs = hf_pixart(size=8, layers=2, text_len=6)
    gm, ctx = annotate(model, args, kwargs)
    exprs = layer_expressions(program_of(gm, ctx), ctx.layers, A100, 16,
                              seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    cross = [n for e in exprs for n in e.nodes
             if n.kind == "attention" and n.op != "chunk_attention"]
    assert cross
    for node in cross:
        (_, _, keys, _), _ = node.matmuls
        assert keys == 6 and not node.causal_keys
        assert node.matrix_flops.subs(P, 0) == node.matrix_flops.subs(P, 8)
        assert node.matrix_flops.has(C)
