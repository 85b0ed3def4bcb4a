"""GPU fidelity: tppc's predictions against PipeFusion's published PixArt-alpha latencies.

The published rows (:data:`PUBLISHED`) come from the PipeFusion / xDiT repository
(``legacy/scripts/plots/line.py`` and ``legacy/scripts/plots/A100(NVLink)-latency.py``, the
data behind ``docs/performance/pixart_alpha_legacy.md``): PixArt-XL-2-1024-MS, fp16,
20 DPM-Solver steps, 1 warm-up step, classifier-free guidance batched (the transformer runs
on batch 2), ``output_type="latent"`` (the VAE does not run), timed around one pipeline
call (``legacy/scripts/pixart_example.py``, ``legacy/scripts/benchmark.sh``).

tppc plans diffusers' ``PixArtTransformer2DModel`` built from the checkpoint's config on the
meta device (captured at 1024 px on batch 2, priced at each resolution's token count) on
``N×a100-pcie`` (PCIe Gen4) or ``N×a100-80gb`` (NVLink 3). The published runs' schedule is
priced as it ran: PipeFusion's legacy loop runs ``timesteps[: warmup_steps + 1]``
synchronously (``legacy/pipefuser/pipelines/pip/distri_pixartalpha.py``), so
``--pipefusion_warmup_step 1`` is 2 synchronous steps and 18 pipelined ones:
:data:`PUBLISHED_WORKLOAD`. tppc's own schedule (1 warm-up step, the issue's
:data:`WORKLOAD`) is printed beside it. The timed call also runs the T5-XXL text encoder twice (prompt
and negative prompt, 120 tokens each, on every rank): :func:`text_encoder_seconds` captures
it on meta (:func:`tppc.frontend.static_export.export_static`) and prices every node with the
same device constants as the transformer (:func:`tppc.cost_models.call_costs.price_call`;
about 2 % of the 1024 px single-device time, 0.05 % at 4096 px); it is added to every
prediction. The VAE is not run (its price is printed for reference).

Rows marked ``goal`` are the issue's (single-device within 25 %, speed-ups within 10 %);
the others were not used to choose any constant and show how the same model holds.

    python benchmarks/gpu_fidelity.py [--all]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import cache

import torch

from tppc.cost_models.call_costs import CallCost, price_call
from tppc.cost_models.cluster import device_preset
from tppc.cost_models.layer_costs import build_cost_table
from tppc.frontend.static_export import export_static
from tppc.planner import plan_for
from tppc.planner.devices import sub_table
from tppc.planner.grid import plan_any_length
from tppc.planner.workload import Workload

WORKLOAD = Workload(kind="diffusion", steps=20, warmup_steps=1)
PUBLISHED_WORKLOAD = Workload(kind="diffusion", steps=20, warmup_steps=2)
BATCH = 2  # classifier-free guidance, batched
TEXT_TOKENS = 120


@dataclass(frozen=True)
class Row:
    """One published latency: ``devices`` A100s on ``link`` at ``pixels``², seconds."""

    pixels: int
    devices: int
    link: str  # "pcie" (A100 80GB PCIe) or "nvlink" (A100 80GB SXM4)
    seconds: float
    goal: bool = False

    @property
    def cluster(self) -> str:
        device = "a100-pcie" if self.link == "pcie" else "a100-80gb"
        return f"{self.devices}x{device}"


PUBLISHED: tuple[Row, ...] = (
    # The rows: serial "Original" and PipeFusion on 4×A100 PCIe (line.py).
    Row(1024, 1, "pcie", 2.085, goal=True),
    Row(1024, 4, "pcie", 0.866, goal=True),
    Row(4096, 1, "pcie", 183.6, goal=True),
    Row(4096, 4, "pcie", 60.15, goal=True),
    # Not given: 2 PCIe GPUs, 2048 px serial, PipeFusion on NVLink (line.py and
    # A100(NVLink)-latency.py).
    Row(1024, 2, "pcie", 1.235),
    Row(4096, 2, "pcie", 101.7),
    Row(2048, 1, "pcie", 16.22),
    Row(1024, 2, "nvlink", 1.358),
    Row(1024, 4, "nvlink", 0.9633),
    Row(1024, 8, "nvlink", 0.969),
    Row(4096, 2, "nvlink", 101.0),
    Row(4096, 4, "nvlink", 60.10),
    Row(4096, 8, "nvlink", 42.79),
)
"""Published whole-pipeline seconds; a row with ``devices > 1`` is also a speed-up over the
single-device row of its resolution."""


def serial_row(row: Row) -> Row:
    """The published single-device row of ``row``'s resolution."""
    return next(r for r in PUBLISHED if r.pixels == row.pixels and r.devices == 1)


