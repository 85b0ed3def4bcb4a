"""Dispatch overheads of a stage graph run eagerly: what a chunk costs besides its kernels.

Terms:
    view overhead: seconds per view node (``view``, ``transpose``, ``slice``, ``narrow``,
        ``unsqueeze``...). A view moves no data, but a stage graph runs each one as an ATen
        call (Python, dispatcher, a new tensor's metadata): on one CPU thread about as much
        as a tiny elementwise op. Paid per chunk per node, so many small chunks pay it many
        times.
    attention overhead: seconds per ``tppc::chunk_attention`` call besides the one op
        overhead the roofline already charges: the custom-op dispatch and the per-chunk mask
        (``arange`` × 2, compare, output allocation, slice copy). Measured by calling the
        op itself on a tiny chunk, so a change of its kernel is priced on recalibration.

Both are measured (on CPU only; datasheet presets leave them at 0, where kernels run
asynchronously and hide the host's dispatch) by :func:`tppc.cost_models.calibrate` with the
same fastest-of-batches timer as the other terms.

Example:
    >>> from tppc.cost_models.device_benchmarks import timer  # doctest: +SKIP
    >>> measure = timer(torch.device("cpu"))             # doctest: +SKIP
    >>> view_overhead(measure) < 1e-5                     # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["VIEW_CHAIN", "attention_overhead", "view_overhead"]

Timer = Callable[[Callable[[], object], int], float]

VIEW_CHAIN = 8
"""View calls per timed run of :func:`view_overhead`."""


def view_overhead(measure: Timer) -> float:
    """Seconds per ATen view call on a tiny tensor, called as a stage graph calls it."""
    aten = torch.ops.aten
    x = torch.randn(1, 8, 16)

    def chain() -> None:
        y = aten.view.default(x, [1, 8, 2, 8])
        y = aten.transpose.int(y, 1, 2)
        y = aten.slice.Tensor(y, 3, 0, 4)
        y = aten.unsqueeze.default(y, 0)
        y = aten.squeeze.dim(y, 0)
        y = aten.narrow.default(y, 2, 0, 4)
        y = aten.expand.default(y, [1, 2, 4, 4])
        aten.alias.default(y)

    with torch.inference_mode():
        return measure(chain, 7) / VIEW_CHAIN


def attention_overhead(measure: Timer, op_overhead: float) -> float:
    """Seconds of one tiny causal ``tppc::chunk_attention`` call beyond ``op_overhead``.

    A chunk of 4 queries after 4 prefix tokens, 2 heads of 8 over an 8-key buffer: its
    arithmetic is negligible, so the time is the op's fixed cost per call.
    """
    from tppc.ir import ops  # noqa: F401  (registers torch.ops.tppc)

    q = torch.randn(1, 2, 4, 8)
    k, v = torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    op = torch.ops.tppc.chunk_attention.default
    with torch.inference_mode():
        seconds = measure(lambda: op(q, k, v, 4, True), 7)
    return max(seconds - op_overhead, 0.0)
