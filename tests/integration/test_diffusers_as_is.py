"""diffusers pipelines as they are (issue 30): ``pipe.transformer = tppc.compile(...)`` as
with torch.compile, WanPipeline's ``cache_context`` keywords, and ``save_pretrained`` after
``tppc.diffusers.compile_pipeline``. Tiny random pipelines built offline
(:mod:`tests.integration.test_diffusers_dropin`); the oracle is the eager pipeline's call with
the same seed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("tokenizers")

import tppc
import tppc.diffusers
from tests.integration.test_diffusers_dropin import (
    _call,
    _tokenizer,
    dit_pipe,
    sd3_pipe,
)
from tests.oracles import assert_kernels_close


def test_a_compiled_transformer_assigned_to_the_pipeline_runs_its_float_timesteps(
        monkeypatch) -> None:
    """``pipe.transformer = tppc.compile(...)`` with an int64 example timestep: the pipeline
    reads ``config``/``dtype`` through it, and its flow-matching scheduler's float timesteps
    are served by a capture for float32 (one more), the call equal to eager."""
    pipe, call = sd3_pipe()
    pipe.set_progress_bar_config(disable=True)
    want = _call(pipe, call, steps=2)
    torch.manual_seed(1)
    example = {"hidden_states": torch.randn(2, 4, 8, 8),
               "encoder_hidden_states": torch.randn(2, 8, 16),
               "pooled_projections": torch.randn(2, 16), "timestep": torch.tensor([999, 999]),
               "return_dict": False}
    pipe.transformer = tppc.compile(pipe.transformer, (), example, num_stages=2)
    captured, real = [], tppc.pipeline.captures.capture_front_end

    def counted(model, args, kwargs, **kw):
        captured.append(kwargs["timestep"].dtype)
        return real(model, args, kwargs, **kw)

    monkeypatch.setattr("tppc.pipeline.captures.capture_front_end", counted)
    assert_kernels_close(_call(pipe, call, steps=2), want, depth=2)
    assert captured == [torch.float32]


def wan_pipe():
    """Wan 2.1: a video DiT whose pipeline calls ``cache_context("cond", step_index=...)``;
    guidance 5: a conditional and an unconditional stream."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                           latents_std=[1.0] * 4).eval()
    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=12, freq_dim=16, ffn_dim=16, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32).eval()
    torch.manual_seed(0)
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=12, d_kv=4, d_ff=16, num_layers=1,
                                 num_heads=2, decoder_start_token_id=0, pad_token_id=0)).eval()
    pipe = WanPipeline(tokenizer=_tokenizer(8), text_encoder=t5, vae=vae, transformer=model,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    return pipe, {"prompt": "a red dog", "negative_prompt": "a cat", "height": 32,
                  "width": 32, "num_frames": 5, "max_sequence_length": 8,
                  "guidance_scale": 5.0}


def test_wan_pipeline_call_equals_eager_with_every_step_warm() -> None:
    """diffusers 0.42's Wan passes ``step_index``, ``sigma`` and ``num_inference_steps`` to
    ``cache_context``: the drop-in takes them."""
    pipe, call = wan_pipe()
    pipe.set_progress_bar_config(disable=True)
    want = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, patches=2, num_stages=2)
    assert_kernels_close(_call(pipe, call, steps=2), want, depth=2)


