"""Stage graphs make their tensors on the stage's device, not the capture's (issue 30)."""

from __future__ import annotations

import pytest
import torch

import tppc
from tppc import examples
from tppc.driver.emit import build_program
from tppc.passes.stages.place_constructors import place_constructors


class _Positions(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device, dtype=x.dtype)
        mask = torch.full((x.shape[1],), 2.0, device=x.device)
        return x + pos[None, :, None] * mask[None, :, None]


def _graph() -> torch.fx.GraphModule:
    x = torch.randn(2, 5, 3)
    return torch.export.export(_Positions(), (x,)).module()


def _devices(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.kwargs["device"]) for n in gm.graph.nodes if "device" in n.kwargs}


def test_constructors_follow_the_stage_device_and_run_there() -> None:
    gm = _graph()
    assert "cpu" in _devices(gm)
    x = torch.randn(2, 5, 3, device="meta")
    moved = place_constructors(gm, torch.device("meta"))
    assert moved >= 2 and _devices(gm) == {"meta"}
    out = gm(x)
    assert out.device.type == "meta" and out.shape == (2, 5, 3)


def test_the_capture_device_is_left_as_it_is() -> None:
    gm = _graph()
    x = torch.randn(2, 5, 3)
    want = gm(x)
    assert place_constructors(gm, torch.device("cpu")) == 0
    torch.testing.assert_close(gm(x), want, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt", "dit", "hf_flux"])
def test_each_familys_stage_graphs_name_only_their_own_device(family: str) -> None:
    """A compiled family's program emitted for ``cpu`` and ``meta`` (a stand-in for a second
    device): every node of a stage that names a device names that stage's, and its weights
    live there (issue 30: nodes copied from the capture kept ``device=cpu``)."""
    model, args, kwargs = getattr(examples, family)()
    kwargs = {k: v for k, v in kwargs.items() if k != "return_dict"}
    cp = tppc.compile(model, args, kwargs, num_stages=2, verify=False)
    front = cp.captures.example
    length = cp.context.example_seq
    plan = cp.program(length).plan
    program = build_program(front.chunk, front.ctx, plan, devices=["cpu", "meta"])
    for stage, device in zip(program.stages, ("cpu", "meta"), strict=True):
        named = {torch.device(n.kwargs["device"]).type for n in _nodes(stage.module)
                 if n.kwargs.get("device") is not None}
        for sub in stage.module.modules():
            named |= {t.device.type for t in (*sub.parameters(recurse=False),
                                              *sub.buffers(recurse=False))}
        assert named <= {device}, (family, stage.index, named)
    assert any(n.kwargs.get("device") is not None for st in program.stages
               for n in _nodes(st.module)), "no constructor: the check would be empty"


def _nodes(module: torch.nn.Module) -> list[torch.fx.Node]:
    """The nodes of every graph in ``module`` (the stage's and its positional program's)."""
    return [n for sub in module.modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes]
