"""DiT hybrid plans (CFG x Ulysses x Ring x TP x PipeFusion) predicted next to xDiT's tables.

Run: PYTHONPATH=. .venv/bin/python benchmarks/dit_predictions.py [--only flux|stepvideo|cpu]

Models are built on the meta device (no weights, no download), captured the way
``tppc.plan`` does it (two blocks of each kind exported, the layer list re-expanded) and
priced by the cost model: a group's layers at one worker's share (``mesh_node_cost``) plus
the group's exchanges on its own links (``MeshExchanges``: Ulysses' all-to-alls, the ring's
K/V passes hidden behind attention, TP's all-reduces, the output gather), through the same
search as ``tppc.plan`` (``mesh_configurations`` + ``plan_hybrid``). No constant here was
fitted to the published rows: the GPU presets are issue 20's (MAMF GEMM rates, FA2 curve,
15 us of host time per eager op; ``BENCHMARKS.md``), the links are measured point-to-point
rates.

Efficiency models:
    eager ("PyTorch" column): every op its own kernel and host launch (the presets as they
        are: ``fuse_elementwise=False``).
    compiled ("torch.compile" column): elementwise ops fused into their producers
        (``fuse_elementwise=True``: no memory traffic, launch or host time of their own), as
        inductor fuses them; GEMMs and attention priced alike. Text encoders and the VAE
        stay eager in both (xDiT compiles the transformer only).

Rows:
    FLUX.1-dev, 28 steps, 1024 px (4096 image + 512 text tokens, batch 1: guidance
        distilled, no CFG), 4 x H100 SXM (NVLink 4): xDiT docs/performance/flux.md.
        Every step warm (USP runs the whole sequence each step). The timed call also runs
        T5-XXL (512 tokens) and CLIP-L (77) once and the VAE decoder once: priced the same
        way (``price_call``) and added to every row.
    Step-Video-T2V 30B on 8 x H20: xDiT docs/performance/stepvideo.md (TP8 / SP8 Ulysses /
        1 GPU). Step-Video is not in diffusers: the stand-in is diffusers' Wan block (self-
        attention with rope and QK-norm, cross-attention, GELU FFN, a modulation table) at
        Step-Video's shape (48 blocks, 48 heads x 128, FFN 24576, 64 latent channels, patch
        1): 29.0 B parameters. xDiT does not state the resolution, frames or steps of its
        runs; priced at Step-Video's defaults (544 x 992, 204 frames -> 26 x 34 x 62 latent
        tokens, 50 steps, CFG batch 2, text encoders and VAE on other servers), so the
        seconds are not comparable, the speed-ups and memory are.
    This machine, ``2xcpu``: the PixArt-shaped pipeline of the issue (1024 tokens, CFG batch
        2, 20 steps): what the planner chooses, and its runner-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from functools import cache

import torch

from tppc.cost_models.call_costs import price_call
from tppc.cost_models.cluster import Cluster, device_preset
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.table import CostTable
from tppc.driver.mesh_planning import mesh_limits
from tppc.frontend.front_end import FrontEnd, capture_front_end
from tppc.frontend.static_export import export_static
from tppc.planner.configurations import Configuration
from tppc.planner.devices import sub_table
from tppc.planner.grid import plan_any_length
from tppc.planner.hybrid import plan_hybrid
from tppc.planner.mesh_configurations import FixedDegrees, mesh_configurations
from tppc.planner.plan import Plan
from tppc.planner.workload import Workload
from tppc.program.mesh import Mesh

UNLIMITED = 10**15


class Predictor:
    """Plans of one model on one cluster at one length, any mesh, one efficiency model."""

    def __init__(self, front: FrontEnd, cluster: str, tokens: int, per_row: int,
                 fuse: bool, unlimited: bool = False, xdit: bool = True) -> None:
        self.front, self.cluster, self.tokens = front, Cluster.parse(cluster), tokens
        self.xdit = xdit  # Ring attention as xDiT runs it; False: as tppc's workers do
        self.per_row, self.fuse, self.unlimited = per_row, fuse, unlimited
        self.limits = mesh_limits(front, tokens)
        self._tables: dict[Configuration, tuple[CostTable, tuple[str, ...]]] = {}

    def price(self, config: Configuration) -> tuple[CostTable, tuple[str, ...]]:
        if config not in self._tables:
            ctx = self.front.ctx
            kw = dict(seq_symbol=ctx.seq_symbol, token_count=ctx.token_count,
                      fuse_elementwise=self.fuse)
            if all(len(g) == 1 for g in config.groups):
                table = build_cost_table(self.front.chunk, ctx.layers, self.cluster,
                                         self.tokens, **kw)
                table, words = sub_table(table, tuple(g[0] for g in config.groups)), ()
            else:
                table, words = group_cost_table(
                    self.front.chunk, ctx.layers, self.cluster, self.tokens, config.groups,
                    mesh=Mesh(cfg=config.cfg_parallel, ring=config.ring,
                              ulysses=config.ulysses), ring_overlap=self.xdit, **kw)
            if self.unlimited:
                table = dataclasses.replace(table, capacities=(UNLIMITED,) * table.num_devices)
            self._tables[config] = (table, words)
        return self._tables[config]

    def plan(self, workload: Workload, time_limit: float = 10.0, **fixed: int) -> Plan:
        configs, refused = mesh_configurations(self.cluster, self.limits, FixedDegrees(**fixed))

        def plan_table(table: CostTable, k: int | None, seconds: float,
                       _config: Configuration) -> Plan:
            return plan_any_length(lambda _n: table, self.tokens, granularity=self.per_row,
                                   num_stages=k, time_limit=seconds, workload=workload)

        return plan_hybrid(configs, self.price, plan_table, cluster=self.cluster,
                           granularity=self.per_row, num_stages=fixed.get("num_stages"),
                           time_limit=time_limit, infeasible=refused, steps=workload.steps)


def _one_device(**extra: int) -> dict:
    return dict(num_stages=1, cfg_parallel=1, ulysses=1, ring=1, tensor_parallel=1) | extra


def kv_free_memory(plan: Plan, table: CostTable) -> float:
    """Peak bytes per device without tppc's K/V buffers (what a runtime that keeps no
    PipeFusion buffers, xDiT's USP/TP, holds): the plan's memory less ``Σ K/V · L``."""
    worst = 0.0
    for st in plan.stages:
        row = table.layers[0]
        kv = sum(lc.kv_bytes_per_token for lc in row[st.layer_start:st.layer_end])
        worst = max(worst, st.memory_bytes - kv * table.seq_len)
    return worst


# ---------------------------------------------------------------- FLUX.1-dev on 4 x H100

FLUX_ROWS = (("1 GPU", {}, 6.71, 4.30), ("Ulysses-2", {"ulysses": 2}, 4.38, 2.68),
             ("Ring-2", {"ring": 2}, 5.31, 2.60),
             ("Ulysses-2 x Ring-2", {"ulysses": 2, "ring": 2}, 5.19, 1.80),
             ("Ulysses-4", {"ulysses": 4}, 4.24, 1.63), ("Ring-4", {"ring": 4}, 5.11, 1.98))
FLUX_STEPS = 28


@cache
def flux_front(side: int = 32) -> FrontEnd:
    """FLUX.1-dev's transformer on meta (19 double + 38 single blocks, 24 heads x 128,
    guidance embedding), captured at ``side``² image tokens + 512 text tokens."""
    from diffusers import FluxTransformer2DModel

    bf = torch.bfloat16
    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56)).eval().to(bf)
        n, text = side * side, 512
        ids = torch.stack([torch.zeros(n), torch.arange(n) // side, torch.arange(n) % side], -1)
        kwargs = {"encoder_hidden_states": torch.randn(1, text, 4096, dtype=bf),
                  "pooled_projections": torch.randn(1, 768, dtype=bf),
                  "timestep": torch.tensor([0.5], dtype=bf),
                  "guidance": torch.tensor([3.5], dtype=bf), "img_ids": ids,
                  "txt_ids": torch.zeros(text, 3), "return_dict": False}
        args = (torch.randn(1, n, 64, dtype=bf),)
    return capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)


def flux_extras(device: str) -> dict[str, float]:
    """Seconds of what the timed FLUX call runs besides the transformer, eager."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    spec = device_preset(device)
    with torch.device("meta"):
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, num_layers=24, num_heads=64,
                                     d_kv=64, vocab_size=32128,
                                     feed_forward_proj="gated-gelu")).eval().bfloat16()
        clip = CLIPTextModel(CLIPTextConfig(hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12,
                                            max_position_embeddings=77)).eval().bfloat16()
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                            down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
                            block_out_channels=(128, 256, 512, 512)).eval().bfloat16()
    ids = torch.zeros(1, 512, dtype=torch.long)
    return {
        "T5-XXL (512 tokens)": price_call(export_static(t5, (ids,)), spec).seconds,
        "CLIP-L (77 tokens)": price_call(export_static(clip, (ids[:, :77],)), spec).seconds,
        "VAE decoder (1024 px)": price_call(export_static(
            vae, (torch.zeros(1, 16, 128, 128, dtype=torch.bfloat16),), method="decode"),
            spec).seconds}


