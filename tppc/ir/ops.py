"""tppc's own operators: attention of one chunk over the K/V buffer, in O(c · L) memory.

Terms:
    chunk attention: the queries of a chunk ``[chunk_start, chunk_start + c)`` attending to
        the keys ``[0, kv_len)`` read from a K/V buffer. Causal: query row ``i`` (absolute
        position ``chunk_start + i``) sees keys ``j ≤ chunk_start + i`` (SDPA's
        lower-right-aligned causal mask when ``kv_len = chunk_start + c``). Bidirectional: every
        key is visible.

``torch.ops.tppc.chunk_attention`` is a ``torch.library`` custom op, so a stage graph that
calls it can be exported (``torch.export`` keeps it as one node) and priced as one node.
It never builds an ``L × L`` mask: the first chunk of a causal sequence is SDPA with
``is_causal=True``; on CPU a later chunk visits the keys a causal kernel visits, the prefix
``[0, p)`` without a mask and the diagonal block ``[p, p + c)`` with ``is_causal`` (its
upper triangle skipped), merged by their log-sum-exps: the ``p·c + c²/2`` keys the cost
model prices. Otherwise (other devices, padding, windows) a chunk is cut into query blocks
whose boolean mask holds at most :data:`MASK_ELEMENTS` elements, each block reading only
the keys it may see. A padding mask arrives as an O(L) key-validity vector and a sliding
window (or the block of chunked attention) as an int, combined per block: a window of
``w`` keys reads ``O(c · w)`` keys, not the whole prefix. A float attention bias (ALiBi) arrives as its rows for the chunk
(``c × kv_len``, hiding the later keys itself) and is SDPA's mask as it is. With a
soft-cap or attention sinks (:mod:`tppc.ir.softmax_attention`) every path runs that module's
kernel on the same blocks in place of SDPA.

Example:
    >>> q = k = v = torch.randn(1, 2, 8, 4)
    >>> out = torch.ops.tppc.chunk_attention(q[:, :, 4:], k, v, 4, True)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, 4:])
    True
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from tppc.ir.softmax_attention import softmax_attention_math

__all__ = ["MASK_ELEMENTS", "chunk_attention", "chunk_attention_eager"]

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

MASK_ELEMENTS = 1 << 24
"""Largest boolean mask (query rows × keys) one block of a causal chunk builds (16 MiB)."""


def chunk_attention_eager(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    chunk_start: int, causal: bool, scale: float | None = None,
                    enable_gqa: bool = False, attn_mask: torch.Tensor | None = None,
                    key_valid: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    block: int | None = None) -> torch.Tensor:
    """Attention of a chunk's queries over the buffer's keys (see the module docstring);
    the body of the ``tppc::chunk_attention`` op.

    Args:
        query: ``(..., c, d)`` the chunk's queries.
        key: ``(..., kv_len, d)`` the keys ``[0, kv_len)`` of the buffer.
        value: ``(..., kv_len, d_v)`` the values, likewise.
        chunk_start: absolute position of the chunk's first query.
        causal: mask keys after each query's position (a causal ``attn_mask`` must hide
            them itself).
        scale: SDPA's scale (None: ``1/sqrt(d)``).
        enable_gqa: SDPA's grouped-query attention (fewer K/V heads than query heads).
        attn_mask: a mask of the chunk's rows over ``kv_len`` keys; with ``causal=True`` a
            float bias (ALiBi) that already hides the keys after each row (with ``-inf`` or
            the dtype's minimum), used as it is (then ``key_valid`` and ``window`` must be
            None).
        key_valid: ``(batch, ≥ kv_len)``: keys ``j`` with ``key_valid[b, j] == 0`` are hidden
            from every query of sequence ``b`` (a padding mask).
        window: causal sliding window: query ``i`` sees keys ``i - window < j ≤ i`` only.
        softcap: tanh soft-capping of the scaled scores (see
            :mod:`tppc.ir.softmax_attention`); with ``sinks``, the blocks run
            :func:`softmax_attention_math` in place of SDPA.
        sinks: one logit per head appended to every row's scores (attention sinks).
        block: causal block-local (chunked) attention: query ``i`` sees keys
            ``i // block == j // block``, ``j ≤ i`` only (Llama 4's ``attention_chunk_size``);
            a block of rows reads from its first row's block start.
    """
    extended = softcap is not None or sinks is not None
    attend = functools.partial(softmax_attention_math, softcap=softcap, sinks=sinks) \
        if extended else F.scaled_dot_product_attention
    if not causal:
        if window is not None or block is not None:
            raise ValueError("tppc::chunk_attention: a window or a block needs causal=True")
        if key_valid is not None:
            valid = key_valid[:, : key.shape[-2]].bool()[:, None, None, :]
            attn_mask = valid if attn_mask is None else attn_mask & valid
        return attend(query, key, value, attn_mask=attn_mask, scale=scale,
                      enable_gqa=enable_gqa)
    c, kv_len = query.shape[-2], key.shape[-2]
    if chunk_start + c > kv_len:
        raise ValueError(f"tppc::chunk_attention: chunk [{chunk_start}, {chunk_start + c}) "
                         f"reads beyond the {kv_len} keys given")
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool or key_valid is not None or window is not None \
                or block is not None:
            raise ValueError("tppc::chunk_attention: causal=True takes a float attn_mask "
                             "(a bias hiding later keys itself) without key_valid, window "
                             "or block")
        return attend(query, key, value, attn_mask=attn_mask, scale=scale,
                      enable_gqa=enable_gqa)
    plain = key_valid is None and (window is None or window >= kv_len) \
        and (block is None or block >= kv_len)
    if plain and chunk_start == 0 and c == kv_len:
        return attend(query, key, value, is_causal=True, scale=scale,
                      enable_gqa=enable_gqa)
    if plain and not extended and _split_ok(query, key, value, enable_gqa):
        return _prefix_and_diagonal(query, key, value, chunk_start, scale)
    out = query.new_empty((*query.shape[:-1], value.shape[-1]))
    batch = 1 if key_valid is None else key_valid.shape[0]
    span = chunk_start + c if window is None else min(chunk_start + c, window + c)
    rows = max(1, min(c, MASK_ELEMENTS // max(1, batch * span)))
    if window is not None:  # a block of r rows reads r + window keys: keep r near window
        rows = min(rows, max(64, window))
    if block is not None:  # r rows read at most r + block keys
        rows = min(rows, max(64, block))
    if extended:  # the scores themselves are built, for every head
        heads = max(1, query.numel() // max(1, c * query.shape[-1]))
        rows = max(1, min(rows, MASK_ELEMENTS // max(1, heads * span)))
    for r0 in range(0, c, rows):
        r1 = min(c, r0 + rows)
        hi = chunk_start + r1  # the last row of this block sees keys [lo, hi)
        lo = 0 if window is None else max(0, chunk_start + r0 - window + 1)
        if block is not None:
            lo = max(lo, (chunk_start + r0) // block * block)
        positions = torch.arange(chunk_start + r0, chunk_start + r1, device=query.device)
        keys = torch.arange(lo, hi, device=query.device)
        mask = keys <= positions[:, None]
        if window is not None:
            mask = mask & (keys > positions[:, None] - window)
        if block is not None:
            mask = mask & (keys // block == positions[:, None] // block)
        if key_valid is not None:
            mask = mask & key_valid[:, lo:hi].bool()[:, None, None, :]
        out[..., r0:r1, :] = attend(
            query[..., r0:r1, :], key[..., lo:hi, :], value[..., lo:hi, :], attn_mask=mask,
            scale=scale, enable_gqa=enable_gqa)
    return out


def _split_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              enable_gqa: bool) -> bool:
    """Whether :func:`_prefix_and_diagonal` applies: CPU floating tensors of 4 dims, as many
    K/V heads as query heads (or a divisor of them with ``enable_gqa``), a prefix."""
    if query.device.type != "cpu" or query.dim() != 4 or not query.dtype.is_floating_point:
        return False
    if not (key.dtype == value.dtype == query.dtype and key.device == query.device):
        return False
    heads, kv_heads = query.shape[1], key.shape[1]
    return heads == kv_heads or (enable_gqa and heads % kv_heads == 0)


def _prefix_and_diagonal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         chunk_start: int, scale: float | None) -> torch.Tensor:
    """Causal attention of a chunk after ``chunk_start`` prefix keys, visiting only the keys
    each row sees: the prefix ``[0, p)`` unmasked, the diagonal block ``[p, p + c)`` with
    SDPA's causal mask (its upper triangle skipped), merged by their log-sum-exps.

    ``softmax`` over the union of two key sets is the two partial softmaxes weighted by
    ``exp(lse_i) / (exp(lse_1) + exp(lse_2))``, i.e. ``sigmoid(lse_1 - lse_2)`` for the
    prefix. Grouped-query K/V heads are read in place (the CPU flash kernel groups them).
    """
    c = query.shape[-2]
    p = chunk_start
    diag, lse_d = _FLASH_CPU(query, key.narrow(-2, p, c), value.narrow(-2, p, c),
                             is_causal=True, scale=scale)
    if p == 0:
        return diag
    pre, lse_p = _FLASH_CPU(query, key.narrow(-2, 0, p), value.narrow(-2, 0, p), scale=scale)
    weight = torch.sigmoid(lse_p - lse_d).unsqueeze(-1).to(pre.dtype)
    return torch.lerp(diag, pre, weight)


@torch.library.custom_op("tppc::chunk_attention", mutates_args=())
def chunk_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    chunk_start: int, causal: bool, scale: float | None = None,
                    enable_gqa: bool = False, attn_mask: torch.Tensor | None = None,
                    key_valid: torch.Tensor | None = None, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None,
                    block: int | None = None) -> torch.Tensor:
    """``torch.ops.tppc.chunk_attention``: :func:`chunk_attention_eager` as one graph node."""
    return chunk_attention_eager(query, key, value, chunk_start, causal, scale, enable_gqa,
                                 attn_mask, key_valid, window, softcap, sinks, block)


@chunk_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk_start: int,
      causal: bool, scale: float | None = None, enable_gqa: bool = False,
      attn_mask: torch.Tensor | None = None, key_valid: torch.Tensor | None = None,
      window: int | None = None, softcap: float | None = None,
      sinks: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
