"""The op-rule table (tppc.ir.op_rules): the annotation pass and the cost model read one table.

The oracle for "attention" is torch's own op registry: ``scaled_dot_product_attention`` and
every forward kernel it decomposes to (``aten._scaled_dot_product_*``, not the backwards).
Each is captured in a small two-block model; the annotation pass must recognise it (SDPA
becomes ``mixing``, a fused kernel is refused by name, never taken as a row-wise op) and
the cost model must price it as attention, with SDPA's FLOPs.
"""

from __future__ import annotations

import operator

import pytest
import torch
from torch import nn

import tppc
from tppc import examples
from tppc.cost_models.node_costs import graph_node_costs, tensor_vals
from tppc.errors import AnnotationError
from tppc.ir.op_rules import OP_RULES, OpRule, op_rule, ops_with
from tppc.ir.records import TOKEN

_A = torch.ops.aten
SDPA_KERNELS = sorted(n for n in dir(_A) if "scaled_dot_product" in n
                      and not n.endswith("_backward"))
"""SDPA and its forward kernels as torch registers them (independent of tppc's table)."""


def _name(key: object) -> str:
    return key if isinstance(key, str) else key.__name__


def _call(name: str):
    """``(q, k, v) -> out`` calling ``aten.<name>`` with the arguments its schema needs."""
    op = getattr(_A, name).default
    if name in ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        return lambda q, k, v: op(q, k, v, None, False)  # attn_bias, compute_log_sumexp
    return op


class _Block(nn.Module):
    def __init__(self, attend) -> None:
        super().__init__()
        self.attend = attend
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v)
        out = out[0] if isinstance(out, tuple) else out
        return x + out.transpose(1, 2).reshape(1, -1, 16)


class _Model(nn.Module):
    def __init__(self, attend) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.layers = nn.ModuleList([_Block(attend), _Block(attend)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return x


IDS = torch.randint(0, 50, (1, 16), generator=torch.Generator().manual_seed(0))


def _attention_nodes(gm: torch.fx.GraphModule, name: str) -> list[torch.fx.Node]:
    packet = getattr(_A, name)
    return [n for n in gm.graph.nodes if getattr(n.target, "overloadpacket", None) is packet]


def test_the_attention_rule_is_sdpa_and_every_kernel_it_decomposes_to() -> None:
    """…and tppc::softmax_attention, what hand-written attention is folded into."""
    attention = ops_with(lambda rule: rule.role == "attention")
    assert sorted(_name(k) for k in attention) == sorted([*SDPA_KERNELS, "softmax_attention"])


def test_what_annotation_treats_as_attention_is_what_the_cost_model_prices_as_attention() -> None:
    assert ops_with(lambda r: r.role == "attention") == ops_with(lambda r: r.price == "attention")


@pytest.mark.parametrize("name", SDPA_KERNELS)
def test_annotation_recognises_every_attention_op(name: str) -> None:
    model = _Model(_call(name)).eval()
    if name == "scaled_dot_product_attention":
        gm, _ = tppc.annotate(model, (IDS,))
        assert [n.meta[TOKEN].role for n in _attention_nodes(gm, name)] == ["mixing"] * 2
        return
    with pytest.raises(AnnotationError, match=f"{name}.*fused attention kernel"):
        tppc.annotate(model, (IDS,))


@pytest.mark.parametrize("name", SDPA_KERNELS)
def test_the_cost_model_prices_every_attention_op_like_sdpa(name: str) -> None:
    def attention_costs(kernel: str) -> list:
        seq = {"ids": {1: torch.export.Dim("s", min=4, max=1024)}}
        gm = torch.export.export(_Model(_call(kernel)).eval(), (IDS,), dynamic_shapes=seq)
        gm = gm.module()
        costs = graph_node_costs(gm)
        return [costs[n.name] for n in _attention_nodes(gm, kernel)]

    sdpa = attention_costs("scaled_dot_product_attention")
    costs = attention_costs(name)
    assert [c.kind for c in costs] == ["attention"] * 2
    assert [c.matrix_flops for c in costs] == [c.matrix_flops for c in sdpa]
    assert all(c.matrix_flops != 0 for c in costs)


def test_an_in_place_variant_and_a_python_callable_take_their_ops_rule() -> None:
    assert op_rule(_A.cumsum_.default) is OP_RULES[_A.cumsum]
    assert op_rule(torch.nn.functional.scaled_dot_product_attention).role == "attention"
    assert op_rule(operator.getitem).aliases
    assert op_rule(_A.erfinv.default) == OpRule()  # unknown: row-wise, unpriced


@pytest.mark.parametrize("factory", [examples.gpt, examples.dit])
def test_every_op_the_cost_model_prices_has_a_rule(factory) -> None:
    """The cost model's kinds follow the table: no op is priced by a rule the table lacks."""
    model, args, _ = factory()
    gm, _ = tppc.annotate(model, args)
    costs = graph_node_costs(gm)
    for node in (n for n in gm.graph.nodes if n.op == "call_function"):
        cost, rule = costs[node.name], op_rule(node.target)
        if cost.kind == "const" or not tensor_vals(node.meta.get("val")):
            continue  # runs once per call, or a size: free whatever the op
        expected = {"matrix": {"matrix"}, "attention": {"attention"}, "vector": {"vector"},
                    "memory": {"memory", "create", "lookup", "convert", "vector", None},
                    "view": {"free", "convert", None}}[cost.kind]
        assert rule.price in expected, (node.name, node.target, cost.kind, rule)
        assert cost.unpriced == (rule.price is None), (node.name, node.target)
