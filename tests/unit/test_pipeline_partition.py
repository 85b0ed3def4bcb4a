"""partition_stages: each stage owns its layers' parameters and K/V buffers, nothing more."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.dispatch.compile import compile_pipeline
from tppc.ir.records import CHUNK_INPUT, STAGE_INFO, TOKEN
from tppc.planner.manual import manual_plan

SEQ = 16


@pytest.fixture(scope="module")
def gpt():
    model, args, _ = examples.gpt(seq_len=SEQ, n_layer=4)
    plan = manual_plan(6, SEQ, cuts=(0, 6), boundaries=(0, SEQ))
    return model, args[0], compile_pipeline(model, args, plan=plan, executor="local")


@pytest.mark.parametrize("cuts", [(0, 1, 6), (0, 3, 6), (0, 2, 4, 6), (0, 1, 2, 5, 6)])
def test_each_stage_holds_only_its_layers_parameters(gpt, cuts):
    model, _, base = gpt
    cp = base.with_plan(manual_plan(6, SEQ, cuts=cuts, boundaries=(0, SEQ)))
    layers = base.context.layers
    for stage, (lo, hi) in zip(cp.stages, itertools.pairwise(cuts)):
        assert stage.param_count == sum(layer.param_count for layer in layers[lo:hi])
    assert sum(s.param_count for s in cp.stages) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("cuts", [(0, 2, 6), (0, 3, 4, 6)])
def test_each_stage_holds_the_kv_buffers_of_its_blocks(gpt, cuts):
    _, _, base = gpt
    cp = base.with_plan(manual_plan(6, SEQ, cuts=cuts, boundaries=(0, SEQ)))
    per_block = 2 * (1 * 4 * SEQ * 16) * 4  # K and V, (batch, heads, seq, head_dim), fp32
    for stage, (lo, hi) in zip(cp.stages, itertools.pairwise(cuts)):
        blocks = sum(layer.kind == "block" for layer in base.context.layers[lo:hi])
        assert stage.kv_bytes == blocks * per_block


def test_only_the_hidden_state_crosses_a_stage_boundary(gpt):
    _, _, base = gpt
    cp = base.with_plan(manual_plan(6, SEQ, cuts=(0, 2, 4, 6), boundaries=(0, SEQ)))
    for stage in cp.stages[1:]:
        received = [p for p in stage.module.graph.find_nodes(op="placeholder")
                    if p.meta[CHUNK_INPUT].kind == "boundary"]
        assert len(received) == 1
        assert received[0].meta[TOKEN].role == "token"
        assert stage.module.meta[STAGE_INFO].inputs == (received[0].name,)


def test_positional_values_are_recomputed_in_the_stage_that_reads_them(gpt):
    _, _, base = gpt
    cp = base.with_plan(manual_plan(6, SEQ, cuts=(0, 1, 6), boundaries=(0, SEQ)))
    first, second = (s.module.tppc_positional for s in cp.stages)
    assert len(next(iter(first.graph.find_nodes(op="output"))).args[0]) == 1  # position embedding
    assert len(next(iter(second.graph.find_nodes(op="output"))).args[0]) == 0


def test_the_partitioned_program_equals_the_model_on_one_chunk(gpt):
    model, ids, base = gpt
    cp = base.with_plan(manual_plan(6, SEQ, cuts=(0, 3, 6), boundaries=(0, SEQ)))
    with torch.no_grad():
        assert_kernels_close(cp(ids), model(ids))
    assert [r.name for r in cp.history][-2:] == ["chunk_attention", "partition_stages"]
