"""A whole diffusers pipeline call on this CPU: predicted per component against measured.

``tppc.diffusers.plan_pipeline`` prices the text encoder and the VAE decoder (captured at the
call's shapes) and plans the transformer on one ``cpu`` device (one thread); the eager
``PixArtAlphaPipeline`` call is timed with a clock around each component's calls (hooks),
median of reps. PixArt-shaped: transformer hidden 384, depth 8, 1024 image tokens, guidance
(a batch of two); T5-shaped text encoder d 512, 4 layers, 64 tokens, called for the prompt
and the negative prompt; an SD-shaped VAE decoder (channels 64/128, 2 resnets per block)
from a 64x64 latent to a 128 px image.

Usage (under the shared lock, on an idle machine):
    flock -x /tmp/tppc_cpu.lock python benchmarks/pipeline_call.py [REPS] [STEPS]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict

import torch
from diffusers import (
    AutoencoderKL,
    DPMSolverMultistepScheduler,
    PixArtAlphaPipeline,
    PixArtTransformer2DModel,
)
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

from tppc.diffusers import plan_pipeline
from tppc.planner.workload import Workload

__all__: list[str] = []

PROMPT = "a photo of a cat on the grass"
TOKENS = 64


def _pipe() -> PixArtAlphaPipeline:
    words = PROMPT.split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                        eos_token="</s>", unk_token="<unk>",
                                        model_max_length=TOKENS)
    torch.manual_seed(0)
    text = T5EncoderModel(T5Config(vocab_size=16, d_model=512, d_kv=64, d_ff=1024,
                                   num_layers=4, num_heads=8, decoder_start_token_id=0,
                                   pad_token_id=0))
    vae = AutoencoderKL(block_out_channels=(64, 128), down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=2,
                        latent_channels=4, norm_num_groups=32)
    model = PixArtTransformer2DModel(
        num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
        num_layers=8, sample_size=64, patch_size=2, cross_attention_dim=384,
        caption_channels=512, norm_type="ada_norm_single", use_additional_conditions=False)
    pipe = PixArtAlphaPipeline(tokenizer=tokenizer, text_encoder=text.eval(), vae=vae.eval(),
                               transformer=model.eval(), scheduler=DPMSolverMultistepScheduler())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _timed(pipe: PixArtAlphaPipeline, steps: int) -> tuple[dict[str, float], tuple, float]:
    """Seconds per component in one call, the transformer's first inputs, the whole call."""
    spent: dict[str, float] = defaultdict(float)
    first: list[tuple] = []
    hooks = []
    for name, module in (("text_encoder", pipe.text_encoder), ("transformer", pipe.transformer)):
        def pre(m, a, k, name=name):
            if name == "transformer" and not first:
                first.append((a, k))
            m._t0 = time.perf_counter()

        def post(m, a, k, out, name=name):
            spent[name] += time.perf_counter() - m._t0

        hooks += [module.register_forward_pre_hook(pre, with_kwargs=True),
                  module.register_forward_hook(post, with_kwargs=True)]
    decode = pipe.vae.decode

    def timed_decode(*a, **k):
        start = time.perf_counter()
        out = decode(*a, **k)
        spent["vae.decode"] += time.perf_counter() - start
        return out

    pipe.vae.decode = timed_decode
    t0 = time.perf_counter()
    with torch.no_grad():
        pipe(PROMPT, num_inference_steps=steps, height=128, width=128, output_type="pil",
             clean_caption=False, use_resolution_binning=False, max_sequence_length=TOKENS,
             generator=torch.Generator().manual_seed(0))
    whole = time.perf_counter() - t0
    del pipe.vae.decode  # the instance attribute: the class's method again
    for h in hooks:
        h.remove()
    return dict(spent), first[0], whole


def main(reps: int = 5, steps: int = 10) -> None:
    torch.set_num_threads(1)
    pipe = _pipe()
    _timed(pipe, 2)  # warm the allocator and the kernels
    runs = [_timed(pipe, steps) for _ in range(reps)]
    measured = {k: statistics.median(r[0][k] for r in runs) for k in runs[0][0]}
    whole = statistics.median(r[2] for r in runs)
    args, kwargs = runs[0][1]
    pp = plan_pipeline(pipe, args, kwargs, cluster="1xcpu", num_stages=1,
                       workload=Workload(kind="diffusion", steps=steps, warmup_steps=steps),
                       prompt_tokens=TOKENS, encoder_calls=2)
    predicted = {c.name: c.seconds for c in pp.components}
    predicted["transformer"] = pp.transformer.latency
    print(f"PixArt-shaped pipeline, {steps} steps, 1 thread, median of {reps} "
          f"(whole call {whole * 1e3:.1f} ms measured, {pp.latency * 1e3:.1f} ms predicted)")
    print("| component | calls | measured (ms) | predicted (ms) | error |")
    print("|---|---|---|---|---|")
    for name in ("text_encoder", "transformer", "vae.decode"):
        calls = 2 if name == "text_encoder" else (steps if name == "transformer" else 1)
        m, p = measured[name], predicted[name]
        print(f"| {name} | {calls} | {m * 1e3:.1f} | {p * 1e3:.1f} | {p / m - 1:+.1%} |")
    parts = sum(measured.values())
    print(f"| whole call (incl. scheduler, tokenizer, image post-processing: "
          f"{(whole - parts) * 1e3:.1f} ms) | 1 | {whole * 1e3:.1f} | {pp.latency * 1e3:.1f} "
          f"| {pp.latency / whole - 1:+.1%} |")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