@cache
def pixart_front():
    """PixArt-XL-2-1024-MS's transformer on meta, captured at 1024 px on batch 2."""
    from diffusers import PixArtTransformer2DModel

    from tppc.frontend.front_end import capture_front_end

    half = torch.half
    with torch.device("meta"):
        model = PixArtTransformer2DModel(
            num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
            num_layers=28, sample_size=128, patch_size=2, cross_attention_dim=1152,
            caption_channels=4096, norm_type="ada_norm_single", num_embeds_ada_norm=1000,
            norm_elementwise_affine=False, norm_eps=1e-6, attention_bias=True,
            activation_fn="gelu-approximate", use_additional_conditions=True).eval().half()
        kwargs = {"encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, 4096, dtype=half),
                  "timestep": torch.tensor([10] * BATCH),
                  "added_cond_kwargs": {"resolution": torch.zeros(BATCH, 2, dtype=half),
                                        "aspect_ratio": torch.zeros(BATCH, 1, dtype=half)},
                  "return_dict": False}
        args = (torch.randn(BATCH, 4, 128, 128, dtype=half),)
    return capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)


@cache
def t5_graph() -> torch.fx.GraphModule:
    """PixArt's text encoder, T5-XXL's encoder (24 layers, d 4096, gated FFN 10240), built
    on meta and captured at fixed shapes on one prompt of :data:`TEXT_TOKENS` tokens."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64,
                                     d_kv=64, vocab_size=32128,
                                     feed_forward_proj="gated-gelu")).eval().half()
    return export_static(t5, (torch.zeros(1, TEXT_TOKENS, dtype=torch.long),))


@cache
def vae_decode(device_name: str, pixels: int) -> CallCost:
    """The SD VAE decoder PixArt uses (4 up blocks, 128-512 channels) on one image."""
    from diffusers import AutoencoderKL

    with torch.device("meta"):
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                            down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
                            block_out_channels=(128, 256, 512, 512)).eval().half()
    latent = torch.zeros(1, 4, pixels // 8, pixels // 8, dtype=torch.half)
    return price_call(export_static(vae, (latent,), method="decode"), device_preset(device_name))


def text_encoder_seconds(device_name: str) -> float:
    """The prompt and the negative prompt through the captured T5-XXL encoder, each call
    priced node by node with the transformer's device constants (:func:`price_call`)."""
    return 2 * price_call(t5_graph(), device_preset(device_name)).seconds


@cache
def predict(row: Row, workload: Workload = PUBLISHED_WORKLOAD, time_limit: float = 10.0
            ) -> float:
    """tppc's whole-pipeline seconds for ``row`` (transformer plan + text encoder)."""
    front = pixart_front()
    ctx = front.ctx
    tokens, per_row = (row.pixels // 16) ** 2, row.pixels // 16

    def table_at(length: int):
        return build_cost_table(front.chunk, ctx.layers, row.cluster, length,
                                seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)

    if row.devices == 1:
        table = sub_table(table_at(tokens), (0,))
        latency = plan_for(table, (0, table.num_layers), (0, tokens), workload).latency
    else:
        latency = plan_any_length(table_at, tokens, num_stages=row.devices, workload=workload,
                                  granularity=per_row, time_limit=time_limit).latency
    return latency + text_encoder_seconds(row.cluster.split("x", 1)[1])


def errors(rows: tuple[Row, ...], workload: Workload = PUBLISHED_WORKLOAD,
           time_limit: float = 10.0) -> list[dict]:
    """Per row: predicted and published seconds and speed-ups, relative errors."""
    out = []
    for row in rows:
        predicted = predict(row, workload, time_limit)
        entry = {"row": row, "predicted": predicted, "error": predicted / row.seconds - 1}
        if row.devices > 1:
            base = serial_row(row)
            published = base.seconds / row.seconds
            serial = predict(Row(row.pixels, 1, row.link, base.seconds, base.goal), workload,
                             time_limit)
            entry.update(published_speedup=published, speedup=serial / predicted,
                         speedup_error=serial / predicted / published - 1)
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also the rows not given")
    parser.add_argument("--tppc-schedule", action="store_true",
                        help="price tppc's own schedule (1 warm-up step), not the published")
    ns = parser.parse_args()
    rows = PUBLISHED if ns.all else tuple(r for r in PUBLISHED if r.goal)
    workload = WORKLOAD if ns.tppc_schedule else PUBLISHED_WORKLOAD
    t0 = time.perf_counter()
    print(f"workload: {workload}")
    print("| setup | image | published (s) | tppc (s) | error | published speed-up "
          "| tppc speed-up | error | rows |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in errors(rows, workload):
        r = e["row"]
        speed = (f"{e['published_speedup']:.2f}× | {e['speedup']:.2f}× | "
                 f"{e['speedup_error']:+.1%}") if "speedup" in e else "– | – | –"
        print(f"| {r.devices}×A100 {r.link} | {r.pixels} px | {r.seconds:g} | "
              f"{e['predicted']:.3f} | {e['error']:+.1%} | {speed} | "
              f"{'goal' if r.goal else 'held out'} |", flush=True)
    vae = vae_decode("a100-pcie", 1024)
    print(f"\ntext encoder (T5-XXL captured on meta, 2 × {TEXT_TOKENS} tokens) on a100-pcie: "
          f"{text_encoder_seconds('a100-pcie') * 1e3:.1f} ms; the VAE decoder (not in these "
          f"runs: output_type='latent') would add {vae.seconds * 1e3:.1f} ms at 1024 px "
          f"({vae.matrix_flops / 1e12:.1f} TFLOP); {time.perf_counter() - t0:.1f} s in all")


if __name__ == "__main__":
    main()
