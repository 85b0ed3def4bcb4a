"""How an attention reads a K/V buffer: a prefix, through views that keep or repeat its heads.

Terms:
    buffer read: ``narrow(buffer, axis, 0, kv_len)``, the keys (or values) ``[0, kv_len)``
        of a K/V buffer, as an emitted stage graph reads them.
    view chain: the ops between the buffer read and the attention: reshapes, views,
        ``unsqueeze``, ``expand``, clones (:data:`VIEW_OPS`). It is either the identity
        (Bloom's ``(b·h, t, d)`` round trip, Falcon's reshape to the same shape) or repeats
        each head ``group`` times, ``repeat_interleave(group, dim=-3)`` (transformers'
        ``repeat_kv`` before SDPA: Mixtral, Qwen3-MoE), which is what grouped-query
        attention (``enable_gqa=True``) computes from the buffer's own heads.

:func:`buffer_read` finds the read under a chain and tells which of the two the chain is by
running it on position-stamped tensors of two lengths (so no op is special-cased by its
arguments); export then reads the buffer's prefix directly (with ``enable_gqa`` when the
heads repeat), and a chunk never copies the whole cache.

Example:
    >>> read = buffer_read(attention.args[1], {"key_buffer"})              # doctest: +SKIP
    >>> read.narrow.target, read.group
    (aten.narrow.default, 2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from tppc.ir.records import CHUNK_INPUT

__all__ = ["VIEW_OPS", "BufferRead", "buffer_read", "is_buffer_narrow"]

_aten = torch.ops.aten

VIEW_OPS = frozenset({
    _aten.reshape.default, _aten.view.default, _aten._unsafe_view.default,
    _aten.unsqueeze.default, _aten.expand.default, _aten.clone.default,
    _aten.contiguous.default, _aten.alias.default, _aten.flatten.using_ints,
    _aten.unflatten.int, _aten.squeeze.dim,
})
"""Ops a view chain may hold: each moves or repeats elements, never computes with them."""

_LENGTHS = (3, 5)
"""The two buffer lengths a chain is run at (a chain that only looks right at one is not)."""


@dataclass(frozen=True)
class BufferRead:
    """A buffer read under a view chain.

    Attributes:
        narrow: the ``narrow(buffer, axis, start, kv_len)`` node.
        group: 1 when the chain is the identity, ``g`` when it repeats each head ``g`` times.
        chain: the chain's ops, from the read up to the attention's argument.
    """

    narrow: fx.Node
    group: int
    chain: tuple[fx.Node, ...]


def is_buffer_narrow(node: Any, buffers: set[str]) -> bool:
    """Whether ``node`` is ``narrow`` of a K/V buffer placeholder."""
    return (isinstance(node, fx.Node) and node.target is _aten.narrow.default
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"
            and node.args[0].name in buffers)


def buffer_read(node: Any, buffers: set[str]) -> BufferRead | None:
    """The buffer read ``node`` is, through a view chain that keeps or repeats the heads;
    None when ``node`` is anything else (another op on the way, a chain that moves tokens or
    channels)."""
    chain: list[fx.Node] = []
    while isinstance(node, fx.Node) and node.target in VIEW_OPS:
        chain.append(node)
        node = node.args[0]
    if not is_buffer_narrow(node, buffers):
        return None
    chain.reverse()
    group = _group(node, chain) if chain else 1
    return None if group is None else BufferRead(node, group, tuple(chain))


def _group(narrow: fx.Node, chain: list[fx.Node]) -> int | None:
    """1 (identity) or the head repetition of ``chain`` on the read ``narrow``; None else."""
    spec = narrow.args[0].meta.get(CHUNK_INPUT)
    sizes = getattr(spec, "shape", None)  # the buffer's, None on its token axis
    axis = narrow.args[1]
    if sizes is None or len(sizes) < 3 or not isinstance(axis, int):
        return None
    axis = axis % len(sizes)
    if axis != len(sizes) - 2 or any(s is None for i, s in enumerate(sizes) if i != axis):
        return None
    groups = set()
    for length in _LENGTHS:
        shape = [length if i == axis else int(s) for i, s in enumerate(sizes)]
        x = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        y = _run(chain, {narrow: x, narrow.args[3]: length})
        if y is None or y.dim() != x.dim() or y.shape[-2:] != x.shape[-2:] \
                or y.shape[:-3] != x.shape[:-3] or y.shape[-3] % x.shape[-3]:
            return None
        group = y.shape[-3] // x.shape[-3]
        if not torch.equal(y, x.repeat_interleave(group, dim=-3)):
            return None
        groups.add(group)
    return groups.pop() if len(groups) == 1 else None


def _run(chain: list[fx.Node], env: dict[Any, Any]) -> torch.Tensor | None:
    """The chain's ops on concrete values; None when an argument is another graph value."""
    def value(arg: fx.Node) -> Any:
        if arg not in env:
            raise KeyError(arg.name)
        return env[arg]

    try:
        for node in chain:
            args = fx.node.map_arg(node.args, value)
            kwargs = fx.node.map_arg(node.kwargs, value)
            env[node] = node.target(*args, **kwargs)
    except (KeyError, RuntimeError, TypeError):
        return None
    out = env[chain[-1]]
    return out if isinstance(out, torch.Tensor) else None