def flux() -> None:
    t0 = time.perf_counter()
    front = flux_front()
    extras = flux_extras("h100-sxm")
    extra = sum(extras.values())
    print(f"FLUX.1-dev shape captured in {time.perf_counter() - t0:.0f} s; "
          f"{mesh_limits(front, 4096)}; besides the transformer (eager, once): "
          + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in extras.items()))
    warm = Workload(kind="diffusion", steps=FLUX_STEPS, warmup_steps=FLUX_STEPS)
    free = Workload(kind="diffusion", steps=FLUX_STEPS, warmup_steps=1)
    print("| configuration | PyTorch: published | tppc eager | error | torch.compile: "
          "published | tppc compiled | error |\n|---|---|---|---|---|---|---|")
    # FLUX's memory is not in the published rows, and the memory rule over-counts it (the
    # 512 text tokens carried with every chunk of a joint-attention model are counted per
    # image token at the block boundaries: ~19 MB a token): planned without a memory cap.
    eager = Predictor(front, "4xh100-sxm", 4096, 64, fuse=False, unlimited=True)
    compiled = Predictor(front, "4xh100-sxm", 4096, 64, fuse=True, unlimited=True)
    base = {}
    for name, degrees, pub_e, pub_c in FLUX_ROWS:
        cells = []
        for model, pub in ((eager, pub_e), (compiled, pub_c)):
            plan = model.plan(warm, **_one_device(**degrees))
            seconds = plan.latency + extra
            base.setdefault(model.fuse, seconds)
            cells.append(f"{pub:.2f} s | {seconds:.2f} s ({base[model.fuse] / seconds:.2f}x) "
                         f"| {seconds / pub - 1:+.0%}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    own = Predictor(front, "4xh100-sxm", 4096, 64, fuse=True, unlimited=True, xdit=False)
    for model, label in ((eager, "eager"), (compiled, "compiled"),
                         (own, "compiled, Ring as tppc's workers run it")):
        t1 = time.perf_counter()
        for wl in (warm, free):
            plan = model.plan(wl, time_limit=20.0)
            print(f"\nplanner's choice ({label}, {wl.warmup_steps} warm step(s)), "
                  f"{time.perf_counter() - t1:.1f} s: {plan.latency + extra:.2f} s with the "
                  f"extras; degrees {plan.degrees}, {len(plan.chunk_sizes)} patch(es)\n"
                  f"  runner-up: {plan.choice.runner_up}\n  why: {plan.choice.why}")


# ------------------------------------------------------------- Step-Video-T2V on 8 x H20

STEP_ROWS = (("1 GPU", {}, 213.60, 92.17), ("TP8", {"tensor_parallel": 8}, 30.40, 30.03),
             ("SP8 (Ulysses)", {"ulysses": 8}, 30.10, 79.68))
STEP_TOKENS = 26 * 34 * 62
STEP_STEPS = 50


@cache
def step_front() -> FrontEnd:
    """The Step-Video-shaped stand-in (module docstring), captured on meta at 2 x 2 x 4
    latent tokens, batch 2 (CFG)."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(
            patch_size=(1, 1, 1), num_attention_heads=48, attention_head_dim=128,
            in_channels=64, out_channels=64, text_dim=4096, freq_dim=256, ffn_dim=24576,
            num_layers=48, rope_max_seq_len=8192).eval().to(torch.bfloat16)
        kwargs = {"encoder_hidden_states": torch.randn(2, 64, 4096, dtype=torch.bfloat16),
                  "timestep": torch.tensor([10.0, 10.0]), "return_dict": False}
        args = (torch.randn(2, 64, 2, 2, 4, dtype=torch.bfloat16),)
    return capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)


def stepvideo() -> None:
    t0 = time.perf_counter()
    front = step_front()
    params = sum(la.param_count for la in front.ctx.layers)
    print(f"Step-Video-shaped stand-in captured in {time.perf_counter() - t0:.0f} s: "
          f"{params / 1e9:.1f} B parameters; {mesh_limits(front, STEP_TOKENS)}; token count "
          f"{front.ctx.token_count} (example {front.ctx.example_seq})")
    per_row = 34 * 62  # one latent frame: the grid step of the patches
    warm = Workload(kind="diffusion", steps=STEP_STEPS, warmup_steps=STEP_STEPS)
    model = Predictor(front, "8xh20", STEP_TOKENS, per_row, fuse=False, unlimited=True)
    print("| configuration | published latency | speed-up | tppc | speed-up | published "
          "memory / GPU | tppc memory / GPU (with K/V buffers) | without K/V buffers |"
          "\n|---|---|---|---|---|---|---|---|")
    base: dict[str, float] = {}
    for name, degrees, pub_s, pub_gb in STEP_ROWS:
        plan = model.plan(warm, **_one_device(**degrees))
        table, _ = model.price(_config_of(model, plan))
        base.setdefault("pub", pub_s)
        base.setdefault("tppc", plan.latency)
        mem = max(st.memory_bytes for st in plan.stages)
        print(f"| {name} | {pub_s:.1f} s | {base['pub'] / pub_s:.2f}x | {plan.latency:.0f} s | "
              f"{base['tppc'] / plan.latency:.2f}x | {pub_gb:.1f} GB | {mem / 1e9:.1f} GB | "
              f"{kv_free_memory(plan, table) / 1e9:.1f} GB |", flush=True)
    real = Predictor(front, "8xh20", STEP_TOKENS, per_row, fuse=False)
    plan = real.plan(Workload(kind="diffusion", steps=STEP_STEPS, warmup_steps=1),
                     time_limit=30.0)
    print(f"\nplanner's choice on 8 x H20 (96 GB, K/V buffers counted, 1 warm step): "
          f"{plan.latency:.0f} s, degrees {plan.degrees}, {len(plan.chunk_sizes)} patch(es), "
          f"{max(st.memory_bytes for st in plan.stages) / 1e9:.1f} GB/GPU\n"
          f"  runner-up: {plan.choice.runner_up}\n  why: {plan.choice.why}\n  infeasible: "
          + "; ".join(plan.choice.infeasible[:4]))


def _config_of(model: Predictor, plan: Plan) -> Configuration:
    """The configuration a plan of ``model`` was made on (its table is cached)."""
    st = plan.stages[0]
    for config in model._tables:
        if config.groups[0] == st.device_indices and config.cfg_parallel == st.cfg_parallel \
                and config.ulysses == st.ulysses and config.ring == st.ring:
            return config
    raise KeyError(st)


# ------------------------------------------------------------------ this machine, 2xcpu

def cpu() -> None:
    from diffusers import PixArtTransformer2DModel

    with torch.device("meta"):
        model = PixArtTransformer2DModel(
            num_attention_heads=6, attention_head_dim=64, in_channels=4, out_channels=8,
            num_layers=8, sample_size=64, patch_size=2, cross_attention_dim=384,
            caption_channels=64, norm_type="ada_norm_single",
            use_additional_conditions=False).eval()
        kwargs = {"encoder_hidden_states": torch.randn(2, 16, 64),
                  "timestep": torch.tensor([10, 10]),
                  "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
                  "return_dict": False}
        args = (torch.randn(2, 4, 64, 64),)
    front = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    model_ = Predictor(front, "2xcpu", 1024, 32, fuse=False, xdit=False)
    wl = Workload(kind="diffusion", steps=20, warmup_steps=1)
    serial = model_.plan(wl, **_one_device()).latency
    print("| configuration | predicted (20 steps) | vs one thread |\n|---|---|---|")
    for name, degrees in (("1 thread", _one_device()),
                          ("PipeFusion PP2", _one_device(num_stages=2)),
                          ("CFG-parallel 2", _one_device(cfg_parallel=2)),
                          ("Ulysses-2", _one_device(ulysses=2)), ("Ring-2", _one_device(ring=2)),
                          ("TP2", _one_device(tensor_parallel=2))):
        plan = model_.plan(wl, **degrees)
        print(f"| {name} | {plan.latency:.2f} s | {serial / plan.latency:.2f}x |")
    plan = model_.plan(wl)
    print(f"\nplanner's choice on 2xcpu: {plan.latency:.2f} s ({serial / plan.latency:.2f}x), "
          f"degrees {plan.degrees}\n  runner-up: {plan.choice.runner_up}\n  why: "
          f"{plan.choice.why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("flux", "stepvideo", "cpu"))
    args = parser.parse_args()
    if args.only in (None, "cpu"):
        cpu()
    if args.only in (None, "flux"):
        flux()
    if args.only in (None, "stepvideo"):
        stepvideo()


if __name__ == "__main__":
    main()
