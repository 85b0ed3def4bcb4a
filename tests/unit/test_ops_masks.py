"""tppc::chunk_attention with a key-validity vector and a window, against dense SDPA."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import tppc.ir.ops  # noqa: F401
from tests.oracles import assert_kernels_close


@pytest.mark.parametrize("window", [None, 3, 50])
@pytest.mark.parametrize("start,size", [(0, 16), (5, 7), (12, 4)])
def test_chunk_equals_dense_mask(window: int | None, start: int, size: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    valid = torch.ones(2, 16, dtype=torch.long)
    valid[0, :4] = 0
    valid[1, 10:] = 0
    i, j = torch.arange(16)[:, None], torch.arange(16)
    dense = (j <= i) & ((i - j < window) if window else True) & valid.bool()[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)[:, :, start:start + size]
    end = start + size
    got = torch.ops.tppc.chunk_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                         start, True, None, False, None, valid, window)
    assert_kernels_close(got, want)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("start,size", [(0, 16), (5, 7), (12, 4), (7, 1)])
def test_a_chunk_of_block_local_attention_equals_dense_blocks(start: int, size: int,
                                                              padded: bool) -> None:
    """Chunked attention (Llama 4): query ``i`` sees ``j ≤ i`` in its own block of 5."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    valid = torch.ones(2, 16, dtype=torch.long)
    if padded:
        valid[0, :6] = 0
    i, j = torch.arange(16)[:, None], torch.arange(16)
    dense = (j <= i) & (i // 5 == j // 5) & valid.bool()[:, None, None, :]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)[:, :, start:start + size]
    want = want.masked_fill(~dense.any(-1, keepdim=True)[:, :, start:start + size], 0.0)
    end = start + size
    got = torch.ops.tppc.chunk_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                         start, True, None, False, None,
                                         valid if padded else None, None, None, None, 5)
    assert_kernels_close(got, want)


@pytest.mark.parametrize("start,size", [(0, 16), (5, 7), (12, 4)])
def test_a_causal_chunk_with_float_bias_rows_equals_the_rows_of_dense_attention(start, size):
    """ALiBi rows (``-slope · (i - j)``, later keys at the dtype's minimum) over the chunk's
    ``kv_len = start + size`` keys give the rows of attention over every key."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))
    i, j = torch.arange(16)[:, None], torch.arange(16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None]
    bias = (-slopes * (i - j)).masked_fill(j > i, torch.finfo(torch.float32).min)[None]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)[:, :, start:start + size]
    end = start + size
    got = torch.ops.tppc.chunk_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end],
                                         start, True, None, False, bias[..., start:end, :end])
    assert_kernels_close(got, want)


def test_a_causal_chunk_refuses_a_boolean_mask_or_a_bias_with_a_window() -> None:
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="float attn_mask"):
        torch.ops.tppc.chunk_attention(q, k, v, 0, True, None, False,
                                       torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="float attn_mask"):
        torch.ops.tppc.chunk_attention(q, k, v, 0, True, None, False, torch.zeros(8, 8),
                                       None, 4)
