"""The drop-in on this CPU: an unchanged ``PixArtAlphaPipeline`` call (20 steps, guidance
4.5: a batch of two, 1024 image tokens) or ``CogVideoXPipeline`` call (``video``: 2 latent
frames of 512 tokens, guidance 6) with the eager transformer against
``tppc.diffusers.compile_pipeline`` (2 stages x 1 thread), and ``cp.denoise`` on the same
compiled transformer (the steps overlap there), side by side, min and median of reps.

Usage (under the shared lock):
    flock -x /tmp/tppc_cpu.lock python benchmarks/diffusers_dropin.py [REPS] [STEPS] [pixart|video]
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
    DPMSolverMultistepScheduler,
    PixArtAlphaPipeline,
    PixArtTransformer2DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

import tppc.diffusers

__all__: list[str] = []

PROMPT = "a photo of a cat on the grass"


def _tokenizer() -> PreTrainedTokenizerFast:
    words = PROMPT.split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=16)


def _t5() -> T5EncoderModel:
    torch.manual_seed(0)
    return T5EncoderModel(T5Config(vocab_size=16, d_model=64, d_kv=16, d_ff=64, num_layers=1,
                                   num_heads=4, decoder_start_token_id=0,
                                   pad_token_id=0)).eval()


def _pipe() -> PixArtAlphaPipeline:
    """PixArt-shaped: hidden 384 (6 heads), depth 8, 64x64 latent (patch 2: 1024 tokens)."""
    text = _t5()
    vae = AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1,
                        latent_channels=4, norm_num_groups=4)
    model = PixArtTransformer2DModel(
        num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
        num_layers=8, sample_size=64, patch_size=2, cross_attention_dim=384,
        caption_channels=64, norm_type="ada_norm_single", use_additional_conditions=False)
    pipe = PixArtAlphaPipeline(tokenizer=_tokenizer(), text_encoder=text, vae=vae.eval(),
                               transformer=model.eval(), scheduler=DPMSolverMultistepScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _call(pipe: PixArtAlphaPipeline, steps: int) -> torch.Tensor:
    return pipe(PROMPT, num_inference_steps=steps, height=128, width=128, output_type="latent",
                clean_caption=False, use_resolution_binning=False, max_sequence_length=16,
                generator=torch.Generator().manual_seed(0)).images


def _guided(scale: float, channels: int, dim: int = 1):
    """Classifier-free guidance of a batch of two as a ``denoise`` output transform."""

    def guided(out: torch.Tensor) -> torch.Tensor:
        u, c = out.narrow(dim, 0, channels).float().chunk(2)
        g = u + scale * (c - u)
        return torch.cat([g, g])
    return guided


def _denoise(pipe: PixArtAlphaPipeline, cp: object, steps: int, patches: int) -> torch.Tensor:
    """PixArt's loop through ``cp.denoise``: guidance and the learned sigma as the transform."""
    pe, pm, npe, npm = pipe.encode_prompt(PROMPT, True, max_sequence_length=16,
                                          clean_caption=False)
    x = torch.randn(1, 4, 64, 64, generator=torch.Generator().manual_seed(0))
    kw = {"encoder_hidden_states": torch.cat([npe, pe]),
          "encoder_attention_mask": torch.cat([npm, pm]),
          "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}, "return_dict": False}
    return cp.denoise(torch.cat([x, x]), DPMSolverMultistepScheduler(), steps, warmup_steps=1,
                      patches=patches, model_kwargs=kw, output_transform=_guided(4.5, 4))


def _video_pipe() -> CogVideoXPipeline:
    """CogVideoX-shaped: hidden 384 (6 heads), depth 8, 2 latent frames of 32x64 (patch 2:
    2 x 512 video tokens after 16 text tokens), sincos positions."""
    text = _t5()
    torch.manual_seed(0)
    vae = AutoencoderKLCogVideoX(
        in_channels=3, out_channels=3, down_block_types=("CogVideoXDownBlock3D",) * 2,
        up_block_types=("CogVideoXUpBlock3D",) * 2, block_out_channels=(8, 8),
        latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4, sample_height=64, sample_width=128).eval()
    model = CogVideoXTransformer3DModel(
        num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=4,
        num_layers=8, sample_width=64, sample_height=32, sample_frames=5, patch_size=2,
        text_embed_dim=64, time_embed_dim=64, max_text_seq_length=16,
        temporal_compression_ratio=4).eval()
    pipe = CogVideoXPipeline(tokenizer=_tokenizer(), text_encoder=text, vae=vae,
                             transformer=model, scheduler=CogVideoXDDIMScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _video_call(pipe: CogVideoXPipeline, steps: int) -> torch.Tensor:
    return pipe(PROMPT, num_inference_steps=steps, height=64, width=128, num_frames=5,
                max_sequence_length=16, output_type="latent",
                generator=torch.Generator().manual_seed(0)).frames


def _video_denoise(pipe: CogVideoXPipeline, cp: object, steps: int, patches: int
                   ) -> torch.Tensor:
    """CogVideoX's loop through ``cp.denoise``: guidance 6 as the output transform."""
    pe, npe = pipe.encode_prompt(PROMPT, None, True, max_sequence_length=16)
    x = torch.randn(1, 2, 4, 32, 64, generator=torch.Generator().manual_seed(0))
    kw = {"encoder_hidden_states": torch.cat([npe, pe]), "image_rotary_emb": None,
          "attention_kwargs": None, "return_dict": False}
    return cp.denoise(torch.cat([x, x]), CogVideoXDDIMScheduler(), steps, warmup_steps=1,
                      patches=patches, model_kwargs=kw, output_transform=_guided(6.0, 4, 2))


MODELS = {"pixart": ("PixArt-shaped pipeline (hidden 384, depth 8, 1024 image tokens, "
                     "guidance: batch 2)", _pipe, _call, _denoise, "DPM-Solver"),
          "video": ("CogVideoX-shaped pipeline (hidden 384, depth 8, 2 latent frames x 512 "
                    "tokens, guidance: batch 2)", _video_pipe, _video_call, _video_denoise,
                    "CogVideoX-DDIM")}


def main(reps: int = 3, steps: int = 20, which: str = "pixart") -> None:
    title, make, call, den_loop, sched = MODELS[which]
    pipe = make()
    eager = pipe.transformer
    opts = {"num_stages": 2, "threads_per_stage": 1, "executor": "threads"}
    runs: dict[str, object] = {}

    def eager_run(threads: int) -> object:
        def run() -> None:
            pipe.transformer = eager
            torch.set_num_threads(threads)
            call(pipe, steps)
        return run

    runs["eager pipeline, 1 thread"] = eager_run(1)
    runs["eager pipeline, 2 threads"] = eager_run(2)
    adapters = {}
    for name, warm, patches in (("drop-in, every step warm", None, None),
                                ("drop-in, 1 warm-up, 2 patches", 1, 2),
                                ("drop-in, 1 warm-up, 4 patches", 1, 4)):
        pipe.transformer = eager
        tppc.diffusers.compile_pipeline(pipe, warmup_steps=warm, patches=patches, **opts)
        adapters[name] = pipe.transformer
        torch.set_num_threads(1)
        call(pipe, 2)  # compiles (untimed)

        def run(adapter: object = adapters[name]) -> None:
            pipe.transformer = adapter
            torch.set_num_threads(1)
            call(pipe, steps)
        runs[name] = run
    cp = next(iter(adapters["drop-in, 1 warm-up, 2 patches"].compiled.values()))
    for patches in (2, 4):
        den_loop(pipe, cp, 2, patches)  # the patch programs (untimed)

        def den(patches: int = patches) -> None:
            torch.set_num_threads(1)
            den_loop(pipe, cp, steps, patches)
        runs[f"cp.denoise, 1 warm-up, {patches} patches (steps overlap)"] = den
    times: dict[str, list[float]] = {name: [] for name in runs}
    load = os.getloadavg()[0]
    for _ in range(reps):  # side by side: every run once per rep
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    base = min(times["eager pipeline, 1 thread"])
    print(f"{title}, {steps} {sched} steps, output_type='latent', {reps} reps, load "
          f"{load:.2f} before / {os.getloadavg()[0]:.2f} after")
    print("| run | min (s) | median (s) | vs eager 1 thread (min) |\n|---|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {min(ts):.2f} | {statistics.median(ts):.2f} | "
              f"{base / min(ts):.2f}x |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4])
