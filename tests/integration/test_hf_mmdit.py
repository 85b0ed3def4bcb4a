"""diffusers MM-DiTs (issue 21, 30): SD3 joins the text after the image tokens (a suffix
segment); QwenImage joins it before and reads its image grid from Python ints
(:mod:`tppc.frontend.size_ints`); against eager and the serial denoising loop."""

from __future__ import annotations

import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close, serial_denoise
from tppc import examples

diffusers = pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def sd3():
    model, args, kwargs = examples.hf_sd3()
    return model, args, kwargs, tppc.compile(model, args, kwargs, num_stages=2,
                                             executor="threads")


def test_sd3_joins_the_text_after_the_image(sd3) -> None:
    model, args, kwargs, cp = sd3
    ctx = cp.context
    assert ctx.capture_mode == "dynamic" and ctx.seq_inputs == {"hidden_states": (2,)}
    buffers = [b for stage in cp.program(cp.plan.seq_len).stages for b in stage.buffers]
    assert len(buffers) == 2 * model.config.num_layers  # K and V of each joint attention
    assert {(b.prefix, b.scale, b.suffix) for b in buffers} == {(0, 4, 6)}  # 4 patches a row
    with torch.no_grad():
        assert_kernels_close(cp(*args, **kwargs)[0], model(*args, **kwargs)[0])


def test_sd3_denoises_like_the_serial_loop(sd3) -> None:
    model, (x,), kwargs, cp = sd3
    kw = {k: v for k, v in kwargs.items() if k != "timestep"}
    ref = serial_denoise(model, x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, model_kwargs=kw)
    for patches in (2, 4):
        out = cp.denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, warmup_steps=3,
                         patches=patches, model_kwargs=kw)
        assert_kernels_close(out, ref, depth=3)
    # stale patches: the first patch of a step writes the text K/V after the image rows; the
    # patch program is checked against the one-chunk program on the first call
    stale = cp.denoise(x, diffusers.FlowMatchEulerDiscreteScheduler(), 3, warmup_steps=1,
                       patches=2, model_kwargs=kw)
    assert torch.isfinite(stale).all() and not torch.equal(stale, ref)
    assert float(((stale - ref) ** 2).mean()) < 0.1 * float((ref**2).mean())


def _qwen_image(layers: int = 1):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=layers, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4)).eval()


def _qwen_kwargs(rows: int, cols: int) -> dict:
    torch.manual_seed(rows * 10 + cols)
    return {"encoder_hidden_states": torch.randn(1, 6, 16),
            "encoder_hidden_states_mask": torch.ones(1, 6), "img_shapes": [(1, rows, cols)],
            "return_dict": False}


def test_qwen_image_runs_and_denoises_at_every_resolution() -> None:
    """QwenImage joins text before the image (a prefix) and builds its rotary table from
    ``img_shapes``, Python ints (was refused: "integer input img_shapes=[(1, 4, 4)]"): its
    rows int is tied to the tokens, a new width is captured again; plain calls and
    ``denoise`` with 2 patches equal eager and the serial loop."""
    model = _qwen_image()
    example = {**_qwen_kwargs(4, 4), "timestep": torch.tensor([0.5])}
    cp = tppc.compile(model, (torch.randn(1, 16, 16),), example, num_stages=2)
    assert (cp.context.capture_mode, cp.context.size_int.label) == ("dynamic",
                                                                     "img_shapes[0][1]")
    flow = diffusers.FlowMatchEulerDiscreteScheduler
    for rows, cols in ((6, 4), (4, 6)):  # rows: the same capture; another width: a new one
        kw, x = _qwen_kwargs(rows, cols), torch.randn(1, rows * cols, 16)
        with torch.no_grad():
            want = model(x, timestep=torch.tensor([0.5]), **kw)[0]
            assert_kernels_close(cp(x, timestep=torch.tensor([0.5]), **kw)[0], want)
    assert len(cp.captures._fronts) == 2
    ref = serial_denoise(model, x, flow(), 2, model_kwargs=kw,
                         timestep_transform=lambda t: t / 1000)
    out = cp.denoise(x, flow(), 2, warmup_steps=2, patches=2, model_kwargs=kw,
                     timestep_transform=lambda t: t / 1000)
    assert_kernels_close(out, ref, depth=2)


def qwen_image_pipe():
    """A tiny QwenImagePipeline (Qwen2.5-VL text encoder, QwenImage VAE), built offline."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from tests.integration.test_diffusers_dropin import _tokenizer

    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage(base_dim=4, z_dim=4, dim_mult=[1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[0.0] * 4,
                                 latents_std=[1.0] * 4).eval()
    torch.manual_seed(0)
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 16,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default",
                             "type": "default"}}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
              "out_hidden_size": 16}
    encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, hidden_size=16, vocab_size=16)).eval()
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae,
                             text_encoder=encoder, tokenizer=_tokenizer(64),
                             transformer=_qwen_image(2))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_qwen_image_pipeline_through_compile_pipeline_at_two_resolutions() -> None:
    pytest.importorskip("tokenizers")
    import tppc.diffusers

    pipe = qwen_image_pipe()

    def call(height: int, width: int) -> torch.Tensor:
        return pipe("a red dog", height=height, width=width, num_inference_steps=2,
                    output_type="pt", generator=torch.Generator().manual_seed(0)).images

    sizes = ((32, 32), (48, 32))
    want = [call(*hw) for hw in sizes]
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, num_stages=2)
    for hw, ref in zip(sizes, want, strict=True):
        assert_kernels_close(call(*hw), ref, depth=2)
