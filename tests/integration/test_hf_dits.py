"""diffusers DiTs from tiny configs: capture, annotation and layers (issue 13, front end)."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.frontend.capture import bind_inputs
from tppc.ir.records import TOKEN

pytest.importorskip("diffusers")


def _annotate(factory, **kw):
    model, args, kwargs = factory(**kw)
    gm, ctx = tppc.annotate(model, args, kwargs)
    return model, args, kwargs, gm, ctx


def _sdpa(gm):
    return [n.meta[TOKEN] for n in gm.graph.nodes if "scaled_dot_product" in str(n.target)]


def _tokens(ctx):
    return int(ctx.token_count.subs(ctx.seq_symbol, ctx.example_seq))


@pytest.fixture(scope="module")
def pixart():
    return _annotate(examples.hf_pixart)


@pytest.fixture(scope="module")
def flux():
    return _annotate(examples.hf_flux)


@pytest.fixture(scope="module")
def hunyuan():
    return _annotate(examples.hf_hunyuan_dit)


@pytest.fixture(scope="module")
def cogvideox():
    return _annotate(examples.hf_cogvideox)


def test_pixart_text_is_context_and_cross_attention_is_row_wise(pixart) -> None:
    model, _, _, gm, ctx = pixart
    assert ctx.seq_inputs == {"hidden_states": (2,)}
    assert ctx.context_inputs == ("encoder_hidden_states",)
    infos = _sdpa(gm)
    assert [i.role for i in infos] == ["mixing", "token"] * model.config.num_layers
    assert all(i.prefix == 0 for i in infos)
    assert _tokens(ctx) == 16  # 8x8 latent, patch 2
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert all(b.attention_kinds == ("bidirectional",) for b in blocks)


def test_pixart_specialised_capture_runs_at_its_resolution(pixart) -> None:
    model, args, kwargs, gm, ctx = pixart
    assert ctx.capture_mode == "specialized"
    assert ctx.specialized_to == {"hidden_states": (1, 4, 8, 8)}
    bound = bind_inputs(model, args, dict(kwargs))
    with torch.no_grad():
        assert_kernels_close(gm(*bound.args, **bound.kwargs)[0], model(*args, **kwargs)[0])


def test_flux_is_dynamic_with_the_text_as_a_prefix(flux) -> None:
    model, _, _, gm, ctx = flux
    assert ctx.capture_mode == "dynamic"
    assert ctx.seq_inputs == {"hidden_states": (1,), "img_ids": (0,)}
    assert {"encoder_hidden_states", "txt_ids"} <= set(ctx.context_inputs)
    infos = _sdpa(gm)
    assert len(infos) == model.config.num_layers + model.config.num_single_layers
    assert all(i.role == "mixing" and i.attention == "bidirectional" and i.prefix == 6
               for i in infos)
    assert _tokens(ctx) == 16


def test_flux_double_and_single_stream_blocks_are_layers(flux) -> None:
    _, _, _, _, ctx = flux
    names = [layer.name for layer in ctx.layers if layer.kind == "block"]
    assert names == ["transformer_blocks.0", "single_transformer_blocks.0",
                     "single_transformer_blocks.1"]


def test_flux_graph_runs_at_another_token_count(flux) -> None:
    model, _, _, gm, _ = flux
    _, more, kw = examples.hf_flux(tokens=25)
    bound = bind_inputs(model, more, dict(kw))
    with torch.no_grad():
        assert_kernels_close(gm(*bound.args, **bound.kwargs)[0], model(*more, **kw)[0])


def test_hunyuan_pool_is_const_and_long_skips_are_forwarded(hunyuan) -> None:
    _, _, _, gm, ctx = hunyuan
    roles = [i.role for i in _sdpa(gm)]
    assert roles[0] == "const"  # the text attention-pool of time_extra_emb
    assert roles[1:] == ["mixing", "token"] * 4
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    skip = set(blocks[1].outputs) & set(blocks[3].inputs) - set(blocks[2].outputs)
    assert skip and skip <= set(blocks[2].through)
    assert ctx.capture_mode == "specialized" and _tokens(ctx) == 16


def test_cogvideox_video_latents_with_text_prefix(cogvideox) -> None:
    _, _, _, gm, ctx = cogvideox
    assert ctx.seq_inputs == {"hidden_states": (3,)}
    assert ctx.patch_grid == (2, 4, 4) and ctx.capture_mode == "specialized"
    infos = _sdpa(gm)
    assert all(i.role == "mixing" and i.prefix == 6 for i in infos)
    assert _tokens(ctx) == 32  # 2 frames of 4x4 patches


def test_flux2_is_exact() -> None:
    """Flux2: its SwiGLU slices the text stream's features (was refused as needing the whole
    sequence, 'fix: move it after the blocks') and its single-stream fused projection made
    the sharding analysis cycle (an AssertionError after 10000 rounds)."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, timestep_guidance_channels=8,
        axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False).eval()
    n, text = 12, 6
    img_ids = torch.stack([torch.zeros(n), torch.arange(n) // 4, torch.arange(n) % 4,
                           torch.zeros(n)], -1).unsqueeze(0)
    txt_ids = torch.zeros(1, text, 4)
    txt_ids[..., 3] = torch.arange(text)
    x = torch.randn(1, n, 4)
    kwargs = {"encoder_hidden_states": torch.randn(1, text, 12),
              "timestep": torch.tensor([0.5]), "img_ids": img_ids, "txt_ids": txt_ids,
              "return_dict": False}
    cp = tppc.compile(model, (x,), kwargs, num_stages=2)
    with torch.no_grad():
        assert_kernels_close(cp(x, **kwargs)[0], model(x, **kwargs)[0])


