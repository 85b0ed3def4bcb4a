"""Export of pipelines whose attention has a sliding window or a padding mask (issue 18).

The exported attention (:func:`tppc.artifact.writer.graphs.split_attention` and its ONNX form)
reads the window's keys only and hides padded keys; the oracles are
``tppc::chunk_attention`` over the written buffer and the eager HF model.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import tppc
from tests.oracles import assert_kernels_close
from tppc import examples
from tppc.artifact.writer.graphs import ExportError, export_stage_graph, split_attention
from tppc.ir.ops import chunk_attention_eager
from tppc.passes.subgraph import copy_graph

pytest.importorskip("transformers")


@pytest.mark.parametrize("start,window,padded,gqa,block", [
    (9, 4, False, False, None), (9, 4, True, True, None), (2, 4, False, False, None),
    (9, None, True, False, None), (0, None, True, True, None), (9, None, False, True, 4),
    (7, None, True, False, 4)])
def test_split_attention_with_window_or_padding_equals_chunk_attention(start, window, padded,
                                                                       gqa, block) -> None:
    torch.manual_seed(0)
    heads, kv_heads, c, cap = (4, 2, 5, 16) if gqa else (2, 2, 5, 16)
    query = torch.randn(2, heads, c, 8)
    kb, vb = torch.randn(2, kv_heads, cap, 8), torch.randn(2, kv_heads, cap, 8)
    k, v = torch.randn(2, kv_heads, c, 8), torch.randn(2, kv_heads, c, 8)
    valid = None
    if padded:  # sequence 0 left-padded over the whole chunk's prefix: some rows see nothing
        valid = torch.ones(2, cap, dtype=torch.long)
        valid[0, : start + 2] = 0
        valid[1, start + 3:] = 0
    ours = split_attention(query, kb, vb, k, v, start, start + c, True, None, gqa, None,
                           valid, window, block=block)
    kb[:, :, start:start + c], vb[:, :, start:start + c] = k, v
    want = chunk_attention_eager(query, kb[:, :, :start + c], vb[:, :, :start + c], start,
                                 True, None, gqa, key_valid=valid, window=window, block=block)
    assert_kernels_close(ours, want)


@pytest.mark.parametrize("gqa,window,padded", [(False, None, False), (True, 4, True)])
def test_split_attention_with_soft_cap_and_sinks_equals_chunk_attention(gqa, window,
                                                                         padded) -> None:
    """Issue 31: the exported form of ``tppc::softmax_attention`` (Gemma 2, GPT-OSS)."""
    torch.manual_seed(0)
    heads, kv_heads, c, cap, start = (4, 2, 5, 16, 9) if gqa else (2, 2, 5, 16, 9)
    query = torch.randn(2, heads, c, 8) * 4  # scores of several units: the cap shows
    kb, vb = torch.randn(2, kv_heads, cap, 8) * 4, torch.randn(2, kv_heads, cap, 8)
    k, v = torch.randn(2, kv_heads, c, 8) * 4, torch.randn(2, kv_heads, c, 8)
    sinks = torch.randn(1, heads, 1, 1) + 1
    valid = None
    if padded:
        valid = torch.ones(2, cap, dtype=torch.long)
        valid[0, : start + 2] = 0
    ours = split_attention(query, kb, vb, k, v, start, start + c, True, None, gqa, None,
                           valid, window, 1.5, sinks)
    kb[:, :, start:start + c], vb[:, :, start:start + c] = k, v
    want = chunk_attention_eager(query, kb[:, :, :start + c], vb[:, :, :start + c], start,
                                 True, None, gqa, key_valid=valid, window=window,
                                 softcap=1.5, sinks=sinks)
    assert_kernels_close(ours, want)
    plain = chunk_attention_eager(query, kb[:, :, :start + c], vb[:, :, :start + c], start,
                                  True, None, gqa, key_valid=valid, window=window)
    assert (plain - want).abs().max() > 1e-2  # the cap and the sinks change the result


def test_bidirectional_split_attention_with_padding_equals_chunk_attention() -> None:
    torch.manual_seed(0)
    query = torch.randn(2, 2, 4, 8)
    kb, vb, k, v = (torch.randn(2, 2, n, 8) for n in (12, 12, 4, 4))
    valid = torch.ones(2, 12, dtype=torch.long)
    valid[1, 8:] = 0
    ours = split_attention(query, kb, vb, k, v, 3, 12, False, None, False, None, valid)
    kb[:, :, 3:7], vb[:, :, 3:7] = k, v
    want = chunk_attention_eager(query, kb, vb, 3, False, key_valid=valid)
    assert_kernels_close(ours, want)


def test_windowed_mistral_exports_and_runs_exactly_on_onnxruntime(tmp_path) -> None:
    model, (ids,), _ = examples.hf_mistral(seq_len=32, window=8)
    cp = tppc.compile(model, (ids,), chunks=3)
    assert max(b - a for a, b in cp.plan.chunks) > 8  # chunks past the window: lo > 0
    tppc.export(cp, tmp_path, lengths=[20, 32])
    runner = tppc.load(tmp_path, threads_per_stage=1)
    for length in (20, 32):
        x = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want = model(x).logits.numpy()
        assert_kernels_close(runner(x.numpy()).logits, want)
    with torch.no_grad():  # decoding steps: one-token chunks far past the window
        want = model.generate(ids[:, :20], max_new_tokens=14, do_sample=False,
                              pad_token_id=0, eos_token_id=None)
    got = runner.generate(ids[:, :20].numpy(), max_new_tokens=14, eos_token_id=None)
    np.testing.assert_array_equal(got, want.numpy())


def test_padded_llama_with_attention_mask_exports_and_runs_exactly(tmp_path) -> None:
    model, _, _ = examples.hf_llama()
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 24))
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0  # left padding: rows 0..4 of sequence 0 see no key
    mask[1, 20:] = 0
    cp = tppc.compile(model, (ids,), {"attention_mask": mask}, chunks=3)
    tppc.export(cp, tmp_path)
    runner = tppc.load(tmp_path, threads_per_stage=1)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits.numpy()
    got = runner(ids.numpy(), attention_mask=mask.numpy()).logits
    assert_kernels_close(got, want)


def test_a_window_that_is_not_a_constant_is_refused_by_name() -> None:
    model, (ids,), _ = examples.hf_mistral(seq_len=16, window=4)
    stage = tppc.compile(model, (ids,), chunks=2, num_stages=1).program(16).stages[0]
    gm = copy_graph(stage.module)  # a copy to edit
    graph = gm.graph
    node = next(n for n in graph.nodes if n.target is torch.ops.tppc.chunk_attention.default)
    size = next(n for n in graph.nodes if n.op == "placeholder"
                and n.meta["tppc.chunk_input"].kind == "chunk_size")
    node.args = (*node.args[:9], size)
    fake = types.SimpleNamespace(module=gm, buffers=stage.buffers, index=0)
    with pytest.raises(ExportError, match=rf"{node.name}.*sliding window.*fix:"):
        export_stage_graph(fake)
