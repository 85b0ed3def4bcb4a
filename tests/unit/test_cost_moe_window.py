"""The cost model prices MoE experts by what a chunk computes and reads, and windows by the
keys they visit (issue 9); oracles are hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

from tppc import examples
from tppc.cost_models.attention import windowed_visited
from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.moe import expected_experts
from tppc.cost_models.node_costs import C, P
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.frontend.annotate import annotate, program_of

pytest.importorskip("transformers")
DEVICE = DEVICE_PRESETS["h100-sxm"]
D, FF, E, H, KV, HD = 64, 96, 4, 4, 2, 16  # the factories' tiny configs


def _block(model_args: tuple, layer: int = 1):
    model, args, kwargs = model_args
    gm, ctx = annotate(model, args, kwargs)
    exprs = layer_expressions(program_of(gm, ctx), ctx.layers, DEVICE, 1024,
                              seq_symbol=ctx.seq_symbol)
    return exprs[layer]


def _at(expr: sympy.Expr, c: int, p: int = 0) -> float:
    return float(sympy.sympify(expr).subs({C: c, P: p}))


def test_expected_experts_hand_values() -> None:
    assert expected_experts(8, sympy.Integer(1)) == 1
    assert expected_experts(8, sympy.Integer(2)) == sympy.Rational(15, 8)  # 8·(1 − 49/64)
    assert float(expected_experts(4, sympy.Integer(6))) == pytest.approx(4 * (1 - 0.75 ** 6))
    for rows in (1, 3, 10, 100):  # never above min(E, rows)
        assert float(expected_experts(8, sympy.Integer(rows))) <= min(8, rows) + 1e-12


@pytest.fixture(scope="module")
def grouped():
    return _block(examples.hf_mixtral(experts="grouped_mm", num_experts=E))


def test_grouped_mm_experts_price_active_flops_and_touched_weights(grouped) -> None:
    assert grouped.unpriced == ()  # sort, topk, histc, grouped_mm_fallback all have rules
    mms = [n for n in grouped.nodes if n.op == "grouped_mm_fallback"]
    assert len(mms) == 2
    gate_up, down = mms
    for c in (1, 3, 40):
        rows = 2 * c  # top-2
        assert _at(gate_up.matrix_flops, c) == 2 * rows * D * 2 * FF
        assert _at(down.matrix_flops, c) == 2 * rows * FF * D
        touched = E * (1 - (1 - 1 / E) ** rows)
        want = 4 * (rows * D + rows * 2 * FF + touched * D * 2 * FF + E)  # fp32; offs (E,)
        assert _at(gate_up.bytes, c) == pytest.approx(want)
    # at one token the weights of 2 experts of 4 are read, at many tokens all 4
    weights = 4 * D * 2 * FF
    assert _at(gate_up.bytes, 1) - 4 * (2 * D + 4 * FF + E) == pytest.approx(
        weights * 4 * (1 - 0.75 ** 2))
    assert _at(gate_up.bytes, 1000) == pytest.approx(4 * (2000 * (D + 2 * FF) + E) + weights * E)


def test_routing_ops_have_hand_computed_vector_work(grouped) -> None:
    (sort,) = [n for n in grouped.nodes if n.op == "sort"]
    (histc,) = [n for n in grouped.nodes if n.op == "histc"]
    (topk,) = [n for n in grouped.nodes if n.op == "topk"]
    assert _at(sort.vector_flops, 8) == pytest.approx(16 * 4)  # 2c = 16 ids, log2 16 = 4
    assert _at(histc.vector_flops, 8) == 16
    assert _at(topk.vector_flops, 8) == pytest.approx(8 * E * 1)  # k = 2: log2 2 = 1


def test_both_expert_implementations_do_the_same_matrix_flops(grouped) -> None:
    batched = _block(examples.hf_mixtral(experts="batched_mm", num_experts=E))
    assert batched.unpriced == ()
    bmm = [n for n in batched.nodes if n.op == "bmm"]
    assert [_at(n.matrix_flops, 5) for n in bmm] == [2 * 10 * D * 2 * FF, 2 * 10 * FF * D]
    assert sympy.expand(batched.matrix_flops - grouped.matrix_flops) == 0
    dense_mlp = 3 * 2 * D * FF  # one dense MLP of the same width, per token
    expert_flops = _at(sum(n.matrix_flops for n in bmm), 1)
    assert expert_flops == 2 * dense_mlp  # top-2: two experts' MLPs per token, not E


def _window_attention(window: int):
    block = _block(examples.hf_mistral(window=window))
    (attention,) = [n for n in block.nodes if n.op == "chunk_attention"]
    return block, attention


@pytest.mark.parametrize(("c", "p", "visited"), [
    (10, 0, 1 + 2 + 3 + 4 + 5 * 6),  # rows see 1..5 keys, then the window of 5
    (4, 3, 4 + 5 + 5 + 5),
    (4, 100, 4 * 5),
])
def test_windowed_attention_prices_the_keys_the_window_visits(c: int, p: int, visited: int
                                                              ) -> None:
    assert _at(windowed_visited(C, P, 5), c, p) == visited
    block, attention = _window_attention(5)
    assert _at(attention.matrix_flops, c, p) == 4 * H * HD * visited
    kv_read = 2 * KV * HD * 4 * min(p + c, 5 + c - 1)
    assert _at(attention.bytes, c, p) == 2 * H * HD * 4 * c + kv_read
    time_far = block.fn(np.array([64.0, 64.0]), np.array([1000.0, 50000.0]))
    assert time_far[0] == pytest.approx(time_far[1])  # beyond the window p costs nothing


def test_a_window_longer_than_the_sequence_prices_as_causal() -> None:
    _, attention = _window_attention(4096)
    assert _at(attention.matrix_flops, 16, 32) == 4 * H * HD * (32 * 16 + 16 * 17 / 2)


def test_chunked_attention_is_priced_as_a_window_of_its_block() -> None:
    """Issue 31: a block of ``b`` keys (Llama 4's chunked attention) visits at most what a
    window of ``b`` visits: priced so (an upper bound, exact for rows at a block's end)."""
    import torch

    from tests.integration.test_chunked_attention import BLOCK, BlockLM

    model = BlockLM().eval()
    gm, ctx = annotate(model, (torch.randint(0, 64, (1, 20)),), {})
    exprs = layer_expressions(program_of(gm, ctx), ctx.layers, DEVICE, 1024,
                              seq_symbol=ctx.seq_symbol)
    ops = [n for layer in exprs for n in layer.nodes if n.op == "chunk_attention"]
    assert len(ops) == 2
    for c, p in ((4, 0), (6, 30), (3, 100)):
        visited = _at(windowed_visited(C, P, BLOCK), c, p)
        assert _at(ops[0].matrix_flops, c, p) == 4 * 4 * 8 * visited  # 4 heads of 8
    assert _at(ops[0].matrix_flops, 4, 1000) == _at(ops[0].matrix_flops, 4, 100)
