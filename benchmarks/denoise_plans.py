"""Cost model: tppc's diffusion plan against uniform patches (xDiT's default), issue 13.

DiT-XL/2 (``tppc.examples.models.DiT``, hidden 1152, depth 28, 16 heads) and a Flux-shaped model
(diffusers ``FluxTransformer2DModel`` at Flux.1's width, 3072 = 24 × 128, 512 text tokens;
captured with 2 double- and 2 single-stream blocks on meta, the layer list re-expanded to
19 + 38 blocks as ``tppc.plan`` does for one block list) at 1024² and 2048² (latents /8,
patch 2; DiT in fp16, Flux in bf16), 20 steps with 1 warm-up step, on 4 and 8 A100s over PCIe and NVLink. Baseline:
blocks split evenly, M = number of stages equal patches (xDiT's PipeFusion default), priced
by the same simulation (``plan_for``). Ratios are to the plan's lower bound; ``speed-up`` is
the one-device serial time over the plan's latency.

    python benchmarks/denoise_plans.py [--models dit,flux]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from tppc.cost_models.layer_costs import build_cost_table
from tppc.errors import PlanError
from tppc.examples.models import DiT, DiTConfig
from tppc.frontend.annotate import annotate, program_of
from tppc.frontend.front_end import capture_front_end
from tppc.planner import plan_for
from tppc.planner.devices import sub_table
from tppc.planner.grid import plan_any_length
from tppc.planner.workload import Workload

WORKLOAD = Workload(kind="diffusion", steps=20, warmup_steps=1)
CLUSTERS = ("4xa100-80gb@pcie4", "4xa100-80gb", "8xa100-80gb@pcie4", "8xa100-80gb")


def dit(pixels: int):
    """DiT-XL/2 on meta, latents ``pixels / 8``."""
    with torch.device("meta"):
        model = DiT(DiTConfig(hidden=1152, depth=28, n_head=16)).eval().half()
        side = pixels // 8
        args = (torch.randn(1, 4, side, side, dtype=torch.half), torch.tensor([10]),
                torch.tensor([3]))
    front = capture_front_end(model, args, {}, seq_dims=None, plan_only=True)  # as tppc.plan
    return front.chunk, front.ctx


def flux(pixels: int):
    """A Flux.1-shaped transformer on meta (2 + 2 blocks captured, 19 + 38 priced)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=2, num_single_layers=2,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, axes_dims_rope=(16, 56, 56)).eval().to(torch.bfloat16)
        side = pixels // 16
        n, text = side * side, 512
        ids = torch.stack([torch.zeros(n), torch.arange(n) // side, torch.arange(n) % side], -1)
        bf = torch.bfloat16
        kwargs = {"encoder_hidden_states": torch.randn(1, text, 4096, dtype=bf),
                  "pooled_projections": torch.randn(1, 768, dtype=bf),
                  "timestep": torch.tensor([0.5], dtype=bf),
                  "img_ids": ids, "txt_ids": torch.zeros(text, 3), "return_dict": False}
        args = (torch.randn(1, n, 64, dtype=bf),)
    gm, ctx = annotate(model, args, kwargs)
    ctx.layers = _repeat(_repeat(ctx.layers, "single_transformer_blocks", 38),
                         "transformer_blocks", 19)
    return program_of(gm, ctx), ctx


def _repeat(layers, path, count):
    """Repeat the last block under ``path`` up to ``count`` blocks (renumbering all)."""
    mine = [la for la in layers if la.kind == "block" and la.name.startswith(f"{path}.")]
    at = layers.index(mine[-1]) + 1
    extra = [dataclasses.replace(mine[-1], name=f"{path}.{i}") for i in range(len(mine), count)]
    merged = layers[:at] + extra + layers[at:]
    return [dataclasses.replace(la, index=i) for i, la in enumerate(merged)]


def even_cuts(num_layers: int, names: list[str], stages: int) -> tuple[int, ...]:
    """Blocks split evenly; prologue on the first stage, epilogue on the last."""
    pro, epi = int(names[0] == "prologue"), int(names[-1] == "epilogue")
    blocks = num_layers - pro - epi
    return (0, *(pro + round(i * blocks / stages) for i in range(1, stages)), num_layers)


def compare(name: str, gm, ctx, pixels: int, row: int) -> None:
    """Print one table row per cluster; ``row``: tokens per patch row (the grid step)."""
    length = int(ctx.token_count.subs(ctx.seq_symbol, ctx.example_seq))  # tokens
    for cluster in CLUSTERS:
        stages = int(cluster.split("x")[0])

        def table_at(tokens: int, cluster: str = cluster):
            return build_cost_table(gm, ctx.layers, cluster, tokens, seq_symbol=ctx.seq_symbol,
                                    token_count=ctx.token_count)

        t0 = time.perf_counter()
        try:
            plan = plan_any_length(table_at, length, num_stages=stages, workload=WORKLOAD,
                                   granularity=row, time_limit=20.0)
        except PlanError as exc:
            print(f"| {name} | {pixels}² | {cluster} | refused: {str(exc).splitlines()[-1]} |")
            continue
        seconds = time.perf_counter() - t0
        table = sub_table(table_at(length), tuple(range(stages)))
        names = [lc.name for lc in table.layers[0]]
        rows = length // row
        bounds = tuple(row * round(i * rows / stages) for i in range(stages + 1))
        uniform = plan_for(table, even_cuts(table.num_layers, names, stages), bounds, WORKLOAD)
        serial = plan_for(sub_table(table, (0,)), (0, table.num_layers), (0, length),
                          Workload(kind="diffusion", steps=20, warmup_steps=20)).latency
        chunks = [c // row for c in plan.chunk_sizes]
        print(f"| {name} | {pixels}² | {cluster} | {serial:.2f} | {uniform.latency:.3f} "
              f"({uniform.ratio_to_bound:.3f}, {serial / uniform.latency:.2f}×) | "
              f"{plan.latency:.3f} ({plan.ratio_to_bound:.3f}, {serial / plan.latency:.2f}×) | "
              f"{len(chunks)}: {' '.join(map(str, chunks))} | {seconds:.1f} s |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="dit,flux")
    parser.add_argument("--pixels", default="1024,2048")
    ns = parser.parse_args()
    print("| model | image | cluster | serial (s) | uniform M=S: latency (s) (ratio, speed-up) "
          "| tppc: latency (s) (ratio, speed-up) | tppc patches (patch rows) | plan time |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ns.models.split(","):
        for pixels in map(int, ns.pixels.split(",")):
            gm, ctx = {"dit": dit, "flux": flux}[name](pixels)
            compare(name, gm, ctx, pixels, pixels // 16)


if __name__ == "__main__":
    main()
