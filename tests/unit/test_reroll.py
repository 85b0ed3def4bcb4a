"""The re-roller on small unrolled graphs: one LoopScan node when the steps are one
computation, its reason otherwise (tppc.frontend.reroll)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tppc
from tppc.frontend.reroll import RerollError, reroll_loops
from tppc.ir.loop_scan import LoopScan, is_loop_scan


class _Linear(nn.Module):
    """``h_t = a_t · h_{t−1} + x_t`` per channel, outputs ``h_t · w`` stacked on axis 1."""

    def __init__(self, first: str = "zeros", final: bool = False) -> None:
        super().__init__()
        self.w, self.first, self.final = nn.Parameter(torch.randn(3)), first, final

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(x)
        h = torch.zeros(x.shape[0], x.shape[2])
        outs = []
        for t in range(x.shape[1]):
            h = x[:, t] if (t == 0 and self.first == "row") else a[:, t] * h + x[:, t]
            outs.append(h * self.w)
        y = torch.stack(outs, dim=1)
        return y + h.sum() if self.final else y


def _unrolled(model: nn.Module, length: int = 4) -> tuple[torch.fx.GraphModule, torch.Tensor]:
    x = torch.randn(2, length, 3)
    return torch.export.export(model, (x,), strict=False).module(), x


def test_a_linear_recurrence_becomes_one_loop_node_that_runs_any_length() -> None:
    torch.manual_seed(0)
    model = _Linear().eval()
    gm, x = _unrolled(model)
    assert reroll_loops(gm, "model.py:1") == 1
    loops = [n for n in gm.graph.nodes if is_loop_scan(n)]
    assert len(loops) == 1 and not any(n.target is torch.ops.aten.stack.default
                                       for n in gm.graph.nodes)
    loop: LoopScan = loops[0].target
    assert (loop.carries, loop.xs_dims, loop.out_dim) == (1, (1, 1), 1)
    assert torch.equal(gm(x), model(x))
    longer = torch.randn(2, 9, 3)  # the node steps over however many rows it is given
    args = [longer if a.op == "placeholder" else None for a in loops[0].args]
    assert args[0] is None  # the initial carry is zeros made in the graph
    init = torch.zeros(2, 3)
    out, final = loop.stateful()(init, torch.sigmoid(longer), longer, model.w.detach())
    assert torch.equal(out, model(longer).detach()) and final.shape == (2, 3)


def test_a_first_step_unlike_the_others_is_refused() -> None:
    gm, _ = _unrolled(_Linear(first="row"))
    with pytest.raises(RerollError, match="first step"):
        reroll_loops(gm, "model.py:1")


def test_a_final_state_read_after_the_loop_is_refused() -> None:
    gm, _ = _unrolled(_Linear(final=True))
    with pytest.raises(RerollError, match=r"read by .* outside the loop \(the final state"):
        reroll_loops(gm, "model.py:1")


class _ReadsAll(nn.Module):
    """A step that reads every position of ``x`` (all of them, at each step)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], x.shape[2])
        outs = []
        for t in range(x.shape[1]):
            h = torch.tanh(h + (x * x[:, t, None, :]).sum(1)) + x[:, t]
            outs.append(h)
        return x + torch.stack(outs, dim=1)


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.blocks = nn.Embedding(8, 3), nn.ModuleList([_ReadsAll(), _ReadsAll()])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return x


def test_a_step_reading_every_position_is_refused_by_annotation() -> None:
    with pytest.raises(tppc.AnnotationError, match=r"(?s)re-rolled loop .*test_reroll\.py:\d+ "
                       r"in forward.* whole at every step"):
        tppc.compile(_LM().eval(), (torch.randint(0, 8, (1, 5)),), cluster="2xcpu")
