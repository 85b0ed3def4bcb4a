"""Whole calls of a static graph on one device: a pipeline's text encoder or VAE decoder.

The transformer of a diffusion pipeline is priced per chunk (:mod:`.layer_costs`); the
components around it (text encoders before the denoising loop, the VAE decoder after it)
run once per pipeline call on one device, whole. :func:`price_call` prices such a call from
a graph captured at fixed shapes (:func:`tppc.frontend.static_export.export_static`) with
the same per-node rules (:func:`.node_costs.node_cost`) and device constants
(:func:`.roofline.node_time_terms`) as the transformer: every node that reads an input runs
per call; nodes that read only weights are constants.

Example:
    >>> cost = price_call(gm, device_preset("a100-80gb"))  # doctest: +SKIP
    >>> cost.seconds, cost.weight_bytes                     # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
import torch
from torch import fx

from tppc.cost_models.node_costs import node_cost
from tppc.cost_models.node_shapes import Shapes, TokenSubstitution, tensor_vals
from tppc.cost_models.roofline import node_time_terms
from tppc.cost_models.specs import DeviceSpec
from tppc.errors import CostModelError

__all__ = ["CallCost", "live_nodes", "price_call"]


@dataclass(frozen=True)
class CallCost:
    """One call of a static graph on one device.

    Attributes:
        device_name: the device's preset name.
        seconds: predicted time of the call.
        matrix_flops: matmul and convolution FLOPs of the call.
        bytes: memory traffic of the call's kernels.
        weight_bytes: parameters and buffers the graph reads.
        activation_bytes: the largest sum of values alive at once during the call.
        unpriced: ops priced as memory traffic only (no rule in the op table).
    """

    device_name: str
    seconds: float
    matrix_flops: float
    bytes: float
    weight_bytes: int
    activation_bytes: int
    unpriced: tuple[str, ...] = ()


def live_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes that read an input (placeholder), directly or not."""
    live: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a.name in live for a in node.all_input_nodes):
            live.add(node.name)
    return live


def price_call(gm: fx.GraphModule, device: DeviceSpec, *,
               default_attention: str = "bidirectional", compute_dtype: str | None = None,
               fuse_elementwise: bool | None = None) -> CallCost:
    """Price one call of ``gm`` (captured at fixed shapes) on ``device``.

    Args:
        gm: a graph whose placeholders are the call's inputs and whose weights are
            ``get_attr`` nodes (``ExportedProgram.module()``), every shape static.
        device: the device.
        default_attention: attention nodes without a mask see every key (an encoder).
        compute_dtype: matmul rate to use; None uses each node's input dtype.
        fuse_elementwise: as in :func:`.layer_costs.build_cost_table` (None: on TPUs).

    Raises:
        CostModelError: a shape is symbolic (capture the component at fixed shapes).
    """
    fuse = device.name.startswith("tpu") if fuse_elementwise is None else fuse_elementwise
    subs = TokenSubstitution.build(None)
    shapes = Shapes(subs, default_attention)
    live = live_nodes(gm)
    seconds = flops = nbytes = 0.0
    unpriced: set[str] = set()
    for node in gm.graph.nodes:
        cost = node_cost(node, subs, default_attention=default_attention,
                         compute_dtype=compute_dtype, _shapes=shapes,
                         live=node.name in live)
        terms = node_time_terms(cost, device, fuse_elementwise=fuse)
        seconds += _number(terms.total(), node)
        if cost.kind not in ("const", "view"):  # as in a layer's work (layer_costs)
            flops += _number(cost.matrix_flops, node)
            nbytes += _number(cost.bytes, node)
        if cost.unpriced:
            unpriced.add(cost.op)
    return CallCost(device_name=device.name, seconds=seconds, matrix_flops=flops,
                    bytes=nbytes, weight_bytes=_weight_bytes(gm),
                    activation_bytes=_peak_live(gm, live), unpriced=tuple(sorted(unpriced)))


def _number(expr: object, node: fx.Node) -> float:
    value = sympy.sympify(expr)
    if value.free_symbols:
        raise CostModelError(
            f"node {node.name}: its cost depends on {sorted(map(str, value.free_symbols))}; "
            "capture the component at fixed shapes (tppc.frontend.static_export.export_static)"
        )
    return float(value)


def _bytes(node: fx.Node) -> int:
    return sum(t.numel() * t.element_size() for t in tensor_vals(node.meta.get("val")))


def _weight_bytes(gm: fx.GraphModule) -> int:
    seen: set[int] = set()
    total = 0
    for t in (*gm.parameters(), *gm.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    for node in gm.graph.find_nodes(op="get_attr"):  # constants lifted as attributes
        value = getattr(gm, str(node.target), None)
        if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) \
                and id(value) not in seen:
            seen.add(id(value))
            total += value.numel() * value.element_size()
    return total


def _peak_live(gm: fx.GraphModule, live: set[str]) -> int:
    """Largest sum of per-call values alive at once, in node order (each value is freed
    after its last reader)."""
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    last = {n.name: max((order[u.name] for u in n.users), default=order[n.name])
            for n in gm.graph.nodes}
    alive: dict[str, int] = {}
    total = peak = 0
    for node in gm.graph.nodes:
        if node.name in live and node.op != "output":
            alive[node.name] = _bytes(node)
            total += alive[node.name]
        peak = max(peak, total)
        for name in [k for k in alive if last[k] <= order[node.name]]:
            total -= alive.pop(name)
    return peak
