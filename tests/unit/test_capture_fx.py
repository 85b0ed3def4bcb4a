"""The torch.fx.symbolic_trace fallback: models torch.export cannot take, annotated as usual."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tppc
from tppc.errors import AnnotationError, CaptureError
from tppc.ir import LAYER, TOKEN
from tppc.passes._shapes import ShapeVal, tensor_val


def _np_tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh through numpy: fake tensors have no data, so torch.export cannot run it."""
    return torch.from_numpy(np.tanh(x.detach().cpu().numpy())).to(x.dtype)


torch.fx.wrap("_np_tanh")


class _Block(nn.Module):
    def __init__(self, d: int, *, causal: str) -> None:
        super().__init__()
        self.causal = causal
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, n, 2, d // 2).transpose(1, 2) for t in (q, k, v))
        if self.causal == "mask":
            mask = x.new_ones(n, n, dtype=torch.bool).tril()
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal == "flag")
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, d))
        return x + _np_tanh(self.mlp(x))


class _NumpyGPT(nn.Module):
    """A small GPT whose blocks call a ``torch.fx.wrap``-ed numpy helper."""

    def __init__(self, *, causal: str = "flag", d: int = 16, layers: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, d)
        self.blocks = nn.ModuleList(_Block(d, causal=causal) for _ in range(layers))
        self.head = nn.Linear(d, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.fixture(scope="module")
def numpy_gpt():
    model = _NumpyGPT().eval()
    gm, ctx = tppc.annotate(model, (_ids(8),))
    return model, gm, ctx


def test_torch_export_alone_cannot_take_the_numpy_helper() -> None:
    with pytest.raises(Exception, match="numpy"):
        torch.export.export(_NumpyGPT().eval(), (_ids(8),), strict=False)


def test_model_export_refuses_is_captured_with_symbolic_trace() -> None:
    model = _NumpyGPT().eval()
    gm, ctx = tppc.capture(model, (_ids(8),))
    assert ctx.capture_mode == "fx"
    assert ctx.example_seq == 8
    assert {n.op for n in gm.graph.nodes} >= {"call_module", "call_method", "call_function"}
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert isinstance(ids.meta["val"], ShapeVal)
    assert ids.meta["val"].shape == (1, ctx.seq_symbol)


def test_fx_non_tensor_inputs_are_fixed_to_their_example_values() -> None:
    class Scaled(_NumpyGPT):
        def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return super().forward(ids) * scale

    model = Scaled().eval()
    gm, ctx = tppc.capture(model, (_ids(8),), {"scale": 0.5})
    assert ctx.capture_mode == "fx" and ctx.input_names == ("ids", "scale")
    with torch.no_grad():
        torch.testing.assert_close(gm(_ids(11)), model(_ids(11), scale=0.5))


def test_fx_capture_runs_at_another_length_like_eager(numpy_gpt) -> None:
    model, gm, _ = numpy_gpt
    with torch.no_grad():
        torch.testing.assert_close(gm(_ids(13)), model(_ids(13)))


def test_fx_capture_finds_the_blocks(numpy_gpt) -> None:
    _, _, ctx = numpy_gpt
    assert [layer.name for layer in ctx.layers] == ["prologue", "blocks.0", "blocks.1",
                                                    "blocks.2", "epilogue"]
    d = 16
    per_block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * d + 2 * d) + (2 * d * d + d)
    assert all(layer.param_count == per_block for layer in ctx.layers[1:-1])
    for prev, layer in zip(ctx.layers, ctx.layers[1:]):
        assert layer.inputs == prev.outputs


def test_fx_capture_block_activations_have_token_axes(numpy_gpt) -> None:
    _, gm, ctx = numpy_gpt
    blocks = {layer.name for layer in ctx.layers if layer.kind == "block"}
    acts = [n for n in gm.graph.nodes if n.meta.get(LAYER) in blocks
            and n.meta[TOKEN].role in ("token", "mixing") and tensor_val(n) is not None]
    assert len(acts) > 3 * 15
    assert {n.op for n in acts} == {"call_module", "call_method", "call_function"}
    assert all(n.meta[TOKEN].axis is not None for n in acts)
    helper = [n for n in acts if n.target is _np_tanh]
    assert len(helper) == 3 and all(n.meta[TOKEN].role == "token" for n in helper)


def test_fx_capture_sdpa_is_causal_attention_on_the_token_axis(numpy_gpt) -> None:
    _, gm, ctx = numpy_gpt
    assert [layer.attention_kinds for layer in ctx.layers[1:-1]] == [("causal",)] * 3
    sdpa = next(n for n in gm.graph.nodes if n.target is F.scaled_dot_product_attention)
    assert sdpa.meta[TOKEN].axis == 2  # (b, heads, seq, head_dim)
    assert ctx.token_count == ctx.seq_symbol


