"""A re-rolled loop: one graph node that steps a recurrence over the positions of its inputs.

Terms:
    step: the body of a Python loop over positions that torch.export unrolled, as a
        GraphModule ``step(*carries, *rows, *invariants) -> (*new_carries, output)``.
    carry: a value one step passes to the next (Mamba's ``ssm_state``); its value before the
        first step is the loop's *init* (``zeros``), an input of the node.
    rows: the position's slice of each sliced input (``discrete_A[:, :, t]``): the input with
        its token axis (``xs_dims``) removed.
    invariants: inputs every step reads whole (weights, the step's constants).
    output: the step's one collected value; the node returns the outputs of every position
        stacked along ``out_dim`` (``torch.stack(outputs, dim=out_dim)``).

``LoopScan`` is the node's target (an fx ``call_function`` of a callable object): called on
``(*inits, *xs, *invariants)`` it runs the step once per position of ``xs`` (however many the
current chunk has) with the same ops in the same order as the unrolled loop, so its result is
bit-identical to eager. :meth:`LoopScan.run` also returns the final carries: the state a
chunk leaves for the next (:mod:`tppc.passes.chunking.loop_state`). On fake tensors
(shape propagation with a symbolic length) it runs the step once and returns an empty
tensor of the stacked shape, so the length stays symbolic.

Example:
    >>> loop = LoopScan(step, carries=1, xs_dims=(1,), out_dim=1, source="model.py:12")
    >>> loop(torch.zeros(2, 4), torch.randn(2, 7, 4)).shape        # doctest: +SKIP
    torch.Size([2, 7, 4])
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["LoopScan", "is_loop_scan"]

_IDS = itertools.count()


class LoopScan:
    """The target of a re-rolled loop node (see the module docstring).

    Attributes:
        step: the step GraphModule.
        carries: how many carries (the first inputs, and the first outputs of ``step``).
        xs_dims: the token axis of each sliced input (after the carries).
        out_dim: the axis the outputs are stacked along (of the node's value).
        source: where the loop is in the model's source (``file:line``), for messages.
        with_state: return ``(outputs, *final carries)`` instead of the outputs.
        block: rows per step: 1 (a position, ``select``; outputs stacked), or ``b`` (a
            block of ``b`` rows, ``narrow``; outputs of ``b`` rows concatenated).
    """

    def __init__(self, step: fx.GraphModule, *, carries: int, xs_dims: tuple[int, ...],
                 out_dim: int, source: str, with_state: bool = False, block: int = 1) -> None:
        self.step = step
        self.block = block
        self.with_state = with_state
        self.carries = carries
        self.xs_dims = tuple(xs_dims)
        self.out_dim = out_dim
        self.source = source
        self.__name__ = f"loop_scan_{next(_IDS)}"  # fx's code generation names it so
        self.__module__ = __name__
        self.__qualname__ = self.__name__

    def __repr__(self) -> str:
        state = (", with_state=True" if self.with_state else "") + \
            (f", block={self.block}" if self.block > 1 else "")
        return f"LoopScan(carries={self.carries}, xs_dims={self.xs_dims}, " \
            f"out_dim={self.out_dim}, source={self.source!r}{state})"

    def __call__(self, *args: Any) -> Any:
        return self.run(*args) if self.with_state else self.run(*args)[0]

    def stateful(self) -> LoopScan:
        """The same loop returning ``(outputs, *final carries)`` (a chunk's form)."""
        return LoopScan(self.step, carries=self.carries, xs_dims=self.xs_dims,
                        out_dim=self.out_dim, source=self.source, with_state=True,
                        block=self.block)

    def split(self, args: tuple[Any, ...]) -> tuple[list[Any], list[Any], list[Any]]:
        """``(inits, xs, invariants)`` of the node's arguments."""
        k, m = self.carries, len(self.xs_dims)
        return list(args[:k]), list(args[k:k + m]), list(args[k + m:])

    def run(self, *args: Any) -> tuple[torch.Tensor, ...]:
        """``(stacked outputs, *final carries)`` of the loop over every position of ``xs``."""
        carries, xs, invariants = self.split(args)
        rows = xs[0].shape[self.xs_dims[0]]
        if any(isinstance(x, FakeTensor) for x in (*carries, *xs)) \
                or isinstance(rows, torch.SymInt):
            return self._fake(carries, xs, invariants, rows)
        outputs = []
        for t in range(int(rows) // self.block):
            result = self.step(*carries, *self._rows(xs, t), *invariants)
            carries, out = list(result[:self.carries]), result[self.carries]
            outputs.append(out)
        if self.block > 1:
            return (torch.cat(outputs, dim=self.out_dim), *carries)
        return (torch.stack(outputs, dim=self.out_dim), *carries)

    def _rows(self, xs: list[Any], t: int) -> list[Any]:
        """The inputs of step ``t``: position ``t``, or the ``t``-th block of rows."""
        if self.block == 1:
            return [x.select(d, t) for x, d in zip(xs, self.xs_dims, strict=True)]
        return [x.narrow(d, t * self.block, self.block)
                for x, d in zip(xs, self.xs_dims, strict=True)]

    def _fake(self, carries: list[Any], xs: list[Any], invariants: list[Any], rows: Any
              ) -> tuple[torch.Tensor, ...]:
        """One step on the first rows, the outputs' stacked shape (see the module docstring)."""
        result = self.step(*carries, *self._rows(xs, 0), *invariants)
        out = result[self.carries]
        shape = list(out.shape)
        if self.block > 1:
            shape[self.out_dim] = rows
        else:
            shape.insert(self.out_dim, rows)
        finals = [c.new_empty(c.shape) for c in result[:self.carries]]
        return (out.new_empty(shape), *finals)


def is_loop_scan(node: fx.Node) -> bool:
    """Whether ``node`` calls a re-rolled loop."""
    return node.op == "call_function" and isinstance(node.target, LoopScan)
