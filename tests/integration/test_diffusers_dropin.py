"""The drop-in (issue 21): ``tppc.diffusers.compile_pipeline(pipe)`` and the unchanged
pipeline call. Tiny random pipelines built offline (word-level tokenizers from a small
vocabulary, text encoders and VAE from tiny configs); the oracle is the eager pipeline's call
with the same generator seed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
tokenizers = pytest.importorskip("tokenizers")

import tppc.diffusers  # noqa: E402
from tests.oracles import assert_kernels_close  # noqa: E402
from tppc.diffusers import PipeFusionTransformer  # noqa: E402

WORDS = ["a", "cat", "dog", "red", "blue", "photo", "of", "the", "on", "grass"]


def _tokenizer(max_len: int):
    """A word-level tokenizer of :data:`WORDS` (what T5's and CLIP's tokenizers return)."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=max_len)


def _vae(**kw):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                         latent_channels=4, norm_num_groups=4, sample_size=16, **kw).eval()


def _t5():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    return T5EncoderModel(T5Config(vocab_size=16, d_model=12, d_kv=4, d_ff=16, num_layers=1,
                                   num_heads=2, decoder_start_token_id=0,
                                   pad_token_id=0)).eval()


def _clip():
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    return CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=10, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        max_position_embeddings=16, projection_dim=10,
                                        eos_token_id=1, pad_token_id=0, bos_token_id=0)).eval()


def dit_pipe():
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    torch.manual_seed(0)
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=8, num_layers=2, sample_size=8, patch_size=2,
                                  num_embeds_ada_norm=1000, norm_type="ada_norm_zero").eval()
    pipe = DiTPipeline(transformer=model, vae=_vae(), scheduler=DDIMScheduler())
    return pipe, {"class_labels": [1]}  # guidance 4: a batch of two (class 1000 unconditional)


def pixart_pipe():
    from diffusers import (
        DPMSolverMultistepScheduler,
        PixArtAlphaPipeline,
        PixArtTransformer2DModel,
    )

    torch.manual_seed(0)
    model = PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
        num_layers=2, sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12,
        norm_type="ada_norm_single", use_additional_conditions=False).eval()
    pipe = PixArtAlphaPipeline(tokenizer=_tokenizer(8), text_encoder=_t5(), vae=_vae(),
                               transformer=model, scheduler=DPMSolverMultistepScheduler())
    return pipe, {"prompt": "a cat on the grass", "clean_caption": False, "height": 16,
                  "width": 16, "use_resolution_binning": False, "max_sequence_length": 8}


def flux_pipe():
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, pooled_projection_dim=10,
        axes_dims_rope=(2, 2, 4)).eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True),
        vae=_vae(shift_factor=0.1, scaling_factor=0.5), text_encoder=_clip(),
        tokenizer=_tokenizer(16), text_encoder_2=_t5(), tokenizer_2=_tokenizer(8),
        transformer=model)
    return pipe, {"prompt": "a red dog", "height": 16, "width": 16, "max_sequence_length": 8}


def _clip_projected(hidden: int = 8):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(0)
    return CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=16, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=16, projection_dim=8, eos_token_id=1,
        pad_token_id=0, bos_token_id=0)).eval()


