"""``tppc.cost_report``: capture and annotate a model, then price each layer on a device."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tppc.cost_models.cluster import Cluster
from tppc.cost_models.report import CostReport, report_from_graph
from tppc.frontend.front_end import capture_front_end

__all__ = ["cost_report"]


def cost_report(
    model: torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any] | None = None,
    *,
    cluster: Cluster | str,
    chunk: int,
    prefix: int = 0,
    seq_len: int | None = None,
    device_index: int = 0,
) -> CostReport:
    """Per-layer FLOPs, bytes, intensity, bound and time for one chunk on one device.

    Prints as a table; ``.formula(layer)`` gives the sympy formula, ``.to_json()`` the data.
    The model is captured as ``tppc.plan`` captures it (the same front end, identical blocks
    captured once: :func:`tppc.frontend.front_end.capture_front_end`), so the report prices
    the layers the planner prices.
    """
    front = capture_front_end(model, args, kwargs, seq_dims=None, plan_only=True)
    return report_from_graph(front.chunk, front.ctx, cluster=cluster, chunk=chunk,
                             prefix=prefix, seq_len=seq_len, device_index=device_index)
