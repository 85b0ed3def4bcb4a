"""Prices of tensor-parallel groups on a captured Llama (GQA) whose nodes carry SHARD roles
set by hand here (the sharding pass's record): shard work, collectives, memory per device,
and the planner's choice on ``2xcpu`` by price."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import collective_cost
from tppc.cost_models.group_costs import group_cost_table
from tppc.cost_models.layer_costs import build_cost_table
from tppc.driver.options import CompileOptions
from tppc.driver.planning import length_planner, price_plan
from tppc.errors import PlanError
from tppc.examples.hf import hf_llama
from tppc.frontend.front_end import capture_front_end
from tppc.ir.records import SHARD, SHARD_SIZES, ShardRole
from tppc.passes.sharding.annotate_shards import annotate_shards

HIDDEN, BYTES = 64, 4  # hf_llama: hidden 64, fp32; 4 heads, 2 K/V heads of 16
BLOCK_WEIGHTS = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64) * BYTES
NORMS = 2 * 64 * BYTES


@pytest.fixture(scope="module")
def front():
    model, args, kwargs = hf_llama(seq_len=32, layers=2)
    fe = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    for node in fe.chunk.graph.nodes:
        if node.op != "call_function" or "linear" not in str(node.target):
            continue
        weight = node.args[1].name
        if any(k in weight for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            node.meta[SHARD] = ShardRole("column", axis=2, segments=(node.meta["val"].shape[-1],))
        elif any(k in weight for k in ("o_proj", "down_proj")):
            node.meta[SHARD] = ShardRole("row", collective="all_reduce")
    fe.annotated.meta[SHARD_SIZES] = (4, 2)
    return fe


def _table(front, cluster, groups, seq=4096):
    ctx = front.ctx
    return group_cost_table(front.chunk, ctx.layers, cluster, seq, groups,
                            seq_symbol=ctx.seq_symbol, token_count=ctx.token_count)


def test_memory_per_device_holds_a_shard_of_the_cut_weights_and_kv(front) -> None:
    one, _ = _table(front, "2xh100-sxm", ((0,),))
    two, _ = _table(front, "2xh100-sxm", ((0, 1),))
    block1, block2 = one.layers[0][1], two.layers[0][1]
    assert block1.weight_bytes == BLOCK_WEIGHTS + NORMS
    assert block2.weight_bytes == BLOCK_WEIGHTS // 2 + NORMS  # norms stay whole
    assert (block1.kv_bytes_per_token, block2.kv_bytes_per_token) == (2 * 32 * BYTES, 32 * BYTES)
    assert two.layers[0][0].weight_bytes == one.layers[0][0].weight_bytes  # embedding whole


def test_collectives_are_priced_by_collective_cost_on_the_group(front) -> None:
    cluster = Cluster.parse("2x(2xh100-sxm)@ib-ndr")
    for group in ((0, 1), (1, 2)):  # inside a node; across the InfiniBand link
        table, words = _table(front, cluster, (group,))
        assert words[1] == f"2 all_reduce of {HIDDEN * BYTES} B/token"
        layer = table.layers[0][1]
        c = np.array([256.0, 1024.0])
        moves = layer.time.collectives(c)
        hand = [2 * collective_cost(cluster, "all_reduce", HIDDEN * BYTES * x, group).seconds
                for x in c]
        assert moves == pytest.approx(hand)
        compute = layer.time.compute[0](c, np.zeros(2))
        assert layer.time(c, np.zeros(2)) == pytest.approx(compute + hand)
    near, _ = _table(front, cluster, ((0, 1),))
    far, _ = _table(front, cluster, ((1, 2),))
    assert far.times_at(1024, 0)[0][1] > near.times_at(1024, 0)[0][1]


def test_a_shard_is_priced_at_its_own_gemm_shape_not_divided(front) -> None:
    ctx = front.ctx
    whole = build_cost_table(front.chunk, ctx.layers, "1xh100-sxm", 4096,
                             seq_symbol=ctx.seq_symbol).times_at(64, 0)[0][1]
    table, _ = _table(front, "2xh100-sxm", ((0, 1),))
    half = table.layers[0][1].time.compute[0](np.array([64.0]), np.array([0.0]))[0]
    # tiny GEMMs: n = 32 pads to the same tiles as n = 64, launches stay: far from 1/2
    assert whole / 2 < half <= whole * (1 + 1e-9)
    one, _ = _table(front, "2xh100-sxm", ((0,),))
    assert one.times_at(64, 0)[0][1] == pytest.approx(whole)  # degree 1: the plain price


def test_a_degree_that_does_not_divide_is_refused(front) -> None:
    with pytest.raises(PlanError, match=r"tensor_parallel=4 does not divide .*\[2\].*"
                                        r"fix: one of \[1, 2\]"):
        length_planner(CompileOptions(cluster="4xh100-sxm", tensor_parallel=4))(front, 1024)


def test_2xcpu_chooses_between_pp2_and_tp2_by_price(front) -> None:
    auto = length_planner(CompileOptions(cluster="2xcpu"))(front, 2048)
    pp = length_planner(CompileOptions(cluster="2xcpu", tensor_parallel=1, num_stages=2))(
        front, 2048)
    tp = length_planner(CompileOptions(cluster="2xcpu", tensor_parallel=2))(front, 2048)
    assert auto.choice.searched + auto.choice.pruned >= 2
    assert auto.latency == pytest.approx(min(pp.latency, tp.latency, auto.latency))
    assert auto.latency <= min(pp.latency, tp.latency) * (1 + 1e-6)
    assert auto.lower_bound <= min(pp.latency, tp.latency)
    again = price_plan(front, CompileOptions(cluster="2xcpu"), tp)
    assert again.latency == pytest.approx(tp.latency) and again.degrees == tp.degrees


def test_tensor_parallel_1_plans_exactly_as_before(front) -> None:
    sizes = front.annotated.meta.pop(SHARD_SIZES)
    try:
        before = length_planner(CompileOptions(cluster="2xcpu"))(front, 1024)
    finally:
        front.annotated.meta[SHARD_SIZES] = sizes
    fixed = length_planner(CompileOptions(cluster="2xcpu", tensor_parallel=1))(front, 1024)
    assert before.choice is None
    strip = dict(solver=None, split=None)
    assert dataclasses.replace(fixed, **strip) == dataclasses.replace(before, **strip)


def test_the_sharding_pass_roles_price_heads_kv_and_the_vocabulary_cut() -> None:
    model, args, kwargs = hf_llama(seq_len=32, layers=2)
    fe = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    annotate_shards(fe.chunk)
    table, words = _table(fe, "2xh100-sxm", ((0, 1),))
    block, head = table.layers[0][1], table.layers[0][-1]
    assert block.weight_bytes == BLOCK_WEIGHTS // 2 + NORMS
    assert block.kv_bytes_per_token == 32 * BYTES  # 2 K/V heads of 16, one per worker
    assert head.weight_bytes == 128 * 64 * BYTES // 2 + 64 * BYTES  # LM head cut, norm whole
    assert words[1] == f"2 all_reduce of {HIDDEN * BYTES} B/token"
    assert words[-1] == f"1 all_gather of {128 * BYTES} B/token"  # the logits, vocab 128
