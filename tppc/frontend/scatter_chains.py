"""Outputs a loop writes in place, one position per step, as the ``stack`` they amount to.

Terms:
    scatter chain: ``out = zeros_like(…)`` then ``out[:, :, i] = y_i`` for ``i = 0 … n − 1``
        in a Python loop (Qwen3-Next's ``core_attn_out``), which torch.export's
        functionalisation writes as ``select_scatter(…select_scatter(zeros, y_0, d, 0)…,
        y_{n-1}, d, n − 1)``, each ``y_i`` maybe a ``copy(select(partial, d, i), y_i)``.

When every position is written once and each partial value is read only by the next write,
the chain is ``stack([y_0, …, y_{n-1}], d)`` (the same values), a collector the re-roller
takes (:mod:`tppc.frontend.reroll`).
"""

from __future__ import annotations

import torch
from torch import fx

__all__ = ["rank_of", "stack_scatter_chains", "static_size"]

_aten = torch.ops.aten

_FRESH = (_aten.zeros.default, _aten.zeros_like.default, _aten.new_zeros.default,
          _aten.empty.memory_format, _aten.empty_like.default, _aten.new_empty.default)


def stack_scatter_chains(gm: fx.GraphModule) -> None:
    """Outputs written in place one position per step into a fresh tensor
    (``out[:, :, i] = y_i``, functionalised: ``select_scatter(…select_scatter(zeros, y_0, d,
    0)…, y_{n-1}, d, n-1)``, each ``y_i`` maybe ``copy(select(partial, d, i), y_i)``; every
    position written once, each partial value read only by the next write) become
    ``stack([y_0, …, y_{n-1}], d)``: the same values."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.target is not _aten.select_scatter.default or not isinstance(
                node.args[0], fx.Node) or node.args[0].target not in _FRESH:
            continue
        chain = _scatter_chain(node)
        if chain is None:
            continue
        dim, last = node.args[2] % rank_of(node.args[0]), chain[-1]
        with gm.graph.inserting_before(last):
            stacked = gm.graph.call_function(_aten.stack.default,
                                             ([_written(c) for c in chain], dim))
        stacked.meta.update(last.meta)
        last.replace_all_uses_with(stacked)  # the chain, its slot reads: dead code now
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()


def _scatter_chain(first: fx.Node) -> list[fx.Node] | None:
    """The writes ``first`` starts (see :func:`_stack_scatter_chains`), or None."""
    base, dim = first.args[0], first.args[2]
    rank = rank_of(base)
    size = static_size(base, dim % rank) if rank is not None else None
    chain, prev = [first], base
    while True:
        last = chain[-1]
        if not _reads_only_slot(prev, last):
            return None
        following = [u for u in last.users if u.target is _aten.select_scatter.default
                     and u.args[0] is last and u.args[2] == dim]
        if len(following) != 1 or len(chain) == size:
            break
        chain.append(following[0])
        prev = last
    if size != len(chain) or size < 2 or [c.args[3] % size for c in chain] != \
            list(range(size)) or any(_written(c) is None for c in chain):
        return None
    return chain


def _reads_only_slot(prev: fx.Node, write: fx.Node) -> bool:
    """Whether ``prev`` (the value ``write`` writes into) is read only by ``write`` and by
    the select its written value copies into."""
    return all(u is write or (u.target is _aten.select.int and set(u.users) <= {write.args[1]})
               for u in prev.users)


def _written(write: fx.Node) -> fx.Node | None:
    """The value a ``select_scatter`` writes: its ``src``, or what a ``copy`` into the slot
    copies when it has the slot's shape and dtype."""
    src = write.args[1]
    if not isinstance(src, fx.Node):
        return None
    if src.target is _aten.copy.default:
        slot, value = src.args[0].meta.get("val"), src.args[1].meta.get("val")
        if isinstance(slot, torch.Tensor) and isinstance(value, torch.Tensor) \
                and slot.shape == value.shape and slot.dtype == value.dtype:
            return src.args[1]
        return None
    return src




def rank_of(node: fx.Node) -> int | None:
    """The rank of ``node``'s tensor value, or None."""
    val = node.meta.get("val")
    return val.dim() if isinstance(val, torch.Tensor) else None


def static_size(node: fx.Node, axis: int) -> int | None:
    """The size of ``node``'s value on ``axis`` when it is a plain int, else None."""
    val = node.meta.get("val")
    size = val.shape[axis] if isinstance(val, torch.Tensor) else None
    return size if isinstance(size, int) else None