def test_sana_videos_token_sum_is_refused_with_its_true_reason() -> None:
    """SanaVideo's linear attention sums over the tokens outside its matmul: the refusal names
    the reduction and that the model cannot be pipelined by tokens (was 'fix: move it after
    the blocks', which a library model cannot do)."""
    from diffusers import SanaVideoTransformer3DModel

    torch.manual_seed(0)
    model = SanaVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=1, num_cross_attention_heads=2, cross_attention_head_dim=8,
        cross_attention_dim=16, caption_channels=12, sample_size=8, rope_max_seq_len=32).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, 6, 12), "timestep": torch.tensor([10]),
              "return_dict": False}
    with pytest.raises(tppc.AnnotationError,
                       match=r"sum\S* over the token axis.*linear attention's normaliser.*"
                             r"cannot be pipelined by tokens"):
        tppc.compile(model, (torch.randn(1, 4, 2, 8, 8),), kwargs, num_stages=2)


def test_easyanimate_is_refused_by_name_not_with_a_raw_trace_error() -> None:
    """EasyAnimate's rope guards the latent's width to the example's; torch.export's
    runtime-assert pass then fails on the symbolic re-export (a raw ``torch.fx`` TraceError
    escaped before): a CaptureError naming the guard and the fix."""
    from diffusers import EasyAnimateTransformer3DModel

    torch.manual_seed(0)
    model = EasyAnimateTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
        patch_size=2, sample_width=8, sample_height=8, num_layers=1, mmdit_layers=1,
        time_embed_dim=8, text_embed_dim=12).eval()
    kwargs = {"timestep": torch.tensor([10]), "encoder_hidden_states": torch.randn(1, 6, 12),
              "return_dict": False}
    with pytest.raises(tppc.CaptureError, match=r"guarded EasyAnimateTransformer3DModel to "
                                                r"the example's size.*runtime-assert pass.*"
                                                r"fix: run the model at this size unsplit"):
        tppc.compile(model, (torch.randn(1, 4, 2, 8, 8),), kwargs, num_stages=2)