def test_save_pretrained_saves_the_original_transformer(tmp_path) -> None:
    """After ``compile_pipeline`` (and a call), the saved pipeline loads back as a plain
    diffusers pipeline whose call equals the eager one bit for bit; the compiled pipeline
    keeps its drop-in. So after ``pipe.transformer = cp`` (a ``tppc.compile`` result): the
    pipeline registers the model's class (was the compiled pipeline's: ``save_pretrained``
    dropped the transformer, 'cannot be saved', and the saved pipeline did not load), a
    keyword the model does not declare is refused by name, and ``compile_pipeline`` over it
    compiles the model itself. A conversion of its weights through the pipeline (``pipe.to(
    torch.float64)``) is refused by name (was: done, and a float32 call ran the old weights)."""
    from diffusers import DiTPipeline, DiTTransformer2DModel

    pipe, call = dit_pipe()
    pipe.set_progress_bar_config(disable=True)
    model = pipe.transformer
    want = _call(pipe, call, steps=2)
    tppc.diffusers.compile_pipeline(pipe, num_stages=2)
    _call(pipe, call, steps=2)
    cp = next(iter(pipe.transformer.compiled.values()))  # a tppc.compile of the model
    pipe.save_pretrained(tmp_path / "dropin")
    assert isinstance(pipe.transformer, tppc.diffusers.PipeFusionTransformer)
    pipe.transformer = cp  # as with torch.compile
    assert isinstance(pipe.transformer, DiTTransformer2DModel) and type(cp) is not type(model)
    assert tuple(pipe.config.transformer) == ("diffusers", "DiTTransformer2DModel")
    with pytest.raises(tppc.RuntimeInputError, match="unexpected keyword argument 'colour'"):
        cp(torch.randn(2, 4, 8, 8), timestep=torch.tensor([1, 1]), colour=3)
    pipe.save_pretrained(tmp_path / "compiled")
    pipe.to("cpu")  # changes nothing: reaches the model
    with pytest.raises(tppc.SpecError, match=r"DiTTransformer2DModel.to\(None, torch.float64\) "
                       r"after tppc.compile: the compiled program keeps the weights it was "
                       r"compiled with \(torch.float32 on cpu\)"):
        pipe.to(torch.float64)  # was: converted the model, a float32 call ran the old weights
    assert model.dtype == torch.float32
    model.double()  # past the compiled pipeline: its calls are refused
    with pytest.raises(tppc.RuntimeInputError, match="weights are torch.float64 on cpu, but it "
                                                     "was compiled with torch.float32"):
        cp(torch.randn(2, 4, 8, 8), timestep=torch.tensor([1, 1]))
    model.float()
    for saved in ("dropin", "compiled"):
        back = DiTPipeline.from_pretrained(tmp_path / saved)
        back.set_progress_bar_config(disable=True)
        assert type(back.transformer) is DiTTransformer2DModel
        torch.testing.assert_close(_call(back, call, steps=2), want, rtol=0, atol=0)
    tppc.diffusers.compile_pipeline(pipe, num_stages=2)
    assert pipe.transformer.model is model


def chroma_pipe():
    """Chroma: Flux's blocks, one T5 encoder; its pipeline passes ``attention_mask`` over the
    joint text + image sequence."""
    from diffusers import (
        ChromaPipeline,
        ChromaTransformer2DModel,
        FlowMatchEulerDiscreteScheduler,
    )

    from tests.integration.test_diffusers_dropin import _t5, _vae

    torch.manual_seed(0)
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=12, axes_dims_rope=(2, 2, 4),
        approximator_num_channels=8, approximator_hidden_dim=16, approximator_layers=1).eval()
    pipe = ChromaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(),
                          vae=_vae(shift_factor=0.1, scaling_factor=0.5), text_encoder=_t5(),
                          tokenizer=_tokenizer(8), transformer=model)
    return pipe, {"prompt": "a red dog", "negative_prompt": "a cat", "height": 16,
                  "width": 16, "max_sequence_length": 8}


def test_chromas_pipeline_with_its_joint_attention_mask_equals_eager() -> None:
    """ChromaPipeline passes ``attention_mask`` over ``[text | image]`` (8 + 16 tokens), a
    float 0/1 that SDPA adds to the scores (``m_i · m_j``: +1, not a mask). Captured with its
    length as 8 + the tokens and run by its rows per chunk: every step warm equals eager, at
    a second resolution too (was: refused)."""
    pipe, call = chroma_pipe()
    pipe.set_progress_bar_config(disable=True)
    wants = [_call(pipe, dict(call, height=h), steps=2) for h in (16, 24)]
    tppc.diffusers.compile_pipeline(pipe, warmup_steps=None, num_stages=2)
    for h, want in zip((16, 24), wants, strict=True):
        torch.testing.assert_close(_call(pipe, dict(call, height=h), steps=2), want,
                                   rtol=0, atol=0)
    cp = next(iter(pipe.transformer.compiled.values()))
    assert cp.context.joint_inputs == {"attention_mask": (1, 8)}