def sd3_pipe():
    """Two CLIP encoders (8 + 8 channels, padded to T5's 16) and T5; text after the image."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
        caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=16).eval()
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=16, d_kv=4, d_ff=16, num_layers=1,
                                 num_heads=2, decoder_start_token_id=0, pad_token_id=0)).eval()
    pipe = StableDiffusion3Pipeline(
        transformer=model, scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=_vae(shift_factor=0.1, scaling_factor=0.5), text_encoder=_clip_projected(),
        tokenizer=_tokenizer(16), text_encoder_2=_clip_projected(), tokenizer_2=_tokenizer(16),
        text_encoder_3=t5, tokenizer_3=_tokenizer(8))
    return pipe, {"prompt": "a red dog", "height": 16, "width": 16, "max_sequence_length": 8}


def test_sd3_pipeline_call_equals_eager_with_every_step_warm() -> None:
    """SD3 joins the text after the image tokens; guidance 7: a batch of two."""
    pipe, call = sd3_pipe()
    pipe.set_progress_bar_config(disable=True)
    want = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=2,
                                    executor="threads")
    assert_kernels_close(_call(pipe, call, steps=2), want, depth=2)


def cogvideox_pipe():
    """A video pipeline: latents of 2 frames (5 video frames), stale bands of rows in every
    frame."""
    from diffusers import (
        AutoencoderKLCogVideoX,
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        CogVideoXTransformer3DModel,
    )

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=2, sample_width=8, sample_height=8, sample_frames=5, patch_size=2,
        text_embed_dim=12, time_embed_dim=8, max_text_seq_length=8,
        temporal_compression_ratio=4).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 2,
        up_block_types=("CogVideoXUpBlock3D",) * 2, block_out_channels=(8, 8),
        latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4, sample_height=16, sample_width=16).eval()
    pipe = CogVideoXPipeline(tokenizer=_tokenizer(8), text_encoder=_t5(), vae=vae,
                             transformer=model, scheduler=CogVideoXDDIMScheduler())
    return pipe, {"prompt": "a red dog", "height": 16, "width": 16, "num_frames": 5,
                  "max_sequence_length": 8, "guidance_scale": 1.0}


def _call(pipe, call, steps=3):
    out = pipe(generator=torch.Generator().manual_seed(0), num_inference_steps=steps,
               output_type="np", **call)
    return torch.as_tensor(out.frames if hasattr(out, "frames") else out.images)


@pytest.fixture(scope="module", params=[dit_pipe, pixart_pipe, flux_pipe],
            ids=["DiTPipeline", "PixArtAlphaPipeline", "FluxPipeline"])
def pipeline(request):
    """(pipeline, its call's arguments, the eager call's images)."""
    pipe, call = request.param()
    pipe.set_progress_bar_config(disable=True)
    return pipe, call, _call(pipe, call)


def test_the_pipeline_call_equals_eager_with_every_step_warm(pipeline) -> None:
    pipe, call, want = pipeline
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=2,
                                    executor="threads")
    assert isinstance(pipe.transformer, PipeFusionTransformer)
    assert_kernels_close(_call(pipe, call), want, depth=3)


def test_stale_patches_run_through_the_stages_and_each_call_starts_warm(pipeline) -> None:
    """After one warm step the patches see one-step-stale K/V (not the eager result), the
    threads executor equals the serial reference bit for bit, and a second pipeline call
    starts a new loop (warm again), so it repeats the first."""
    pipe, call, want = pipeline
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=1, patches=2, num_stages=2,
                                    executor="threads")
    got = _call(pipe, call)
    assert torch.isfinite(got).all() and not torch.equal(got, want)
    torch.testing.assert_close(_call(pipe, call), got, rtol=0, atol=0)
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=1, patches=2, num_stages=2,
                                    executor="local")
    torch.testing.assert_close(_call(pipe, call), got, rtol=0, atol=0)


def test_a_video_pipeline_call_equals_eager_with_every_step_warm() -> None:
    pipe, call = cogvideox_pipe()
    pipe.set_progress_bar_config(disable=True)
    want = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=2)
    assert_kernels_close(_call(pipe, call, steps=2), want, depth=2)


def test_the_adapter_answers_what_pipelines_read() -> None:
    pipe, _ = dit_pipe()
    model = pipe.transformer
    tppc.diffusers.compile_pipeline(pipe, num_stages=2)
    adapter = pipe.transformer
    assert adapter.config is model.config and adapter.dtype == torch.float32
    assert adapter.device == torch.device("cpu") and pipe._execution_device.type == "cpu"
    assert adapter.num_embeds_ada_norm == model.num_embeds_ada_norm  # any other attribute
    assert pipe.config.transformer[1] == "PipeFusionTransformer"  # registered by the pipeline
    x = torch.randn(1, 4, 8, 8)
    kwargs = {"timestep": torch.tensor([10]), "class_labels": torch.tensor([3])}
    with torch.no_grad():
        out = adapter(x, **kwargs)  # return_dict=True: the model's output class
        assert_kernels_close(out.sample, model(x, **kwargs).sample)
        assert isinstance(adapter(x, **kwargs, return_dict=False), tuple)


def test_one_drop_in_serves_two_resolutions_each_equal_to_eager() -> None:
    """The pipeline at its transformer's sample size (16 px: an 8x8 latent), then at 16x24
    px (8x12): the second size is captured again inside the same compiled pipeline."""
    pipe, call = pixart_pipe()
    pipe.set_progress_bar_config(disable=True)
    sizes = [{"height": 16, "width": 16}, {"height": 16, "width": 24}]
    want = [_call(pipe, {**call, **size}, steps=2) for size in sizes]
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=2)
    for size, eager in zip(sizes, want, strict=True):
        assert_kernels_close(_call(pipe, {**call, **size}, steps=2), eager, depth=2)
    assert len(pipe.transformer.compiled) == 1  # one compile for both sizes
