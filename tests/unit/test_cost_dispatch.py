"""Per-chunk dispatch overheads are priced (views, chunk-attention calls, the CPU expert loop),
so the planner stops cutting tiny chunks when dispatch dominates; oracles are hand counts."""

from __future__ import annotations

import dataclasses

import pytest
import sympy
import torch

from tppc import examples
from tppc.cost_models.cluster import Cluster
from tppc.cost_models.layer_costs import build_cost_table, layer_expressions
from tppc.cost_models.moe import FALLBACK_LAUNCHES_PER_EXPERT, expected_experts
from tppc.cost_models.node_costs import C, NodeCost, P
from tppc.cost_models.presets import LINK_PRESETS
from tppc.cost_models.roofline import node_time_terms
from tppc.cost_models.specs import DeviceSpec, MatrixUnit, Memory, VectorUnit
from tppc.frontend.annotate import annotate, program_of
from tppc.ir.records import LAYER
from tppc.planner.joint import plan_from_costs

pytest.importorskip("transformers")
_ZERO = sympy.Integer(0)
CPU = DeviceSpec(name="toy-cpu", matrix=MatrixUnit(peak_flops={"fp32": 1e11}, half_rows=8.0),
                 vector=VectorUnit(peak_flops=4e10), memory=Memory(bandwidth=4e10,
                                                                   capacity=2**34),
                 op_overhead=2.5e-6)


def _node(op: str, kind: str) -> NodeCost:
    return NodeCost("n", op, kind, _ZERO, (), _ZERO, _ZERO, "fp32")


def test_view_nodes_cost_the_view_overhead_and_getitem_and_const_nothing() -> None:
    spec = dataclasses.replace(CPU, view_overhead=1.5e-6)
    assert node_time_terms(_node("transpose", "view"), spec).overhead == 1.5e-6
    assert node_time_terms(_node("getitem", "view"), spec).overhead == 0.0
    assert node_time_terms(_node("arange", "const"), spec).overhead == 0.0
    assert node_time_terms(_node("transpose", "view"), CPU).overhead == 0.0  # preset default


def test_chunk_attention_pays_its_call_overhead_once() -> None:
    spec = dataclasses.replace(CPU, attention_overhead=2e-5)
    terms = node_time_terms(_node("chunk_attention", "attention"), spec)
    assert terms.overhead == pytest.approx(2.5e-6 + 2e-5)
    assert node_time_terms(_node("linear", "matrix"), spec).overhead == 2.5e-6


@pytest.fixture(scope="module")
def mixtral():
    gm, ctx = annotate(*examples.hf_mixtral(experts="grouped_mm", num_experts=4))
    return layer_expressions(program_of(gm, ctx), ctx.layers, CPU, 256,
                             seq_symbol=ctx.seq_symbol)[1]


def test_expert_loop_pays_op_overhead_per_touched_expert(mixtral) -> None:
    (gate_up, _) = [n for n in mixtral.nodes if n.op == "grouped_mm_fallback"]
    for c in (1, 4, 100):
        touched = float(expected_experts(4, sympy.Integer(2 * c)))  # top-2
        want = CPU.op_overhead * (2 + FALLBACK_LAUNCHES_PER_EXPERT * touched)
        got = float(sympy.sympify(node_time_terms(gate_up, CPU).overhead).subs(C, c))
        assert got == pytest.approx(want)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    gm, ctx = annotate(*examples.hf_llama())
    return program_of(gm, ctx), ctx


def test_layer_time_grows_by_the_views_and_attention_calls_it_runs(llama) -> None:
    program, ctx = llama
    slow = dataclasses.replace(CPU, view_overhead=1e-5, attention_overhead=1e-4)
    base = layer_expressions(program, ctx.layers, CPU, 512, seq_symbol=ctx.seq_symbol)[1]
    more = layer_expressions(program, ctx.layers, slow, 512, seq_symbol=ctx.seq_symbol)[1]
    name = base.info.name
    nodes = [n for n in program.graph.nodes if n.op == "call_function"
             and n.meta.get(LAYER) == name]
    attention = sum("chunk_attention" in str(n.target) for n in nodes)
    views = sum(bool(getattr(n.target, "is_view", False)) for n in nodes)  # torch's own flag
    delta = float((more.time - base.time).subs({C: 16, P: 64}))
    assert attention == 1 and views >= 4
    priced_views = round((delta - 1e-4 * attention) / 1e-5)
    assert views <= priced_views <= len(nodes) - attention  # every true view, never a kernel
    assert delta == pytest.approx(1e-4 * attention + 1e-5 * priced_views)


def test_planner_cuts_fewer_chunks_when_dispatch_dominates(llama) -> None:
    program, ctx = llama

    def chunks(spec: DeviceSpec) -> int:
        cluster = Cluster(devices=(spec, spec), links=(LINK_PRESETS["shm"],))
        table = build_cost_table(program, ctx.layers, cluster, 512, seq_symbol=ctx.seq_symbol)
        return len(plan_from_costs(table, granularity=16, num_stages=2).chunks)

    cheap = chunks(CPU)
    costly = chunks(dataclasses.replace(CPU, op_overhead=1e-3, view_overhead=1e-3,
                                        attention_overhead=1e-2))
    assert cheap > 2 and costly < cheap
