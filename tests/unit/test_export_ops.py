"""ONNX translations of the ops DiT stages use (conv, chunk, flatten, permute, repeats)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tppc.artifact.writer.to_onnx import to_onnx

ort = pytest.importorskip("onnxruntime")


class _PatchBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(4, 8, kernel_size=2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).flatten(2).permute(0, 2, 1)           # (b, tokens, 8)
        a, b = h.chunk(2, dim=-1)
        rep = torch.repeat_interleave(a, 2, dim=-1) + b.repeat(1, 1, 2)
        return rep * torch.sigmoid(h)


def test_dit_patch_ops_translate_to_onnx_and_match_torch():
    model = _PatchBlock().eval()
    x = torch.randn(2, 4, 8, 8)
    gm = torch.export.export(model, (x,)).module()
    for node in list(gm.graph.nodes):  # drop torch.export's input guards (a call_module)
        if node.op == "call_module":
            gm.graph.erase_node(node)
    gm.recompile()
    proto = to_onnx(gm, sym_name="chunk")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), atol=1e-5, rtol=1e-5)
