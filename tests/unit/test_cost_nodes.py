"""Node costs: FLOPs and bytes match hand formulas; tile padding; token substitution."""

from __future__ import annotations

import warnings

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

from tppc.cost_models import unpriced
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.node_costs import (
    C,
    L,
    P,
    TokenSubstitution,
    find_seq_symbol,
    graph_node_costs,
)
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.cost_models.report import report_from_graph
from tppc.cost_models.roofline import node_time_terms
from tppc.cost_models.specs import DeviceSpec, MatrixUnit, Memory, VectorUnit
from tppc.cost_models.unpriced import UnpricedOpWarning
from tppc.errors import CostModelError
from tppc.ir.records import LAYER, TOKEN, LayerInfo, TokenInfo


def _export(module: nn.Module, *args: torch.Tensor, axis: int = 1, max_len: int = 1024):
    dims = tuple({axis: Dim("seq", min=2, max=max_len)} if a.dim() > axis else None for a in args)
    return torch.export.export(module, args, dynamic_shapes=dims).graph_module


def _only(costs, op):
    found = [c for c in costs.values() if c.op == op]
    assert len(found) == 1, [c.op for c in costs.values()]
    return found[0]


class _Attention(nn.Module):
    def __init__(self, causal: bool):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


def test_linear_flops_and_bytes_match_hand_formula():
    gm = _export(nn.Linear(64, 96, bias=False), torch.randn(1, 8, 64))
    cost = _only(graph_node_costs(gm), "linear")
    assert cost.matrix_flops == 2 * C * 64 * 96
    assert cost.bytes == 4 * (C * 64 + 64 * 96 + C * 96)  # in, weight, out (fp32)
    assert cost.kind == "matrix" and cost.dtype == "fp32"


def _visited_keys_by_enumeration(c: int, p: int, length: int, causal: bool) -> int:
    """Scores a kernel computes for c queries after p tokens, counted one by one."""
    return sum(1 for i in range(c) for j in range(length) if not causal or j <= p + i)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_flops_count_the_keys_each_query_visits(causal):
    b, h, d = 1, 4, 16
    q = torch.randn(b, h, 8, d)
    gm = _export(_Attention(causal), q, q, q, axis=2)
    for node in gm.graph.nodes:  # what annotate_seq_dims writes on attention nodes
        if "scaled_dot_product" in str(node.target):
            node.meta[TOKEN] = TokenInfo(role="mixing", axis=2, axis_size=None,
                                         attention="causal" if causal else "bidirectional")
    cost = _only(graph_node_costs(gm), "scaled_dot_product_attention")
    keys = P + C if causal else L
    for c, p, length in [(1, 0, 64), (7, 5, 64), (16, 32, 64), (64, 0, 64)]:
        visited = _visited_keys_by_enumeration(c, p, length, causal)
        flops = cost.matrix_flops.subs({C: c, P: p, L: length})
        assert flops == 4 * b * h * d * visited  # Q·Kᵀ and P·V, 2 FLOPs per multiply-add
    # q and out (chunk), the chunk's k/v written, the k/v buffer of `keys` tokens read
    expected_bytes = 4 * (2 * b * h * C * d + 2 * b * h * C * d + 2 * b * h * keys * d)
    assert sympy.expand(cost.bytes - expected_bytes) == 0
    assert cost.kv_bytes_per_key == 2 * b * h * d * 4


def test_conv_flops_match_hand_formula_with_a_non_identity_token_count():
    conv = nn.Conv2d(3, 16, kernel_size=3, padding=1, bias=False)
    gm = _export(conv, torch.randn(1, 3, 8, 32), axis=3)
    sym = find_seq_symbol(gm)
    # tokens are the 8 × W output pixels: T(W) = 8 W, so W = c / 8
    costs = graph_node_costs(gm, seq_symbol=sym, token_count=8 * sym)
    cost = _only(costs, "conv2d")
    assert sympy.simplify(cost.matrix_flops - 2 * C * 16 * 3 * 3 * 3) == 0


def test_views_are_free_and_elementwise_is_vector_work():
    class M(nn.Module):
        def forward(self, x):
            return F.silu(x.view(1, -1, 4, 16).transpose(1, 2)) + 1.0

    costs = graph_node_costs(_export(M(), torch.randn(1, 8, 64)))
    assert all(c.bytes == 0 for c in costs.values() if c.op in ("view", "transpose"))
    silu = _only(costs, "silu")
    assert silu.kind == "vector" and silu.matrix_flops == 0
    assert silu.vector_flops == 5 * C * 64 and silu.bytes == 2 * 4 * C * 64


def test_tile_padding_makes_130_tokens_cost_like_256_on_a_tpu():
    gm = _export(nn.Linear(256, 256, bias=False).to(torch.bfloat16),
                 torch.randn(1, 8, 256, dtype=torch.bfloat16))
    cost = _only(graph_node_costs(gm), "linear")
    t_mat = node_time_terms(cost, DEVICE_PRESETS["tpu-v5p"])[0]
    at = {n: float(t_mat.subs(C, n)) for n in (128, 130, 256)}
    assert at[130] == pytest.approx(at[256]) and at[256] == pytest.approx(2 * at[128])
    assert at[128] == pytest.approx(2 * 128 * 256 * 256 / 459e12)


def test_token_substitution_inverts_a_square_token_count():
    s = sympy.Symbol("s0", positive=True, integer=True)
    subs = TokenSubstitution.build(s, s**2 / 4)  # DiT: (s/2)² patches
    assert sympy.simplify((subs.chunk / 2) ** 2 - C) == 0
    assert sympy.simplify((subs.full / 2) ** 2 - L) == 0


