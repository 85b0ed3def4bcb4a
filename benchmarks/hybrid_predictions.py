"""Hybrid plans (tensor parallel x pipeline) predicted next to published runs.

Run: PYTHONPATH=. .venv/bin/python benchmarks/hybrid_predictions.py [--only llama|deepseek]

Models are built on the meta device (bf16, no weights), captured the way ``tppc.plan`` does
it (two blocks exported, the layer list re-expanded), annotated by the sharding pass
(``annotate_shards``) and priced by the cost model: layers of a tensor-parallel group at
their shard's GEMM shapes plus the group's collectives (``group_cost_table``). Every row is
the planner's own plan for the degrees it names (placement, chunks), or its free choice.

Rows:
    SGLang (lmsys blog, 2026-01-15): DeepSeek-V3.1, one 128k-token prompt (batch 1 prefill),
        4 nodes of 8 H20s over NDR InfiniBand (``4x(8xh20)@ib-ndr``): TP8 on one node, TP32
        over the 4 nodes, PP4 x TP8; published prefill throughput 3.31x (PP4xTP8 / TP8) and
        2.54x (TP32 / TP8); TTFT TP8 48.5 s, PP4 x TP8 15.7 s. The shape priced is the
        nearest one tppc captures and cuts (:func:`deepseek_v31`: multi-head attention of
        MLA's FLOPs, dense MLPs of the active experts' width) with DeepSeek-V3.1's own
        memory (FP8 weights, experts cut t ways, MLA's latent cache); matmuls priced at bf16.
    Qwen2-shaped prefill on this machine (``2xcpu``, 2048 tokens; ``benchmarks/qwen2_prefill.py``'s
        model): PP2 x TP1 against PP1 x TP2, as the CPU's calibration prices them.
    Llama-70B-shaped prefill (hidden 8192, FFN 28672, 80 blocks, 64 heads, 8 K/V heads,
        vocab 32000), 32k tokens on ``8xh100-sxm`` (NVLink 4): TP8, PP8 and the planner's
        choice (no published row given; the three are compared with each other).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.layer_costs import build_cost_table
from tppc.cost_models.table import CostTable
from tppc.frontend.front_end import FrontEnd, capture_front_end
from tppc.ir.records import SHARD_SIZES
from tppc.passes.sharding.annotate_shards import SHARD_NOTES, annotate_shards
from tppc.planner.configurations import (
    Configuration,
    fixed_configuration,
    tp_configurations,
)
from tppc.planner.grid import default_granularity, plan_any_length
from tppc.planner.hybrid import plan_hybrid
from tppc.planner.plan import Plan

TIME_LIMIT = 20.0
sys.path.insert(0, str(Path(__file__).parent))  # qwen2_prefill's model


def llama70b() -> tuple[torch.nn.Module, tuple]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, (torch.randint(0, 1000, (1, 256), device="meta"),)


MLA_WHOLE = 7168 * 1536 + 7168 * (512 + 64)
"""MLA's down-projections (q_a, kv_a): left whole under tensor parallelism (a norm follows)."""
MLA_CUT = 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * 7168
"""MLA's per-head projections (q_b, kv_b, o): cut by heads."""
DENSE_MLP = 3 * 7168 * 18432
MOE_MLP = 3 * 7168 * 2048 + 256 * 3 * 7168 * 2048  # shared expert + 256 routed experts (EP)
LATENT_KV = (512 + 64) * 2
"""MLA's cached latent per token and block (kv_lora_rank + rope dims, bf16), whole on every
tensor-parallel worker (SGLang caches the latent, not the per-head K/V)."""


