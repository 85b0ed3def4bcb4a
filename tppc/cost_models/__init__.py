"""Hardware cost model: device and link specs, presets, calibration, per-layer prices.

Modules (one concern each):
    specs        MatrixUnit, VectorUnit, Memory, DeviceSpec, LinkSpec (validated records)
    presets      H100/H200/H20/A100/V100/TPU v4-v5p devices; NVLink, PCIe, ICI, Ethernet,
                 InfiniBand links
    cluster      Cluster: a chain of devices in nodes, ``Cluster.parse("4x(8xh20)@ib-ndr")``
    collective_costs  ``collective_cost``: all-reduce, all-gather, reduce-scatter, all-to-all
                 by algorithm (ring, tree, hierarchical) on the links a group crosses
    calibration  ``calibrate("cpu")``: micro-benchmarks → DeviceSpec (cached JSON)
    device_benchmarks  the micro-benchmarks ``calibrate`` runs (matmul curve, bandwidth, overheads)
    unpriced     the warning for ops without a rule (the rules: :mod:`tppc.ir.op_rules`)
    node_shapes  the symbols c, p, L and node shapes in them (the token substitution)
    node_costs   FLOPs and bytes of one fx node as sympy in (c, p, L)
    roofline     a node's time terms on a device (tile padding, skinny matmuls, attention)
    layer_pricer node costs summed per layer (``LayerExpr``), memoised across identical blocks
    compiled_times  layer times lambdified once over (c, p, L), bound to a length
    layer_costs  per-layer roofline time(c, p) → :class:`CostTable` for the planner
    report       ``report_from_graph``: a per-layer table, formulas and JSON
    table        the CostTable contract read by the planner
    shard_costs  one worker's share of a node under tensor parallelism (``ShardRole``)
    group_costs  the cost table whose rows are tensor-parallel groups (shards + collectives)
"""

from __future__ import annotations

from tppc.cost_models.calibration import calibrate
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.collective_costs import CollectiveCost, collective_cost
from tppc.cost_models.layer_costs import build_cost_table, layer_expressions
from tppc.cost_models.presets import DEVICE_PRESETS, LINK_PRESETS
from tppc.cost_models.report import CostReport, report_from_graph
from tppc.cost_models.specs import DeviceSpec, LinkSpec, MatrixUnit, Memory, VectorUnit
from tppc.cost_models.table import CostTable, LayerCost, LinkCost
from tppc.cost_models.unpriced import UnpricedOpWarning

__all__ = [
    "DEVICE_PRESETS",
    "LINK_PRESETS",
    "Cluster",
    "CollectiveCost",
    "CostReport",
    "CostTable",
    "DeviceSpec",
    "LayerCost",
    "LinkCost",
    "LinkSpec",
    "MatrixUnit",
    "Memory",
    "UnpricedOpWarning",
    "VectorUnit",
    "build_cost_table",
    "calibrate",
    "collective_cost",
    "layer_expressions",
    "report_from_graph",
]
