"""Cost report: table, bound, formulas, JSON and the `tppc cost` handler."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tppc.cli.cost import add_cost_arguments, cost_command
from tppc.cost_models.presets import DEVICE_PRESETS
from tppc.cost_models.report import report_from_graph
from tppc.errors import SpecError
from tppc.frontend.annotate import annotate, program_of


def factory():
    """A tiny Llama, for the CLI handler test (`test_cost_report:factory`)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 128, (1, 32)),)


@pytest.fixture(scope="module")
def tiny():
    model, args = factory()
    gm, ctx = annotate(model, args)
    return program_of(gm, ctx), ctx


@pytest.fixture(scope="module")
def llama70b_block():
    """One Llama-70B-shaped block in bf16 on the meta device (no weights allocated)."""
    cfg = LlamaConfig(vocab_size=256, hidden_size=8192, intermediate_size=28672,
                      num_hidden_layers=1, num_attention_heads=64, num_key_value_heads=8)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gm, ctx = annotate(model, (torch.randint(0, 256, (1, 32), device="meta"),))
    return program_of(gm, ctx), ctx


def _block_row(report):
    return next(r for r in report.layers if r.kind == "block")


def test_h100_16_token_chunk_is_memory_bound(llama70b_block):
    gm, ctx = llama70b_block
    report = report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=16)
    row = _block_row(report)
    assert row.bound == "memory" and row.intensity < report.ridge_point


def test_h100_4096_token_chunk_is_compute_bound(llama70b_block):
    gm, ctx = llama70b_block
    report = report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=4096)
    row = _block_row(report)
    assert row.bound == "compute" and row.intensity > report.ridge_point
    assert report.dtype == "bf16" and report.ridge_point == pytest.approx(295, rel=0.01)


def test_report_prints_a_table_with_merged_identical_blocks(tiny):
    gm, ctx = tiny
    text = str(report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=128, prefix=256))
    assert "ridge point" in text and "bound" in text and "total" in text
    assert "model.layers.0 (x2)" in text


def test_report_formula_is_in_chunk_and_prefix(tiny):
    gm, ctx = tiny
    report = report_from_graph(gm, ctx, cluster="1xtpu-v5p", chunk=130)
    formula = report.formula("model.layers.0")
    assert "matrix_flops" in formula and "c" in formula and "p" in formula
    assert "ceiling" in formula  # tile padding on the 128×128 MXU
    with pytest.raises(Exception, match="no layer 'nope'"):
        report.formula("nope")


def test_report_json_has_totals_and_every_layer(tiny):
    gm, ctx = tiny
    report = report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=64)
    data = json.loads(report.to_json())
    assert len(data["layers"]) == len(ctx.layers)
    c, d, ff, heads, kv, hd, vocab = 64, 64, 128, 4, 2, 16, 128  # factory()'s config
    block = 2 * c * (2 * d * d + 2 * d * kv * hd + 3 * d * ff) + 4 * heads * hd * c * (c + 1) / 2
    hand = 2 * block + 2 * c * d * vocab  # two blocks (causal keys visited) + the LM head
    assert sum(r["matrix_flops"] for r in data["layers"]) == pytest.approx(hand)
    vector = sum(r["vector_flops"] for r in data["layers"])
    assert data["total_flops"] == pytest.approx(hand + vector) and vector > 0
    linears = 2 * 7 + 1  # q, k, v, o, gate, up, down per block, and the LM head
    assert data["total_time"] >= linears * DEVICE_PRESETS["h100-sxm"].op_overhead
    assert set(data["formulas"]["model.layers.0"]) == {"matrix_flops", "vector_flops", "bytes",
                                                       "time"}


def test_report_rejects_bad_chunk_and_prefix(tiny):
    gm, ctx = tiny
    with pytest.raises(SpecError, match="chunk must be an int >= 1, got 0"):
        report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=0)
    with pytest.raises(SpecError, match="prefix"):
        report_from_graph(gm, ctx, cluster="1xh100-sxm", chunk=8, prefix=-1)


def test_cost_command_prints_the_report(capsys):
    parser = add_cost_arguments(argparse.ArgumentParser())
    ns = parser.parse_args(["test_cost_report:factory", "--cluster", "2xh100-sxm",
                            "--chunk", "64", "--prefix", "32", "--formula", "model.layers.1"])
    assert cost_command(ns) == 0
    out = capsys.readouterr().out
    assert "64-token chunk after 32 tokens" in out and "model.layers.1 on h100-sxm" in out


def test_report_of_a_bidirectional_dit_substitutes_the_full_length() -> None:
    from tppc import examples
    from tppc.driver.costing import cost_report

    model, args, kwargs = examples.dit(size=16)
    short = cost_report(model, args, kwargs, cluster="1xa100-80gb", chunk=16, seq_len=64)
    long = cost_report(model, args, kwargs, cluster="1xa100-80gb", chunk=16, seq_len=4096)
    assert "blocks.0" in str(short)
    # bidirectional attention reads all L keys: a longer sequence costs the chunk more
    assert long.total_time > short.total_time