def test_two_dynamic_symbols_need_an_explicit_sequence_symbol():
    class M(nn.Module):
        def forward(self, x, y):
            return x.sum() + y.sum()

    gm = torch.export.export(M(), (torch.randn(4, 8), torch.randn(4, 8)), dynamic_shapes=(
        {1: Dim("a", min=2, max=64)}, {1: Dim("b", min=2, max=64)})).graph_module
    with pytest.raises(CostModelError, match="several dynamic symbols"):
        graph_node_costs(gm)


def _cpu_like(**matrix) -> DeviceSpec:
    return DeviceSpec(name="cpu-like", matrix=MatrixUnit(peak_flops={"fp32": 1e11}, **matrix),
                      vector=VectorUnit(peak_flops=1e10),
                      memory=Memory(bandwidth=1e10, capacity=2**34), attention_efficiency=0.5)


def test_half_rows_price_a_skinny_matmul_as_if_it_had_more_rows():
    cost = _only(graph_node_costs(_export(nn.Linear(64, 64, bias=False), torch.randn(1, 8, 64))),
                 "linear")
    t_mat = node_time_terms(cost, _cpu_like(half_rows=16.0)).matrix
    assert float(t_mat.subs(C, 16)) == pytest.approx(2 * (16 + 16) * 64 * 64 / 1e11)
    # efficiency m / (m + m½): half of peak at 16 rows, 94 % at 256
    assert float(t_mat.subs(C, 256)) == pytest.approx(2 * 272 * 64 * 64 / 1e11)


def test_attention_runs_at_the_device_attention_efficiency():
    q = torch.randn(1, 2, 8, 16)
    cost = _only(graph_node_costs(_export(_Attention(True), q, q, q, axis=2)),
                 "scaled_dot_product_attention")
    t_mat = node_time_terms(cost, _cpu_like()).matrix
    assert sympy.simplify(t_mat - cost.matrix_flops / (0.5 * 1e11)) == 0


def test_op_without_a_rule_is_recorded_and_warned_once(monkeypatch):
    class M(nn.Module):
        def forward(self, x):
            return torch.special.i0(x) * 2

    monkeypatch.setattr(unpriced, "_WARNED", set())
    gm = _export(M(), torch.randn(1, 8, 64))
    with pytest.warns(UnpricedOpWarning, match="'special_i0'"):
        costs = graph_node_costs(gm)
    i0 = _only(costs, "special_i0")
    assert i0.unpriced and i0.kind == "memory" and i0.vector_flops == 0
    assert not _only(costs, "mul").unpriced
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second pricing of the same op stays silent
        layers = [_one_layer(gm)]
        table = build_cost_table(gm, layers, "1xh100-sxm", 64)
        report = report_from_graph(gm, cluster="1xh100-sxm", chunk=8, layers=layers)
    assert table.unpriced_ops == ("special_i0",) and report.unpriced_ops == ("special_i0",)
    assert "special_i0" in str(report)


def _one_layer(gm) -> LayerInfo:
    """Every node in one layer named ``m`` (what group_layers writes into the meta)."""
    for node in gm.graph.nodes:
        node.meta[LAYER] = "m"
    return LayerInfo(index=0, name="m", kind="block", nodes=(), params=(), param_count=0,
                     param_bytes=0, attention_nodes=(), attention_kinds=(), inputs=(),
                     outputs=())


def test_known_memory_ops_are_not_reported_as_unpriced():
    class M(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], dim=-1).flip(-1)

    costs = graph_node_costs(_export(M(), torch.randn(1, 8, 64)))
    assert not any(c.unpriced for c in costs.values())


def test_gqa_is_priced_as_sdpa_with_enable_gqa_not_as_a_repeat_copy():
    class Repeat(nn.Module):  # HF's repeat_kv: unsqueeze -> expand -> reshape
        def forward(self, q, k, v):
            k = k[:, :, None].expand(1, 2, 2, k.shape[2], 16).reshape(1, 4, k.shape[2], 16)
            v = v[:, :, None].expand(1, 2, 2, v.shape[2], 16).reshape(1, 4, v.shape[2], 16)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    class Gqa(nn.Module):  # what the emitted program runs
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    q, kv = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    costs = []
    for module in (Repeat(), Gqa()):
        gm = _export(module, q, kv, kv, axis=2)
        sym = next(iter(gm.graph.find_nodes(op="placeholder"))).meta["val"].shape[2].node.expr
        for node in gm.graph.find_nodes(op="placeholder"):  # what annotate_seq_dims writes
            node.meta[TOKEN] = TokenInfo(role="token", axis=2, axis_size=sym)
        costs.append(_only(graph_node_costs(gm), "scaled_dot_product_attention"))
    repeat, gqa = costs
    assert repeat.kv_bytes_per_key == gqa.kv_bytes_per_key == 2 * 2 * 16 * 4  # K+V, 2 heads
    assert repeat.serial_bytes == 0 and node_time_terms(repeat, _cpu_like()).serial == 0
    assert sympy.expand(repeat.bytes - gqa.bytes) == 0
    assert sympy.expand(repeat.matrix_flops - gqa.matrix_flops) == 0
    # q, out: 4 heads of the chunk; K/V buffers: 2 heads over p + c keys read, c written
    expected = 4 * (2 * 4 * C * 16 + 2 * 2 * 16 * (P + C) + 2 * 2 * 16 * C)
    assert sympy.expand(repeat.bytes - expected) == 0
