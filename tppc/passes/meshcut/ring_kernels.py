"""Run-time kernels of Ring attention (:mod:`tppc.passes.meshcut.ring_form`): one K/V block
attended with its log-sum-exp, and partial results merged by the log-sum-exp rule.

Terms:
    partial: ``(out, lse)`` of the queries over one block of keys: ``out`` the softmax-weighted
        values over that block (float32), ``lse`` the log-sum-exp of its scaled scores
        (``(..., rows)``, float32).
    merge: attention over the union of two key blocks is the two partials weighted by
        ``exp(lse_i) / (exp(lse_1) + exp(lse_2))``: ``lerp(out_1, out_2, sigmoid(lse_2 -
        lse_1))``, with ``lse = logaddexp(lse_1, lse_2)``. Exact up to the reassociation of
        the softmax sums (Liu et al., *Ring Attention with Blockwise Transformers*, 2023;
        yunchang's ``update_out_and_lse``).
    block: the keys and values a member passes around the ring, joined on their last axis
        (one tensor per shift; ``split`` is the keys' last size).

These run inside worker graphs (fx calls them as functions), so they take ints and tensors.

Example:
    >>> import torch
    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 6, 4), torch.randn(1, 2, 6, 4)
    >>> a = attend_block(q, k[:, :, :2], v[:, :, :2], None, False)
    >>> b = attend_block(q, k[:, :, 2:], v[:, :, 2:], None, False)
    >>> out = finish(merge(*a, *b)[0], q)
    >>> torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, k, v),
    ...                atol=1e-6)
    True
"""

from __future__ import annotations

import math

import torch

__all__ = ["attend_block", "finish", "join_kv", "merge", "step"]

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend_block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float | None, enable_gqa: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial ``(out, lse)`` of ``query`` over one block of keys (module docstring);
    grouped K/V heads with ``enable_gqa``. On CPU the flash kernel (the one SDPA runs);
    elsewhere the scores in float32."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if query.device.type == "cpu" and query.dim() == 4 and query.dtype.is_floating_point \
            and key.dtype == value.dtype == query.dtype and \
            (heads == kv_heads or (enable_gqa and heads % kv_heads == 0)):
        out, lse = _FLASH_CPU(query, key, value, scale=scale)[:2]
        return out.float(), lse.float()
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, -3)
        value = value.repeat_interleave(heads // kv_heads, -3)
    s = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = (query.float() @ key.float().transpose(-1, -2)) * s
    lse = scores.logsumexp(-1)
    out = torch.softmax(scores, -1) @ value.float()
    return out, lse


def merge(out: torch.Tensor, lse: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partials of the same queries over disjoint key blocks merged (module docstring)."""
    weight = torch.sigmoid(lse2 - lse).unsqueeze(-1)
    return torch.lerp(out, out2, weight), torch.logaddexp(lse, lse2)


def join_kv(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """One member's block: its keys and values joined on the last axis (one shift each)."""
    return torch.cat([key, value.to(key.dtype)], -1)


def step(out: torch.Tensor, lse: torch.Tensor, query: torch.Tensor, block: torch.Tensor,
         split: int, scale: float | None, enable_gqa: bool
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial so far merged with ``query``'s partial over a received ``block``."""
    key, value = block[..., :split], block[..., split:]
    return merge(out, lse, *attend_block(query, key, value, scale, enable_gqa))


def finish(out: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """The merged attention output in the queries' type."""
    return out.to(query.dtype)
