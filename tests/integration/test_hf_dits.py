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
