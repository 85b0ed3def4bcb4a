"""The cost model prices the chunk-step program that runs (``chunk_attention``'s graph)."""

from __future__ import annotations

import pytest
import sympy
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tppc.cost_models.layer_costs import layer_expressions
from tppc.cost_models.node_costs import C, L, P, graph_node_costs
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.frontend.annotate import annotate, program_of
from tppc.ir.records import LAYER

D, FF, H, KV, HD, VOCAB = 64, 128, 4, 2, 16, 128
DEVICE = DEVICE_PRESETS["h100-sxm"]


@pytest.fixture(scope="module")
def graphs():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF,
                      num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=KV)
    gm, ctx = annotate(LlamaForCausalLM(cfg).eval(), (torch.randint(0, VOCAB, (1, 32)),))
    return gm, program_of(gm, ctx), ctx


def _exprs(program, ctx):
    return layer_expressions(program, ctx.layers, DEVICE, 1024, seq_symbol=ctx.seq_symbol)


def _node(expr, op):
    return [c for c in expr.nodes if c.op == op]


def test_layers_are_the_chunk_graphs_layer_meta(graphs):
    _, program, ctx = graphs
    for expr in _exprs(program, ctx):
        expected = [n.name for n in program.graph.nodes
                    if n.op == "call_function" and n.meta.get(LAYER) == expr.info.name]
        assert list(expr.info.nodes) == expected and expected
    block = _exprs(program, ctx)[1]
    assert len(_node(block, "chunk_attention")) == 1 and len(_node(block, "copy_")) == 2


def test_matmuls_price_the_same_on_the_annotated_and_the_chunk_graph(graphs):
    annotated, program, ctx = graphs
    before = graph_node_costs(annotated, seq_symbol=ctx.seq_symbol)
    linears = [c for e in _exprs(program, ctx) for c in e.nodes if c.op == "linear"]
    assert len(linears) == 2 * 7 + 1
    for cost in linears:
        assert sympy.expand(cost.matrix_flops - before[cost.name].matrix_flops) == 0
        assert sympy.expand(cost.bytes - before[cost.name].bytes) == 0


def test_gqa_attention_reads_the_kv_heads_once_without_a_repeat(graphs):
    _, program, ctx = graphs
    block = _exprs(program, ctx)[1]
    (attention,) = _node(block, "chunk_attention")
    q_and_out = 2 * H * HD * 4 * C  # fp32 queries read, output written
    kv_read = 2 * KV * HD * 4 * (P + C)  # the buffers' KV heads over the causal keys
    assert sympy.expand(attention.bytes - (q_and_out + kv_read)) == 0
    assert attention.kv_bytes_per_key == 2 * KV * HD * 4 and block.kv_bytes_per_token == 2 * KV * HD * 4
    assert sympy.expand(attention.matrix_flops - 4 * H * HD * (P * C + C * (C + 1) / 2)) == 0
    for write in _node(block, "copy_"):  # the chunk's K (V) read and written into its buffer
        assert sympy.expand(write.bytes - 2 * KV * HD * 4 * C) == 0
    assert not [c for c in block.nodes if c.op in ("expand", "repeat", "clone") and c.bytes != 0]


def test_attention_price_follows_the_ops_causal_flag(graphs):
    annotated, _, ctx = graphs
    program = program_of(annotated, ctx)
    for node in program.graph.nodes:
        if "chunk_attention" in str(node.target):
            node.args = (*node.args[:4], False, *node.args[5:])
    (attention,) = _node(_exprs(program, ctx)[1], "chunk_attention")
    assert not attention.causal_keys
    assert sympy.expand(attention.matrix_flops - 4 * H * HD * C * L) == 0
    assert sympy.expand(attention.bytes - (2 * H * HD * 4 * C + 2 * KV * HD * 4 * L)) == 0
