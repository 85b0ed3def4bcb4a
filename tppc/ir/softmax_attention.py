"""Attention as a hand-written softmax computes it: scale, soft-capping, additive mask, sinks.

Terms:
    soft-capping: ``cap · tanh(s / cap)`` applied to the scaled scores ``s`` before the mask
        (Gemma 2's ``attn_logit_softcapping``).
    sinks: one extra logit per head (shape broadcastable to ``(..., heads, 1, 1)``) appended
        to every query's scores before the softmax and dropped after it: a key that every
        query sees and whose value is zero (GPT-OSS's ``sinks``).

``torch.ops.tppc.softmax_attention`` is what ``fold_eager_attention_pass`` makes of a
matmul → scale → soft-cap → mask → sinks → softmax → matmul region of the captured graph
when SDPA cannot express it (soft-capping or sinks); its first arguments are SDPA's, so the
passes and the cost model read it as they read SDPA. :func:`softmax_attention_math` is also
the kernel ``tppc::chunk_attention`` runs on each block of a chunk when it is given a soft-cap
or sinks.

Example:
    >>> q = k = v = torch.randn(1, 2, 8, 4)
    >>> out = softmax_attention_math(q, k, v, is_causal=True)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-6)
    True
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F  # noqa: F401  (the doctest)

__all__ = ["softmax_attention", "softmax_attention_math"]


def softmax_attention_math(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                           scale: float | None = None, enable_gqa: bool = False,
                           softcap: float | None = None, sinks: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """``softmax(softcap(scale · q kᵀ) + mask ∥ sinks)[..., :kv] · v``, in transformers' order.

    A boolean mask hides keys, a float mask is added; a query that sees no key gives 0 (as
    SDPA). The softmax runs in float32 and is cast back to ``value``'s dtype.
    """
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeat = query.shape[-3] // key.shape[-3]
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        rows, keys = scores.shape[-2:]
        attn_mask = torch.ones(rows, keys, dtype=torch.bool, device=scores.device).tril()
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    elif attn_mask is not None:
        scores = scores + attn_mask
    if sinks is not None:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    if attn_mask is not None:  # rows that see no key give 0
        probs = probs.masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, value)


@torch.library.custom_op("tppc::softmax_attention", mutates_args=())
def softmax_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                      is_causal: bool = False, scale: float | None = None,
                      enable_gqa: bool = False, softcap: float | None = None,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.ops.tppc.softmax_attention``: SDPA's arguments plus ``softcap`` and ``sinks``
    (``dropout_p`` must be 0: the fold refuses dropout)."""
    if dropout_p:
        raise ValueError(f"tppc::softmax_attention: dropout_p={dropout_p}; only 0 is supported")
    return softmax_attention_math(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                  softcap, sinks)


@softmax_attention.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
      scale: float | None = None, enable_gqa: bool = False, softcap: float | None = None,
      sinks: torch.Tensor | None = None) -> torch.Tensor:
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
