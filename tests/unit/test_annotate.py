"""annotate_seq_dims and group_layers on the project's own GPT and DiT, and bad models."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tests.unit._helpers import block_activations, roles_by_target
from tppc import examples
from tppc.errors import AnnotationError
from tppc.ir.records import LAYER, TOKEN


@pytest.fixture(scope="module")
def gpt_graph():
    model, args, _ = examples.gpt(seq_len=16)
    return tppc.annotate(model, args)


@pytest.fixture(scope="module")
def dit_graph():
    model, args, _ = examples.dit(size=8)
    return tppc.annotate(model, args)


def test_gpt_layers_are_prologue_blocks_epilogue(gpt_graph) -> None:
    _, ctx = gpt_graph
    assert [layer.kind for layer in ctx.layers] == ["prologue"] + ["block"] * 4 + ["epilogue"]
    assert [layer.name for layer in ctx.layers[1:-1]] == [f"blocks.{i}" for i in range(4)]


def test_gpt_block_params_counted(gpt_graph) -> None:
    _, ctx = gpt_graph
    d = 64
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    assert all(layer.param_count == per_block for layer in ctx.layers[1:-1])
    assert all(layer.param_bytes == 4 * per_block for layer in ctx.layers[1:-1])


def test_gpt_every_block_activation_has_a_token_axis(gpt_graph) -> None:
    gm, ctx = gpt_graph
    acts = block_activations(gm, ctx)
    assert len(acts) > 40
    assert all(n.meta[TOKEN].axis is not None for n in acts)


def test_gpt_attention_is_causal(gpt_graph) -> None:
    _, ctx = gpt_graph
    assert [layer.attention_kinds for layer in ctx.layers[1:-1]] == [("causal",)] * 4


def test_gpt_arange_is_positional_and_weights_const(gpt_graph) -> None:
    gm, _ = gpt_graph
    assert roles_by_target(gm, "arange") == {"positional"}
    assert {n.meta[TOKEN].role for n in gm.graph.nodes if n.op == "get_attr"} == {"const"}


def test_gpt_token_axis_follows_transposes(gpt_graph) -> None:
    gm, ctx = gpt_graph
    sdpa = next(n for n in gm.graph.nodes if "scaled_dot_product" in str(n.target))
    assert sdpa.meta[TOKEN].axis == 2  # (b, heads, seq, head_dim)
    assert ctx.token_count == ctx.seq_symbol


def test_gpt_layer_wiring(gpt_graph) -> None:
    _, ctx = gpt_graph
    for prev, layer in zip(ctx.layers, ctx.layers[1:]):
        assert layer.inputs == prev.outputs
    assert ctx.layers[0].inputs == ("input_ids",)


def test_dit_roles(dit_graph) -> None:
    gm, ctx = dit_graph
    assert ctx.token_count == 4 * ctx.seq_symbol  # 4 patch columns per patch row
    assert [k for layer in ctx.layers for k in layer.attention_kinds] == ["bidirectional"] * 4
    ada = [n for n in gm.graph.nodes if n.meta.get("nn_module_stack") and
           any(p.endswith(".ada") for p, _ in n.meta["nn_module_stack"].values())]
    assert ada and {n.meta[TOKEN].role for n in ada} == {"const"}  # timestep/class conditioning
    assert "positional" in roles_by_target(gm, "arange")
    conv = next(n for n in gm.graph.nodes if "conv2d" in str(n.target))
    assert conv.meta[TOKEN].role == "token"  # patchify (kernel == stride) is row-wise
    assert all(n.meta[TOKEN].axis is not None for n in block_activations(gm, ctx))


def test_dit_unpatchify_keeps_row_bands(dit_graph) -> None:
    gm, _ = dit_graph
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    last = out[0] if isinstance(out, list | tuple) else out
    assert last.meta[TOKEN].role == "token" and last.meta[TOKEN].axis == 2
    assert last.meta[LAYER] == "epilogue"


class _Stack(nn.Module):
    """A minimal block stack whose block body is given as a function."""

    def __init__(self, body) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Block(body) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return x


class _Block(nn.Module):
    def __init__(self, body) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self, x)


def _annotate(body):
    return tppc.annotate(_Stack(body).eval(), (torch.randint(0, 16, (1, 8)),))


def test_cumsum_over_tokens_is_recurrent_mixing() -> None:
    gm, _ = _annotate(lambda m, x: m.lin(x).cumsum(dim=1))
    assert roles_by_target(gm, "cumsum") == {"mixing"}
    assert {n.meta[TOKEN].attention for n in gm.graph.nodes
            if "cumsum" in str(n.target)} == {"recurrent"}


def test_flip_over_tokens_is_refused_naming_node_op_module() -> None:
    with pytest.raises(AnnotationError, match=r"'flip'.*op flip.*module blocks\.0"):
        _annotate(lambda m, x: m.lin(x).flip(1).cumsum(dim=1))  # an anti-causal scan


def test_softmax_over_tokens_outside_attention_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"softmax.*token axis.*this one is not"):
        _annotate(lambda m, x: m.lin(x).softmax(dim=1))


def test_softmax_over_features_is_row_wise() -> None:
    gm, _ = _annotate(lambda m, x: m.lin(x).softmax(dim=-1))
    assert roles_by_target(gm, "softmax") == {"token"}


def test_strided_conv_over_tokens_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"convolution over the token axis.*kernel 3"):
        _annotate(lambda m, x: F.conv1d(x.transpose(1, 2), m.conv.weight, stride=2,
                                        padding=1).transpose(1, 2))


def test_same_conv_over_tokens_is_buffered_mixing() -> None:
    gm, _ = _annotate(lambda m, x: m.conv(x.transpose(1, 2)).transpose(1, 2))
    conv = next(n for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target))
    assert (conv.meta[TOKEN].role, conv.meta[TOKEN].attention) == ("mixing", "bidirectional")


def test_eager_attention_scores_are_folded_into_bidirectional_attention() -> None:
    def eager(m, x):
        q = m.lin(x)
        return (q @ x.transpose(1, 2)).softmax(-1) @ x

    gm, _ = _annotate(eager)
    mixing = [n for n in gm.graph.nodes if n.meta[TOKEN].role == "mixing"]
    assert mixing and {(str(n.target), n.meta[TOKEN].attention) for n in mixing} == \
        {("aten.scaled_dot_product_attention.default", "bidirectional")}


def test_a_softmax_over_the_queries_stays_refused() -> None:
    def over_queries(m, x):
        q = m.lin(x)
        return (q @ x.transpose(1, 2)).softmax(-2) @ x

    with pytest.raises(AnnotationError, match=r"token axis"):
        _annotate(over_queries)


def test_pooling_inside_a_block_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"needs the whole sequence.*blocks\.0"):
        _annotate(lambda m, x: x + m.lin(x).mean(dim=1, keepdim=True))


def test_sdpa_bidirectional_and_causal_told_apart() -> None:
    _, ctx = _annotate(lambda m, x: F.scaled_dot_product_attention(
        m.lin(x)[:, None], x[:, None], x[:, None], is_causal=False)[:, 0])
    assert {k for layer in ctx.layers for k in layer.attention_kinds} == {"bidirectional"}


def test_pass_history_records_each_pass(gpt_graph) -> None:
    _, ctx = gpt_graph
    assert [r.name for r in ctx.history] == ["fold_eager_attention", "unfold_unit_repeats",
                                             "annotate_seq_dims", "group_layers",
                                             "annotate_shards"]
    assert all(r.seconds >= 0 and "def forward" in r.code for r in ctx.history)


def test_padding_the_token_axis_is_global() -> None:
    # HF's causal-LM loss pads the labels by one token: the result has s + 1 rows
    with pytest.raises(AnnotationError, match=r"needs the whole sequence"):
        _annotate(lambda m, x: F.pad(m.lin(x), (0, 0, 0, 1)))


def test_padding_features_is_row_wise() -> None:
    gm, _ = _annotate(lambda m, x: F.pad(m.lin(x), (0, 2))[..., :8])
    assert roles_by_target(gm, "pad") == {"token"}
