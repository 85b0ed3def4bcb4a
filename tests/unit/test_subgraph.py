"""The fx subgraph copier (tppc.passes.subgraph): slices compute what the whole graph computes.

Oracle: the eager model's own submodules (a slice from block 1's input to block 2's output
equals ``block2(block1(x))``), and the source graph's meta (annotations survive the copy).
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from tppc.errors import PassError
from tppc.passes.subgraph import copy_graph, copy_subgraph


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.third = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(torch.relu(self.second(torch.tanh(self.first(x)))))


@pytest.fixture
def traced() -> tuple[_Net, fx.GraphModule, dict[str, fx.Node]]:
    net = _Net().eval()
    gm = torch.export.export(net, (torch.randn(2, 8),)).module()
    nodes = {n.name: n for n in gm.graph.nodes}
    for i, n in enumerate(gm.graph.nodes):
        n.meta["tppc.test"] = i
    return net, gm, nodes


def _linears(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]


def test_a_slice_computes_what_the_model_computes_between_its_frontier_nodes(traced) -> None:
    net, gm, _ = traced
    first, second, _ = _linears(gm)
    body = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
    middle = body[body.index(first) + 1: body.index(second) + 1]  # tanh .. second linear
    middle += [a for n in middle for a in n.all_input_nodes if a.op == "get_attr"]
    part = copy_subgraph(gm, middle, second, inputs=[first])
    x = torch.randn(3, 8)
    h = net.first(x)
    torch.testing.assert_close(part(h), net.second(torch.tanh(h)))


def test_copied_nodes_keep_names_and_meta_and_the_source_is_untouched(traced) -> None:
    _, gm, nodes = traced
    first = _linears(gm)[0]
    part = copy_subgraph(gm, [first, *first.all_input_nodes], first,
                         inputs=[n for n in first.all_input_nodes if n.op == "placeholder"])
    copied = {n.name: n for n in part.graph.nodes if n.op != "output"}
    assert all(copied[name].meta["tppc.test"] == nodes[name].meta["tppc.test"]
               for name in copied)
    copied[first.name].meta["tppc.test"] = -1
    assert nodes[first.name].meta["tppc.test"] != -1


def test_placeholders_follow_inputs_in_order_with_their_new_names(traced) -> None:
    _, gm, _ = traced
    first, second, _ = _linears(gm)
    part = copy_subgraph(gm, [], (second, first), inputs=[second, first],
                         rename={first: "full_first"})
    names = [p.name for p in part.graph.find_nodes(op="placeholder")]
    assert names == [second.name, "full_first"]
    a, b = torch.randn(2, 8), torch.randn(2, 8)
    out = part(a, b)
    assert out[0] is a and out[1] is b


def test_a_value_read_but_neither_input_nor_copied_is_refused(traced) -> None:
    _, gm, _ = traced
    _, second, _ = _linears(gm)
    with pytest.raises(PassError, match=f"node {second.name!r} reads"):
        copy_subgraph(gm, [second], second)


def test_prune_drops_unused_nodes_and_their_parameters(traced) -> None:
    _, gm, _ = traced
    first, _, third = _linears(gm)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    kept = copy_subgraph(gm, list(gm.graph.nodes), first, inputs=placeholders, prune=True)
    assert [n.target for n in kept.graph.nodes if n.op == "call_function"] == [first.target]
    assert sum(p.numel() for p in kept.parameters()) == 8 * 8 + 8
    assert third.name not in {n.name for n in kept.graph.nodes}


def test_copy_graph_is_an_editable_copy(traced) -> None:
    net, gm, _ = traced
    copy = copy_graph(gm)
    x = torch.randn(2, 8)
    torch.testing.assert_close(copy(x), net(x))
    relu = next(n for n in copy.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.replace_all_uses_with(relu.args[0])
    copy.graph.erase_node(relu)
    copy.recompile()
    assert any(n.target is torch.ops.aten.relu.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), net(x))
