"""ONNX translations of the ops recurrent layers add: ``logcumsumexp`` and ``cumprod`` as an
ONNX ``Scan`` over the tokens, ``softplus`` with torch's threshold, ``tril``/``triu``, ``pad``."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from tests.oracles import assert_kernels_close
from tppc.artifact.writer.to_onnx import to_onnx

ort = pytest.importorskip("onnxruntime")


class _Scans(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide = x.double() * 400.0  # log-space values 2000 apart: a global shift underflows
        lower = torch.tril(x[0, :4, :4], -1) + torch.triu(x[0, :4, :4])
        return (torch.logcumsumexp(wide, 1), torch.cumprod(1 + 0.1 * x, 1),
                F.softplus(x * 30.0), lower, F.pad(x, (0, 0, 2, 1), value=-1.0))


def test_recurrent_ops_translate_to_onnx_and_match_torch() -> None:
    model = _Scans().eval()
    x = torch.linspace(-2.5, 2.5, 2 * 12 * 3).reshape(2, 12, 3)
    gm = torch.export.export(model, (x,)).module()
    for node in list(gm.graph.nodes):  # drop torch.export's input guards and dtype asserts
        if node.op == "call_module" or node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()
    proto = to_onnx(gm, sym_name="chunk")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    outs = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        wants = model(x)
    assert torch.isfinite(wants[0]).all()
    for got, want in zip(outs, wants, strict=True):
        assert_kernels_close(torch.from_numpy(got), want)
