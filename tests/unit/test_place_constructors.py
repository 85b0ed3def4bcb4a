"""Stage graphs make their tensors on the stage's device, not the capture's (issue 30)."""

from __future__ import annotations

import torch

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
