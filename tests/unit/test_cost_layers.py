"""Layer costs and the cost table, on HF Llama graphs annotated by tppc's own passes."""

from __future__ import annotations

import numpy as np
import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst
from transformers import LlamaConfig, LlamaForCausalLM

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.layer_costs import build_cost_table, layer_expressions
from tppc.cost_models.node_costs import C, P
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.frontend.annotate import annotate_program

D, FF, H, KV, HD, VOCAB = 64, 128, 4, 2, 16, 128


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF,
                      num_hidden_layers=3, num_attention_heads=H, num_key_value_heads=KV,
                      max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    return annotate_program(model, (torch.randint(0, VOCAB, (1, 32)),))


def _exprs(llama, device="h100-sxm"):
    gm, ctx = llama
    return layer_expressions(gm, ctx.layers, DEVICE_PRESETS[device], 1024,
                             seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)


def test_llama_block_matrix_flops_match_hand_formula(llama):
    block = next(e for e in _exprs(llama) if e.info.kind == "block")
    projections = D * D + 2 * D * KV * HD + D * D + 3 * D * FF  # q, k, v, o, gate/up/down
    attention = 4 * H * HD * (P * C + C * (C + 1) / 2)  # QK^T and PV over the visited keys
    assert sympy.expand(block.matrix_flops - (2 * C * projections + attention)) == 0


_TABLES: dict = {}


@settings(max_examples=40, deadline=None)
@given(hst.lists(hst.integers(1, 24), min_size=1, max_size=8),
       hst.sampled_from(["h100-sxm", "tpu-v5p", "v100"]), hst.sampled_from([1, 16, 128]))
def test_any_split_of_a_causal_layer_costs_at_least_one_chunk(llama, parts, device, unit):
    if device not in _TABLES:
        gm, ctx = llama
        _TABLES[device] = build_cost_table(gm, ctx.layers, f"1x{device}", 1 << 16,
                                           seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    table = _TABLES[device]
    bounds = np.cumsum([0, *parts]) * unit
    c, p = np.diff(bounds).astype(float), bounds[:-1].astype(float)
    whole = np.array([float(bounds[-1])]), np.zeros(1)
    for layer in table.layers[0]:
        assert layer.time(c, p).sum() >= layer.time(*whole)[0] * (1 - 1e-12)
    block = next(e for e in _exprs(llama, device) if e.info.kind == "block")
    flops = sympy.lambdify((C, P), block.matrix_flops)
    assert sum(flops(ci, pi) for ci, pi in zip(c, p)) == pytest.approx(flops(bounds[-1], 0))


def test_llama_block_memory_needs(llama):
    block = next(e for e in _exprs(llama) if e.info.kind == "block")
    assert block.weight_bytes == 4 * (2 * D * D + 2 * D * KV * HD + 3 * D * FF + 2 * D)
    # K and V buffers hold the model's KV heads (before the GQA repeat), fp32
    assert block.kv_bytes_per_token == 2 * KV * HD * 4
    assert block.act_bytes_per_token == D * 4
    # live at the MLP's product: silu(gate), up and their product (3 intermediates), and
    # the residual stream the block adds them to at its end
    assert block.peak_bytes_per_token == (3 * FF + D) * 4


def test_identical_blocks_share_one_compiled_function(llama):
    blocks = [e for e in _exprs(llama) if e.info.kind == "block"]
    assert len(blocks) == 3 and len({id(e.fn) for e in blocks}) == 1


def test_cost_table_prices_every_device_and_link(llama):
    gm, ctx = llama
    table = build_cost_table(gm, ctx.layers, Cluster.parse("2xh100-sxm+1xa100-80gb@pcie4"),
                             1024, seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
    assert table.device_names == ("h100-sxm", "h100-sxm", "a100-80gb")
    assert table.num_layers == len(ctx.layers) and table.causal
    # achieved point-to-point rates (presets: nccl-tests, p2pBandwidthLatencyTest), not the
    # 450 / 32 GB/s datasheet ones
    assert [lk.bandwidth for lk in table.links] == [370e9, 25e9]
    c = np.array([4096.0])
    h100, a100 = table.layers[0][1].time(c, c * 0), table.layers[2][1].time(c, c * 0)
    assert a100[0] > h100[0]


def test_layer_time_is_vectorised_over_a_grid_and_grows_with_prefix(llama):
    gm, ctx = llama
    table = build_cost_table(gm, ctx.layers, "1xh100-sxm", 1024, seq_symbol=ctx.seq_symbol,
                             token_count=ctx.token_count)
    c, p = np.meshgrid(np.arange(16, 1025, 16.0), np.arange(0, 1024, 64.0))
    for layer in table.layers[0]:
        t = layer.time(c, p)
        assert t.shape == c.shape and np.all(t > 0) and np.all(np.isfinite(t))
    block = table.layers[0][1]
    big = np.array([4096.0])
    assert block.time(big, np.array([8192.0]))[0] > block.time(big, np.array([0.0]))[0]


def test_bidirectional_attention_does_not_depend_on_prefix():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(D, 3 * D)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, -1, 3, H, HD).permute(2, 0, 3, 1, 4)
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            return x + out.transpose(1, 2).reshape(1, -1, D)

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    gm, ctx = annotate_program(Encoder().eval(), (torch.randn(1, 32, D),))
    table = build_cost_table(gm, ctx.layers, "1xh100-sxm", 512, seq_symbol=ctx.seq_symbol,
                             token_count=ctx.token_count)
    assert not table.causal
    c = np.array([64.0, 64.0])
    for layer in table.layers[0]:
        t = layer.time(c, np.array([0.0, 448.0]))
        assert t[0] == pytest.approx(t[1])


def test_a_text_prefix_is_not_priced_per_chunk_token():
    """Flux (tiny: width 16, MLP 64): a single-stream block's values are ``(c + text, ...)``;
    their bytes per image token do not depend on the text length (6 or 30 tokens), and stay
    below one token's worth of every value of the block at once."""
    from tppc import examples

    peaks = []
    for text_len in (6, 30):
        model, args, kwargs = examples.hf_flux(text_len=text_len)
        gm, ctx = annotate_program(model, args, kwargs)
        exprs = layer_expressions(gm, ctx.layers, DEVICE_PRESETS["h100-sxm"], 16,
                                  seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
        peaks.append([e.peak_bytes_per_token for e in exprs if e.info.kind == "block"])
    assert peaks[0] == peaks[1]
    assert 0 < max(peaks[0]) < 7 * (16 + 64) * 4  # (1 + 6 text) x the widest value was priced
