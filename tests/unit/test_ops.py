"""tppc::chunk_attention equals SDPA on the full sequence, row block by row block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import tppc.ir.ops as ops
from tests.oracles import assert_kernels_close


def _qkv(length: int, heads: int = 2, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, length, dim, generator=g)
    k = torch.randn(2, kv_heads, length, dim, generator=g)
    v = torch.randn(2, kv_heads, length, dim, generator=g)
    return q, k, v


@settings(max_examples=40, deadline=None)
@given(length=st.integers(1, 40), data=st.data())
def test_causal_chunk_equals_the_rows_of_full_causal_attention(length, data):
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    q, k, v = _qkv(length, heads=4, kv_heads=2)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = torch.ops.tppc.chunk_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                         start, True, None, True)
    assert_kernels_close(out, full[:, :, start:end])


def test_a_later_causal_chunk_visits_the_prefix_and_the_diagonal_triangle_only(monkeypatch):
    calls: list[tuple[int, int, bool, bool]] = []
    real = ops._FLASH_CPU

    def spy(q, k, v, *args, **kwargs):
        calls.append((q.shape[-2], k.shape[-2], kwargs.get("is_causal", False),
                      kwargs.get("attn_mask") is not None))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(ops, "_FLASH_CPU", spy)
    q, k, v = _qkv(30, heads=4, kv_heads=2)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = ops.chunk_attention_eager(q[:, :, 10:20], k, v, 10, True, None, True)  # 30 keys given
    assert_kernels_close(out, full[:, :, 10:20])
    # keys [10, 20) under SDPA's causal mask, then the 10 prefix keys unmasked; none after 20
    assert sorted(calls) == [(10, 10, False, False), (10, 10, True, False)]


def test_the_causal_split_keeps_bf16_close_and_the_output_layout():
    q, k, v = (t.to(torch.bfloat16) for t in _qkv(64, heads=4, kv_heads=4))
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (b, c, h, d) storage, like HF's
    full = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    out = ops.chunk_attention_eager(q[:, :, 40:], k, v, 40, True)
    assert out.dtype == torch.bfloat16 and out.shape == q[:, :, 40:].shape
    torch.testing.assert_close(out.float(), full[:, :, 40:], atol=2e-2, rtol=2e-2)


def test_long_chunks_are_cut_into_row_blocks_with_bounded_masks(monkeypatch):
    monkeypatch.setattr(ops, "MASK_ELEMENTS", 64)  # 64 mask elements: blocks of 2-3 rows
    monkeypatch.setattr(ops, "_split_ok", lambda *a: False)  # the path of other devices
    seen: list[tuple[int, ...]] = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        if kwargs.get("attn_mask") is not None:
            seen.append(tuple(kwargs["attn_mask"].shape))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(30)
    out = ops.chunk_attention_eager(q[:, :, 10:], k, v, 10, True)
    full = real(q, k, v, is_causal=True)
    assert_kernels_close(out, full[:, :, 10:])
    assert len(seen) > 1 and all(rows * keys <= 64 for rows, keys in seen)


def test_bidirectional_chunk_sees_every_key():
    q, k, v = _qkv(12)
    out = torch.ops.tppc.chunk_attention(q[:, :, 4:9], k, v, 4, False)
    assert_kernels_close(out, F.scaled_dot_product_attention(q, k, v)[:, :, 4:9])


def test_a_causal_chunk_that_reads_past_its_keys_is_refused():
    q, k, v = _qkv(8)
    with pytest.raises(ValueError, match="reads beyond"):
        torch.ops.tppc.chunk_attention(q[:, :, 4:], k[:, :, :6], v[:, :, :6], 4, True)
