"""Stage boundaries inside a block: the waist, the exact pipeline, the planner's choice."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.cost_models import build_cost_table
from tppc.cost_models.table import CostTable, LayerCost, LinkCost
from tppc.dispatch.compile import compile_pipeline
from tppc.errors import PlanError
from tppc.frontend.annotate import annotate
from tppc.planner.joint import plan_from_costs
from tppc.planner.manual import manual_plan


@pytest.mark.parametrize("example", ["gpt", "hf_llama", "hf_gpt2"])
def test_every_block_has_an_attention_part_and_an_mlp_part_joined_by_one_value(example):
    model, args, _ = getattr(examples, example)(32, 2) if example != "gpt" else \
        examples.gpt(seq_len=32, n_layer=2)
    _, ctx = annotate(model, args)
    blocks = [layer for layer in ctx.layers if layer.kind == "block"]
    assert blocks and all(len(b.parts) == 2 for b in blocks)
    for block in blocks:
        attn, mlp = block.parts
        assert (attn.name, mlp.name) == (f"{block.name}.attn", f"{block.name}.mlp")
        assert attn.attention_nodes == block.attention_nodes and not mlp.attention_nodes
        assert len(attn.outputs) == 1 and mlp.inputs == attn.outputs  # the residual stream
        assert attn.param_count + mlp.param_count == block.param_count
        assert attn.nodes + mlp.nodes == block.nodes
    for layer in ctx.layers:
        if layer.kind != "block":
            assert layer.parts == ()


def _names(ctx, split: str) -> list[str]:
    out: list[str] = []
    for layer in ctx.layers:
        out.extend(p.name for p in layer.parts) if layer.name == split else out.append(layer.name)
    return out


@pytest.mark.parametrize("example", ["gpt", "hf_llama"])
@pytest.mark.parametrize("executor", ["threads", "local"])
def test_a_plan_cut_between_attention_and_mlp_equals_eager(example, executor):
    seq = 24
    model, args, _ = examples.gpt(seq_len=seq, n_layer=3) if example == "gpt" else \
        examples.hf_llama(seq_len=seq, layers=3)
    _, ctx = annotate(model, args)
    block = [layer for layer in ctx.layers if layer.kind == "block"][1]
    names = _names(ctx, block.name)  # prologue, b0, b1.attn, b1.mlp, b2, epilogue
    at = names.index(f"{block.name}.mlp")
    plan = manual_plan(names, seq, cuts=(0, at, len(names)), boundaries=(0, 5, 13, seq))
    cp = compile_pipeline(model, args, plan=plan, executor=executor)
    with torch.no_grad():
        expected = model(*args)
        got = cp(*args)
    if example == "hf_llama":
        expected, got = expected.logits, got.logits
    assert_kernels_close(got, expected)
    first, second = cp.program(seq).stages
    assert first.layers[-1] == f"{block.name}.attn" and second.layers[0] == f"{block.name}.mlp"
    assert len(first.boundary_out) == 1  # the residual stream, nothing else
    owners = {b.layer for b in first.buffers} | {b.layer for b in second.buffers}
    assert block.name in {b.layer for b in first.buffers} and len(owners) == 3  # K/V: attn part


def test_a_plan_whose_layers_are_not_the_models_parts_is_refused():
    model, args, _ = examples.hf_llama(seq_len=16, layers=2)
    _, ctx = annotate(model, args)
    names = _names(ctx, "model.layers.0")
    names[names.index("model.layers.0.mlp")] = "model.layers.0.ffn"
    plan = manual_plan(names, 16, cuts=(0, 2, len(names)), boundaries=(0, 16))
    with pytest.raises(PlanError, match="waist"):
        compile_pipeline(model, args, plan=plan)


def test_the_parts_of_a_block_cost_what_the_block_costs():
    model, args, _ = examples.hf_llama(seq_len=64, layers=2)
    from tppc.frontend.annotate import annotate_program

    program, ctx = annotate_program(model, args)
    table = build_cost_table(program, ctx.layers, "1xh100-sxm", 64)
    c, p = np.array([16.0, 32.0]), np.array([0.0, 32.0])
    for lc in table.layers[0]:
        if lc.parts:
            attn, mlp = lc.parts
            np.testing.assert_allclose(attn.time(c, p) + mlp.time(c, p), lc.time(c, p))
            assert attn.kv_bytes_per_token == lc.kv_bytes_per_token and mlp.kv_bytes_per_token == 0
            assert attn.weight_bytes + mlp.weight_bytes == lc.weight_bytes
    names = [n for lc in table.layers[0] for n in
             ([p.name for p in lc.parts] if lc.name == "model.layers.1" else [lc.name])]
    assert table.with_layers(names).layer_names == tuple(names)
    with pytest.raises(ValueError):
        table.with_layers(["prologue", "epilogue"])


def _head_heavy_table(parts: bool) -> CostTable:
    """Three blocks of 1 ms per 64 tokens (attention and MLP half each) and a head of 2 ms:
    whole blocks split 2 + 3 ms at best, half a block balances 2.5 + 2.5 ms."""

    def rate(ms: float):
        return lambda c, p: ms * 1e-3 * np.asarray(c, dtype=float) / 64

    def layer(name: str, ms: float, split: bool = False) -> LayerCost:
        halves = (layer(f"{name}.attn", ms / 2), layer(f"{name}.mlp", ms / 2)) if split else ()
        return LayerCost(name=name, time=rate(ms), weight_bytes=1000, kv_bytes_per_token=0,
                         act_bytes_per_token=4, parts=halves)

    row = (layer("prologue", 0.0), *(layer(f"b{i}", 1.0, parts) for i in range(3)),
           layer("head", 2.0))
    return CostTable(device_names=("cpu", "cpu"), capacities=(10**12,) * 2, layers=(row, row),
                     links=(LinkCost(latency=0.0, bandwidth=1e15),), seq_len=512, causal=True)


def test_the_planner_cuts_inside_a_block_when_that_balances_the_stages():
    whole = plan_from_costs(_head_heavy_table(False), num_stages=2, granularity=64)
    half = plan_from_costs(_head_heavy_table(True), num_stages=2, granularity=64)
    names = [n for st in half.stages for n in st.layer_names]
    assert "b2.attn" in half.stages[0].layer_names and half.stages[1].layer_names[0] == "b2.mlp"
    assert names == ["prologue", "b0", "b1", "b2.attn", "b2.mlp", "head"]
    assert half.latency < whole.latency * 0.9  # 2.5 + fill against 3 + fill
    assert "waist of b2" in half.solver.detail


def test_the_planner_keeps_whole_blocks_when_a_cut_inside_does_not_help():
    t = _head_heavy_table(True)
    row = (*t.layers[0][:-1], LayerCost(name="head", time=t.layers[0][1].time, weight_bytes=1,
                                        kv_bytes_per_token=0, act_bytes_per_token=4))
    even = CostTable(device_names=t.device_names, capacities=t.capacities, layers=(row, row),
                     links=t.links, seq_len=t.seq_len, causal=True)  # 4 equal layers: 2 + 2
    plan = plan_from_costs(even, num_stages=2, granularity=64)
    assert [n for st in plan.stages for n in st.layer_names] == list(even.layer_names)
