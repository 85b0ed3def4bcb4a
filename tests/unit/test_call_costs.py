"""Whole calls of a static graph priced on one device (text encoders, VAE decoders)."""

from __future__ import annotations

import pytest
import torch

from tests.oracles import assert_kernels_close
from tppc.cost_models.call_costs import live_nodes, price_call
from tppc.cost_models.cluster import device_preset
from tppc.errors import CaptureError
from tppc.frontend.static_export import export_static


class Mlp(torch.nn.Module):
    def __init__(self, scaled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.scaled = scaled
        self.register_buffer("w2", self.b.weight.detach() * 2)

    def forward(self, x):
        h = torch.relu(self.a(x))
        # the same product two ways: a weight-only op (w * 2, a constant) or a stored buffer
        w = self.b.weight * 2 if self.scaled else self.w2
        return h @ w.t()


class Decoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 6, 3, padding=1)

    def decode(self, z):
        return (torch.nn.functional.interpolate(self.conv(z), scale_factor=2),)


def test_matmul_and_conv_flops_are_the_hand_count() -> None:
    cpu = device_preset("cpu")
    mlp = price_call(export_static(Mlp(False), (torch.randn(1, 10, 16),)), cpu)
    assert mlp.matrix_flops == 2 * 10 * (16 * 32 + 32 * 8)
    dec = price_call(export_static(Decoder(), (torch.randn(1, 4, 5, 7),), method="decode"), cpu)
    assert dec.matrix_flops == 2 * 6 * 4 * 9 * 5 * 7
    assert dec.weight_bytes == (6 * 4 * 9 + 6) * 4
    assert dec.unpriced == ()  # upsampling has a rule


def test_weight_only_ops_are_constants_and_time_grows_with_the_input() -> None:
    cpu = device_preset("cpu")
    stored = price_call(export_static(Mlp(False), (torch.randn(1, 10, 16),)), cpu)
    scaled_gm = export_static(Mlp(True), (torch.randn(1, 10, 16),))
    scaled = price_call(scaled_gm, cpu)
    assert scaled.bytes == stored.bytes and scaled.matrix_flops == stored.matrix_flops
    assert any(n.op == "call_function" and n.name not in live_nodes(scaled_gm)
               for n in scaled_gm.graph.nodes)  # the weight-only product is there, not live
    longer = price_call(export_static(Mlp(False), (torch.randn(1, 400, 16),)), cpu)
    assert longer.seconds > stored.seconds and longer.activation_bytes > stored.activation_bytes


def test_a_component_torch_export_refuses_is_named() -> None:
    class Branchy(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x

    with pytest.raises(CaptureError, match="Branchy.forward"):
        export_static(Branchy(), (torch.randn(3),))


def test_examples_made_under_inference_mode_are_captured() -> None:
    """torch.export refuses inference tensors as inputs ("cannot be saved for backward");
    tppc copies them, so an example recorded under ``torch.inference_mode()`` works."""
    import tppc

    with torch.inference_mode():
        x = torch.randn(1, 12, 16)
    gm = export_static(Mlp(False), (x,))
    assert price_call(gm, device_preset("cpu")).matrix_flops > 0
    captured, ctx = tppc.capture(Mlp(False), (x,))
    assert ctx.example_seq == 12
    out = captured(x.clone())
    assert_kernels_close(out[0] if isinstance(out, tuple | list) else out, Mlp(False)(x.clone()))