@pytest.mark.parametrize(("causal", "kind"), [("mask", "causal"), ("none", "bidirectional")])
def test_fx_capture_attention_kind_from_mask_or_flag(causal: str, kind: str) -> None:
    gm, ctx = tppc.annotate(_NumpyGPT(causal=causal, layers=2).eval(), (_ids(8),))
    assert [k for layer in ctx.layers for k in layer.attention_kinds] == [kind] * 2
    if causal == "mask":
        tril = next(n for n in gm.graph.nodes if n.target == "tril")
        assert tril.meta[TOKEN].role == "positional"


class _Stack(nn.Module):
    """Two blocks whose body (given as a function) calls the numpy helper."""

    def __init__(self, body) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(_Body(body) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return x


class _Body(nn.Module):
    def __init__(self, body) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1)
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self, _np_tanh(x))


def _annotate(body):
    return tppc.annotate(_Stack(body).eval(), (torch.randint(0, 16, (1, 8)),))


def test_fx_cumsum_over_tokens_is_refused_naming_node_op_module() -> None:
    with pytest.raises(AnnotationError, match=r"'cumsum'.*op cumsum.*module blocks\.0"):
        _annotate(lambda m, x: m.lin(x).cumsum(dim=1))


def test_fx_cumsum_over_features_is_row_wise() -> None:
    gm, _ = _annotate(lambda m, x: torch.cumsum(m.lin(x), -1))
    assert {n.meta[TOKEN].role for n in gm.graph.nodes if n.target is torch.cumsum} == {"token"}


def test_fx_conv_module_over_tokens_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"convolution over the token axis.*kernel 3"):
        _annotate(lambda m, x: m.conv(x.transpose(1, 2)).transpose(1, 2))


def test_fx_unknown_module_on_tokens_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"blocks_0_rnn.*nn\.GRU.*row-wise"):
        _annotate(lambda m, x: m.rnn(x)[0])


def test_fx_slicing_tokens_in_a_block_is_refused() -> None:
    with pytest.raises(AnnotationError, match=r"needs the whole sequence.*blocks\.0"):
        _annotate(lambda m, x: m.lin(x)[:, :-1])


def test_fx_size_not_linear_in_the_sequence_is_refused() -> None:
    def squares(m, x):
        return (x @ x.transpose(1, 2)).flatten(1)[..., None].expand(-1, -1, 8)

    with pytest.raises(CaptureError, match=r"node 'flatten'.*\[64, 81, 100\].*not a linear"):
        _annotate(squares)


class _PatchDiT(nn.Module):
    """Latents patchified by a Conv2d module, one block, a numpy helper in between."""

    patch_size = 2

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(4, 8, 2, stride=2)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _np_tanh(self.patch(x).flatten(2).transpose(1, 2))
        for block in self.blocks:
            h = h + block(h)
        return h


def test_fx_patchify_conv_module_makes_patch_rows_the_token_axis() -> None:
    model = _PatchDiT().eval()
    gm, ctx = tppc.annotate(model, (torch.randn(1, 4, 8, 8),))
    assert ctx.capture_mode == "fx" and ctx.example_seq == 4
    conv = next(n for n in gm.graph.nodes if n.target == "patch")
    assert conv.meta[TOKEN].role == "token" and conv.meta[TOKEN].axis == 2
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert tensor_val(out).shape[1] == 4 * ctx.seq_symbol
    x = torch.randn(1, 4, 12, 8)
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))


def test_data_dependent_control_flow_gets_no_fx_fallback() -> None:
    class Branchy(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids * 2 if ids.sum() > 0 else ids

    with pytest.raises(CaptureError, match="data-dependent") as err:
        tppc.capture(Branchy(), (torch.randint(1, 16, (1, 8)),))
    assert "symbolic_trace" not in str(err.value)


def test_fx_fallback_failure_repeats_the_export_error() -> None:
    class Untraceable(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            y = _np_tanh(ids.float())
            return y * 2 if y.shape[1] > 4 else y  # a branch on a traced size

    with pytest.raises(CaptureError, match=r"(?s)torch.export could not.*symbolic_trace "
                                           r"fallback failed too"):
        tppc.capture(Untraceable(), (torch.randint(1, 16, (1, 8)),))


def test_fx_captured_graphs_are_refused_by_the_cost_model(numpy_gpt) -> None:
    from tppc.cost_models.layer_costs import build_cost_table
    from tppc.errors import CostModelError

    _, gm, ctx = numpy_gpt
    with pytest.raises(CostModelError, match=r"symbolic_trace fallback.*torch.export"):
        build_cost_table(gm, ctx.layers, "1xh100-sxm", 64, seq_symbol=ctx.seq_symbol,
                         token_count=ctx.token_count)


def test_fx_captured_models_are_refused_by_compile() -> None:
    from tppc.errors import PassError

    with pytest.raises(PassError, match=r"captured in 'fx' mode.*fix"):
        tppc.compile(_NumpyGPT().eval(), (_ids(8),))