def deepseek_v31() -> tuple[torch.nn.Module, tuple]:
    """The nearest shape of DeepSeek-V3.1 whose attention and MLP the sharding pass cuts: a
    Llama-shaped stack with DeepSeek-V3.1's hidden 7168, 61 blocks, 128 heads (head dim 160:
    MLA's q·k over 192 dims and p·v over 128 cost what 160 and 160 cost), vocab 129280, and
    dense MLPs of intermediate 18432 = the active experts' width (8 routed + 1 shared, 9 x
    2048; the 3 dense blocks have this width too). Not captured: MLA's low-rank projections
    (the pass leaves DeepSeekV3's attention whole: an ``aten.copy`` on its query path has no
    sharding rule) and the routed experts (transformers' expert kernels sort or repeat tokens;
    the annotation refuses them at this size). Memory is DeepSeek-V3.1's own
    (:func:`_deepseek_memory`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                      num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                      head_dim=160, max_position_embeddings=163840)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model, (torch.randint(0, 1000, (1, 256), device="meta"),)


def _deepseek_memory(table: CostTable, groups: tuple[tuple[int, ...], ...]) -> CostTable:
    """Each block's weights as DeepSeek-V3.1 holds them per worker at degree t (FP8: one byte;
    MLA's down-projections whole, its heads, the MLP and the experts ``1/t``: expert
    parallelism) and MLA's latent K/V cache (whole on every worker); the logits of the last
    position only (what a server keeps; the captured model returns every position's)."""

    def fix(lc, t: int):
        if lc is table.layers[0][-1] or lc.name == table.layers[0][-1].name:
            return dataclasses.replace(lc, act_bytes_per_token=0)
        if not lc.name.startswith("model.layers."):
            return lc
        mlp = DENSE_MLP if int(lc.name.split(".")[2]) < 3 else MOE_MLP
        return dataclasses.replace(lc, weight_bytes=MLA_WHOLE + (MLA_CUT + mlp) // t,
                                   kv_bytes_per_token=LATENT_KV)

    return dataclasses.replace(table, layers=tuple(
        tuple(fix(lc, len(g)) for lc in row) for row, g in zip(table.layers, groups,
                                                               strict=True)))


def front_of(build) -> tuple[FrontEnd, float]:
    t0 = time.perf_counter()
    model, args = build()
    front = capture_front_end(model, args, {}, seq_dims=None, plan_only=True)
    annotate_shards(front.chunk)
    return front, time.perf_counter() - t0


def _fp8(table: CostTable) -> CostTable:
    """Weights held at one byte (FP8) instead of two."""
    return dataclasses.replace(table, layers=tuple(
        tuple(dataclasses.replace(lc, weight_bytes=lc.weight_bytes // 2, parts=())
              for lc in row) for row in table.layers))


class Predictor:
    """Plans of one model on one cluster at one length, any configuration."""

    def __init__(self, front: FrontEnd, cluster: str, tokens: int, fp8: bool,
                 memory=None) -> None:
        self.front, self.cluster, self.tokens = front, Cluster.parse(cluster), tokens
        self.fp8 = fp8  # weights held at one byte; matmuls priced at their own dtype (bf16)
        self.memory = memory
        self.sizes = tuple(front.chunk.meta.get(SHARD_SIZES, ()))
        self.granularity = default_granularity(tokens)
        self._tables: dict[tuple, tuple[CostTable, tuple[str, ...]]] = {}
        self.costing = 0.0

    def price(self, config: Configuration) -> tuple[CostTable, tuple[str, ...]]:
        if config.groups not in self._tables:
            t0 = time.perf_counter()
            ctx = self.front.ctx
            kw = dict(seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)
            if all(len(g) == 1 for g in config.groups):
                table = build_cost_table(self.front.chunk, ctx.layers, self.cluster,
                                         self.tokens, **kw)
                table, words = table, ()
            else:
                table, words = group_cost_table(self.front.chunk, ctx.layers, self.cluster,
                                                self.tokens, config.groups, **kw)
            table = _fp8(table) if self.fp8 else table
            if self.memory is not None:
                table = self.memory(table, config.groups)
            self._tables[config.groups] = (table, words)
            self.costing += time.perf_counter() - t0
        return self._tables[config.groups]

    def plan(self, tensor_parallel: int | None, num_stages: int | None,
             time_limit: float = TIME_LIMIT) -> tuple[Plan, float]:
        """The plan of fixed degrees (or, with ``tensor_parallel=None``, the free choice)."""
        t0 = time.perf_counter()
        if tensor_parallel is None:
            configs = tp_configurations(self.cluster, self.sizes)
            across = tp_configurations(self.cluster, self.sizes, across_nodes=True)
        else:
            configs = [fixed_configuration(self.cluster, self.sizes, tensor_parallel,
                                           num_stages)]
            across = []

        def plan_table(table: CostTable, k: int | None, seconds: float, _config: object) -> Plan:
            return plan_any_length(lambda _n: table, self.tokens, granularity=self.granularity,
                                   num_stages=k, time_limit=seconds)

        plan = plan_hybrid(configs, self.price, plan_table, cluster=self.cluster,
                           granularity=self.granularity, num_stages=num_stages,
                           time_limit=time_limit, across=across)
        return plan, time.perf_counter() - t0


def _row(name: str, plan: Plan, seconds: float, base: Plan | None) -> str:
    ratio = f"{base.latency / plan.latency:.2f}x" if base is not None else "1.00x"
    chunks = len(plan.chunk_sizes)
    return (f"| {name} | {plan.degrees['num_stages']} x TP{plan.degrees['tensor_parallel']} "
            f"| {plan.latency:.2f} s | {ratio} | {plan.lower_bound:.2f} s | {chunks} | "
            f"{max(st.memory_bytes for st in plan.stages) / 1e9:.1f} GB | {seconds:.1f} s |")


HEADER = ("| configuration | stages x TP | predicted TTFT | throughput vs first row | lower bound "
          "| chunks | peak memory/device | planning |\n|---|---|---|---|---|---|---|---|")


def deepseek(fp8: bool) -> None:
    front, capture_s = front_of(deepseek_v31)
    notes = front.chunk.meta.get(SHARD_NOTES, ())
    print(f"DeepSeek-V3.1 shape captured + sharded in {capture_s:.1f} s; shard sizes "
          f"{front.chunk.meta.get(SHARD_SIZES)}; linears left whole: {len(notes)} "
          f"{notes[:3]}")
    p = Predictor(front, "4x(8xh20)@ib-ndr", 131072, fp8, _deepseek_memory)
    tp8, s8 = p.plan(8, 1)
    tp32, s32 = p.plan(32, 1)
    pp4, s4 = p.plan(8, 4)
    free, sf = p.plan(None, None, time_limit=60.0)
    print(HEADER)
    for name, plan, sec in (("TP8 (one node)", tp8, s8), ("TP32", tp32, s32),
                            ("PP4 x TP8", pp4, s4), ("planner's choice", free, sf)):
        print(_row(name, plan, sec, tp8))
    print("\npublished: PP4xTP8/TP8 3.31x, TP32/TP8 2.54x (TTFT 48.5 s -> 15.7 s at 4 stages)")
    print(f"predicted: PP4xTP8/TP8 {tp8.latency / pp4.latency:.2f}x, TP32/TP8 "
          f"{tp8.latency / tp32.latency:.2f}x; costing {p.costing:.1f} s")
    print(free.summary())


def llama(fp8: bool) -> None:
    front, capture_s = front_of(llama70b)
    print(f"Llama-70B shape captured + sharded in {capture_s:.1f} s; shard sizes "
          f"{front.chunk.meta.get(SHARD_SIZES)}")
    p = Predictor(front, "8xh100-sxm", 32768, fp8)
    tp8, s8 = p.plan(8, 1)
    pp8, sp = p.plan(1, 8)
    free, sf = p.plan(None, None)
    print(HEADER)
    for name, plan, sec in (("TP8", tp8, s8), ("PP8", pp8, sp), ("planner's choice", free, sf)):
        print(_row(name, plan, sec, tp8))
    print(f"costing {p.costing:.1f} s")
    print(free.summary())


def qwen2_cpu() -> None:
    """The 2-core machine's prediction (issue 28's table): PP2 x TP1 against PP1 x TP2."""
    from qwen2_prefill import qwen2

    def build() -> tuple[torch.nn.Module, tuple]:
        return qwen2(8), (torch.randint(0, 32000, (1, 256)),)

    front, capture_s = front_of(build)
    p = Predictor(front, "2xcpu", 2048, False)
    pp2, s2 = p.plan(1, 2)
    tp2, st = p.plan(2, 1)
    free, sf = p.plan(None, None)
    print(f"Qwen2 shape (8 layers, hidden 512) on 2xcpu, 2048 tokens; capture {capture_s:.1f} s")
    print(HEADER)
    for name, plan, sec in (("PP2 x TP1", pp2, s2), ("PP1 x TP2", tp2, st),
                            ("planner's choice", free, sf)):
        print(_row(name, plan, sec, pp2))
    print(free.summary())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("llama", "deepseek", "qwen2"))
    parser.add_argument("--bf16", action="store_true", help="DeepSeek weights as built (bf16)")
    args = parser.parse_args()
    if args.only in (None, "llama"):
        llama(False)
    if args.only in (None, "deepseek"):
        deepseek(not args.bf16)
    if args.only in (None, "qwen2"):
        qwen2_cpu()


if __name__ == "__main__":
    main()
