"""Work of one attention call for a chunk: the single pricing rule for every attention node.

Terms:
    c: queries in the chunk; p: tokens before it; keys: what the kernel reads from the K/V
        buffers (``p + c`` for causal attention, the full length ``L`` otherwise).
    visited keys: key positions whose scores the kernel computes. A causal kernel skips the
        masked upper triangle of the chunk's diagonal block, so query row ``i`` (absolute
        position ``p + i``) visits ``p + i + 1`` keys and the chunk ``p·c + c(c+1)/2`` per
        head, not ``(p + c)·c``. Summed over any split of ``[0, L)`` that is ``L(L+1)/2``
        per head: the causal work does not depend on the split.
    heads / kv_heads: query heads and K/V heads (grouped-query attention when they differ;
        priced as SDPA with ``enable_gqa=True``, which reads each K/V head once and never
        materialises the repeated K/V).

The aten SDPA node of the annotated graph and the ``tppc.chunk_attention`` op of the emitted
chunk-step graph both describe the same call; each only extracts ``(c, p, causal, heads,
head_dim, kv_heads, ...)`` and calls :func:`attention_work`.

Example:
    >>> w = attention_work(sympy.Integer(4), sympy.Integer(0), causal=True, heads=1,
    ...                    head_dim=1, kv_heads=1, itemsize=2, keys=sympy.Integer(4))
    >>> w.visited  # 1 + 2 + 3 + 4 keys for 4 queries
    10
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

__all__ = ["AttentionWork", "attention_work", "causal_padded_keys", "windowed_visited"]


@dataclass(frozen=True)
class AttentionWork:
    """Work of one attention call (sympy expressions or numbers).

    Attributes:
        matmuls: ``(batch, m, n, k)`` of ``Q·Kᵀ`` and ``P·V``; ``n``/``k`` of the key axis is
            the mean number of visited keys per query row (exact FLOPs, unpadded).
        vector_flops: softmax and scaling over the visited scores.
        bytes: queries and output, plus the K/V buffers read over ``keys`` positions, plus the
            chunk's K/V written into the buffers, plus a mask of ``c × keys`` when given.
        kv_bytes_per_key: K/V buffer bytes per key position (before any head repeat).
        visited: visited key positions summed over one head's query rows.
        causal: True when the kernel skips the masked triangle (see the module docstring).
    """

    matmuls: tuple[tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr], ...]
    vector_flops: sympy.Expr
    bytes: sympy.Expr
    kv_bytes_per_key: sympy.Expr
    visited: sympy.Expr
    causal: bool


def attention_work(
    c: sympy.Expr,
    p: sympy.Expr,
    *,
    causal: bool,
    heads: sympy.Expr | int,
    head_dim: sympy.Expr | int,
    kv_heads: sympy.Expr | int,
    itemsize: int,
    keys: sympy.Expr,
    value_dim: sympy.Expr | int | None = None,
    batch: sympy.Expr | int = 1,
    mask_itemsize: int = 0,
    writes_kv: bool = True,
    window: int | None = None,
) -> AttentionWork:
    """Price one attention call of ``c`` queries after ``p`` tokens.

    Args:
        c: queries (chunk tokens).
        p: tokens before the chunk.
        causal: query row ``i`` sees keys ``≤ p + i`` (else every one of ``keys``).
        heads: query heads (per batch element).
        head_dim: query/key head dimension.
        kv_heads: K/V heads (equal to ``heads`` without grouped-query attention).
        itemsize: bytes per element of Q, K, V and the output.
        keys: key positions read: ``p + c`` (causal) or the buffer length ``L``.
        value_dim: value head dimension (default ``head_dim``).
        batch: batch size.
        mask_itemsize: bytes per element of an explicit ``(c, keys)`` mask (0: none).
        writes_kv: count writing the chunk's K/V into the buffers (an aten SDPA node stands
            for the write too; in the chunk-step graph a separate ``copy_`` node does it).
        window: causal sliding window of ``w`` keys: row ``i`` visits ``min(w, p + i + 1)``
            keys (:func:`windowed_visited`); ``keys`` should then be ``min(p + c, w + c - 1)``.

    Returns:
        The :class:`AttentionWork`.
    """
    dv = head_dim if value_dim is None else value_dim
    bh = batch * heads
    if causal and window is not None:
        visited = windowed_visited(c, p, window)
    else:
        visited = p * c + c * (c + 1) / 2 if causal else c * keys
    per_row = sympy.expand(visited / c)
    matmuls = ((bh, c, per_row, head_dim), (bh, c, dv, per_row))
    kv_per_key = batch * kv_heads * (head_dim + dv) * itemsize
    nbytes = (bh * c * (head_dim + dv) * itemsize  # read Q, write O
              + kv_per_key * keys  # read the K/V buffers
              + (kv_per_key * c if writes_kv else 0)  # write the chunk's K/V into them
              + batch * c * keys * mask_itemsize)
    return AttentionWork(
        matmuls=tuple(tuple(sympy.expand(sympy.sympify(d)) for d in mm) for mm in matmuls),
        vector_flops=sympy.expand(5 * bh * visited),
        bytes=sympy.expand(nbytes),
        kv_bytes_per_key=sympy.sympify(kv_per_key),
        visited=sympy.expand(visited),
        causal=causal,
    )


def causal_padded_keys(p: sympy.Expr, c: sympy.Expr, tile_m: int, tile_n: int) -> sympy.Expr:
    """Mean visited keys per query row on a tiled causal kernel, tiles included.

    With query tiles of ``tile_m`` rows and key tiles of ``tile_n``, query tile ``r`` of the
    chunk reads the prefix and the diagonal tiles up to its own: ``p + (r + 1)·tile`` keys;
    averaged over ``⌈c / tile_m⌉`` tiles that is ``p + (pad(c) + tile) / 2``, which equals
    the exact ``p + (c + 1)/2`` for tiles of 1. Padded work of any split is at least that
    of one chunk when chunk sizes are multiples of the tile.
    """
    tile = max(tile_m, tile_n)
    padded_c = c if tile <= 1 else sympy.ceiling(c / tile_m) * tile_m
    return p + (padded_c + tile) / 2 if tile > 1 else p + (c + 1) / 2


def windowed_visited(c: sympy.Expr, p: sympy.Expr, window: int) -> sympy.Expr:
    """Keys visited by ``c`` causal queries after ``p`` tokens with a window of ``window``.

    ``Σ_i min(w, p + i + 1)``: the first ``n₀ = min(max(w − p, 0), c)`` rows still see their
    whole prefix (``n₀·p + n₀(n₀+1)/2``), the other ``c − n₀`` rows see ``w`` keys each.
    """
    w = sympy.Integer(window)
    n0 = sympy.Min(sympy.Max(w - p, 0), c)
    return n0 * p + n0 * (n0 + 1) / 2 + (c - n0) * w