def _chroma_inputs(rows: int, cols: int) -> tuple[tuple, dict]:
    """A Chroma call on ``rows × cols`` tokens whose joint mask hides text pads and weighs
    image keys (0 and 0.5), so that a chunk reading another chunk's rows differs."""
    tokens = rows * cols
    mask = torch.ones(1, 8 + tokens)
    mask[:, 6:8] = 0
    mask[:, 8 + 5], mask[:, 8 + tokens - 2] = 0.0, 0.5
    ids = torch.zeros(tokens, 3)
    ids[:, 1], ids[:, 2] = torch.arange(tokens) // cols, torch.arange(tokens) % cols
    return (torch.randn(1, tokens, 16),), {
        "encoder_hidden_states": torch.randn(1, 8, 12), "timestep": torch.tensor([0.5]),
        "img_ids": ids, "txt_ids": torch.zeros(8, 3), "attention_mask": mask,
        "return_dict": False}


def test_chromas_joint_mask_rows_follow_each_patch() -> None:
    """Stale patches read the mask's rows of their own queries: a stale call on the input of
    the warm call before it (so every stale K/V is fresh) equals eager exactly, for 2 and 4
    patches (the first patch carries the text rows, a later one starts 8 + its start)."""
    model = chroma_pipe()[0].transformer
    torch.manual_seed(3)
    args, kwargs = _chroma_inputs(8, 4)
    with torch.no_grad():
        want = model(*args, **kwargs)[0]
        for patches in (2, 4):
            tr = tppc.diffusers.PipeFusionTransformer(model, warmup_steps=1, patches=patches,
                                                      num_stages=2)
            torch.testing.assert_close(tr(*args, **kwargs)[0], want, rtol=0, atol=0)
            torch.testing.assert_close(tr(*args, **kwargs)[0], want, rtol=0, atol=0)
    cp = next(iter(tr.compiled.values()))
    taller = _chroma_inputs(12, 4)
    with torch.no_grad():
        torch.testing.assert_close(cp(*taller[0], **taller[1])[0],
                                   model(*taller[0], **taller[1])[0], rtol=0, atol=0)
    short = dict(taller[1], attention_mask=kwargs["attention_mask"])
    with pytest.raises(tppc.RuntimeInputError, match=r"input 'attention_mask' axis 1 has 40 "
                       r"entries, but it spans the joint sequence: 8 context positions "
                       r"\(compiled\) \+ the call's 48 tokens = 56"):
        cp(*taller[0], **short)


def test_kandinsky5s_channels_last_latent_is_refused_by_name_before_capture() -> None:
    """Kandinsky 5's latents are ``(b, frames, h, w, channels)``: tppc's latent rule took
    their width for patch rows. With its zero-initialised adaLN gates (an untrained model's
    blocks are identities) the program was 'exact' and stale patches equalled exact ones bit
    for bit; with trained gates validation refused it as a tppc bug. Now a named refusal
    before any capture, also when its frames equal its channels (4 and 4 here)."""
    from diffusers import Kandinsky5Transformer3DModel

    torch.manual_seed(0)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=8, time_dim=16, out_visual_dim=4,
        model_dim=32, ff_dim=64, num_text_blocks=1, num_visual_blocks=1,
        axes_dims=(4, 6, 6)).eval()
    kwargs = {"encoder_hidden_states": torch.randn(1, 5, 16), "timestep": torch.tensor([0.5]),
              "pooled_projections": torch.randn(1, 8), "text_rope_pos": torch.arange(5),
              "visual_rope_pos": [torch.arange(4), torch.arange(4), torch.arange(4)],
              "return_dict": False}
    with pytest.raises(tppc.CaptureError, match=r"input 'hidden_states' of Kandinsky5"
                       r"Transformer3DModel is a channels-last video latent .* \(1, 4, 8, 8, 4\) "
                       r"\(its last axis is config.in_visual_dim = 4\).* fix: run this model "
                       r"eagerly"):
        tppc.compile(model, (torch.randn(1, 4, 8, 8, 4),), kwargs, num_stages=2)
